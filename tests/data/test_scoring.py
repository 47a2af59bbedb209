"""The scorer: picking the reward by data source, scoring a group (sync in the caller's thread, async on the
scorer's event loop with bounded concurrency and a timeout per call), and counting failures instead of
crashing unless strict. No model is loaded; completions are token ids (text: the ids joined by spaces)."""

from __future__ import annotations

import asyncio
import math
import textwrap
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.data.scoring import MAX_ERROR_EXAMPLES, RewardError, ScoredGroup, Scorer
from asyncrl.rewards import even_token_reward
from asyncrl.rewards.plugin import RewardTable
from asyncrl.types import Completion, Prompt
from tests.timing import limit


def _completions(*ids_per_completion) -> list[Completion]:
    return [Completion(list(ids), [0.0] * len(ids), [0] * len(ids), "stop") for ids in ids_per_completion]


def _flaky(text: str, ground_truth: str) -> float:
    """Raises on every response whose first token id is odd."""
    if int(text.split()[0]) % 2:
        raise RuntimeError("reward server said no")
    return 1.0


class _Overlap:
    """An async reward that records how many of its calls run at once; each call waits `hold_s`."""

    def __init__(self, hold_s: float = 0.05):
        self.hold_s, self.running, self.most = hold_s, 0, 0

    async def __call__(self, text: str, ground_truth: str) -> float:
        self.running += 1  # only the scorer's loop thread touches these
        self.most = max(self.most, self.running)
        await asyncio.sleep(self.hold_s)
        self.running -= 1
        return 1.0


@pytest.fixture
def scorers():
    """Scorers made by a test, closed at its end (their event loop threads stop)."""
    made = []
    yield lambda *args, **kwargs: made.append(Scorer(*args, **kwargs)) or made[-1]
    for scorer in made:
        scorer.close()


# --- picking the reward, decoding, the one-completion API ------------------------------------------------------------


def test_scorer_picks_the_reward_by_data_source_and_decodes_ids():
    scorer = Scorer({"toy": even_token_reward, "ones": lambda text, gt: 1.0})
    completion = _completions([2, 3, 4, 6])[0]
    assert scorer(Prompt([1], data_source="toy"), completion) == 0.75  # 3 of 4 ids are even
    assert scorer(Prompt([1], data_source="ones"), completion) == 1.0
    assert scorer.score(Prompt([1], data_source="toy"), completion) == (0.75, "2 3 4 6")
    with pytest.raises(ValueError, match=r"no reward for data_source 'gsm8k' \(row 7\): known data sources: ones, "
                                         r"toy; pass --reward\.fn PATH\.py:NAME"):
        scorer(Prompt([1], data_source="gsm8k", index=7), completion)
    assert Scorer({"toy": even_token_reward}, default="toy")(Prompt([1], data_source="other"), completion) == 0.75
    assert scorer.calls == 3 and scorer.errors == 0  # the unknown data source never reached a reward


def test_a_group_gets_one_reward_and_text_per_completion_and_extras_where_returned():
    def reward(text: str, ground_truth: str):
        first = int(text.split()[0])
        return {"score": first / 10, "acc": first > 2, "pred": text} if first % 2 else first / 10

    group = Scorer({"x": reward}).score_group(Prompt([1], data_source="x"), _completions([1, 5], [2], [3], [4, 4]))
    assert group == ScoredGroup(rewards=[0.1, 0.2, 0.3, 0.4], texts=["1 5", "2", "3", "4 4"],
                                extras={"acc": [0.0, 1.0]}, errors=0, timeouts=0)


def test_a_plugin_gets_the_row_through_the_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "row_reward.py").write_text(textwrap.dedent("""
        def score(response, ground_truth, *, extra_info, ability):
            return {"score": float(response == ground_truth), "level": extra_info["level"], "ability": ability}
    """))
    scorer = Scorer(RewardTable.from_specs(["row_reward.py:score"]))
    prompt = Prompt([1], data_source="mine", ground_truth="5", extra_info={"level": 3}, fields={"ability": "math"})
    group = scorer.score_group(prompt, _completions([5], [6]))
    assert group.rewards == [1.0, 0.0] and group.extras == {"level": [3.0, 3.0]}  # "ability" is a string: dropped


def test_sync_rewards_run_in_the_calling_thread_and_their_future_is_done():
    threads = []
    scorer = Scorer({"x": lambda text, gt: threads.append(threading.current_thread()) or 1.0})
    future = scorer.submit_group(Prompt([1], data_source="x"), _completions([1], [2]))
    assert future.done() and future.result().rewards == [1.0, 1.0]
    assert threads == [threading.current_thread()] * 2


# --- failures: counted, or fatal when strict -----------------------------------------------------------------------


def test_a_raising_reward_counts_or_is_fatal_when_strict():
    odd, even = _completions([3, 4], [2, 4])
    scorer = Scorer({"x": _flaky})
    prompt = Prompt([1], data_source="x", index=12)
    assert scorer(prompt, odd) == 0.0 and scorer.errors == 1
    assert scorer(prompt, even) == 1.0 and scorer.errors == 1
    assert scorer.error_examples == ["tests.data.test_scoring:_flaky raised RuntimeError: reward server said no "
                                     "for data_source='x', row 12"]
    with pytest.raises(RewardError, match=r"_flaky raised RuntimeError: reward server said no for data_source='x', "
                                          r"row 12$") as err:
        Scorer({"x": _flaky}, strict=True)(prompt, odd)
    assert isinstance(err.value, RuntimeError) and isinstance(err.value.__cause__, RuntimeError)


def test_nan_counts_and_its_message_names_function_source_and_row(tmp_path):
    path = tmp_path / "nan_reward.py"
    path.write_text("def score(response, ground_truth):\n    return float('nan') if response == '1' else 1.0\n")
    scorer = Scorer(RewardTable.from_specs([f"x={path}:score"]))
    group = scorer.score_group(Prompt([1], data_source="x", index=12), _completions([1], [2], [1]))
    assert group.rewards == [0.0, 1.0, 0.0] and group.errors == 2 and scorer.errors == 2
    assert scorer.error_examples == ["nan_reward.py:score returned nan for data_source='x', row 12"]
    strict = Scorer(RewardTable.from_specs([f"x={path}:score"]), strict=True)
    with pytest.raises(RewardError, match=r"^nan_reward\.py:score returned nan for data_source='x', row 12$"):
        strict.score_group(Prompt([1], data_source="x", index=12), _completions([2], [1]))
    future = strict.submit_group(Prompt([1], data_source="x", index=12), _completions([1]))
    assert future.done() and isinstance(future.exception(), RewardError)


def test_error_examples_keep_the_first_distinct_messages_and_errors_the_total():
    def picky(text: str, ground_truth: str) -> float:
        raise ValueError(f"cannot parse {ground_truth}")

    scorer = Scorer({"x": picky})
    for i in range(10):
        scorer.score_group(Prompt([1], data_source="x", ground_truth=str(i), index=i), _completions([1], [2]))
    assert scorer.errors == scorer.calls == 20
    assert len(scorer.error_examples) == MAX_ERROR_EXAMPLES
    assert scorer.error_examples[0].endswith("picky raised ValueError: cannot parse 0 for data_source='x', row 0")


@given(st.lists(st.one_of(st.floats(-10, 10), st.sampled_from([math.nan, math.inf, -math.inf, "oops"])),
                min_size=1, max_size=8))
def test_failures_score_zero_and_the_rest_score_as_returned(values):
    scorer = Scorer({"x": lambda text, gt: values[int(text)]})
    group = scorer.score_group(Prompt([1], data_source="x"), _completions(*[[i] for i in range(len(values))]))
    ok = [isinstance(v, float) and math.isfinite(v) for v in values]
    assert group.rewards == [v if good else 0.0 for v, good in zip(values, ok)]
    assert group.errors == scorer.errors == ok.count(False) and group.timeouts == 0


# --- async rewards -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, max_concurrency", [(8, 3), (4, 16), (1, 1)])
def test_async_calls_of_a_group_overlap_up_to_max_concurrency(scorers, n, max_concurrency):
    reward = _Overlap()
    scorer = scorers({"x": reward}, max_concurrency=max_concurrency)
    group = scorer.score_group(Prompt([1], data_source="x"), _completions(*[[i] for i in range(n)]))
    assert group.rewards == [1.0] * n
    assert reward.most == min(n, max_concurrency)


def test_the_concurrency_limit_holds_across_groups(scorers):
    reward = _Overlap()
    scorer = scorers({"x": reward}, max_concurrency=3)
    futures = [scorer.submit_group(Prompt([1], data_source="x"), _completions([1], [2])) for _ in range(4)]
    assert [f.result(timeout=limit(30)).rewards for f in futures] == [[1.0, 1.0]] * 4
    assert reward.most == 3 and scorer.calls == 8


def test_submit_group_returns_before_an_async_reward_finishes(scorers):
    gate = threading.Event()

    async def judge(text: str, ground_truth: str) -> float:
        while not gate.is_set():
            await asyncio.sleep(0.005)
        return 0.5

    scorer = scorers({"x": judge})
    future = scorer.submit_group(Prompt([1], data_source="x"), _completions([1], [2]))
    assert not future.done()  # the judge is still waiting: the caller may go on generating
    gate.set()
    assert future.result(timeout=limit(30)).rewards == [0.5, 0.5]


def test_a_timeout_scores_zero_and_counts(scorers):
    async def judge(text: str, ground_truth: str) -> float:
        if int(text) % 2:
            await asyncio.sleep(600)  # cancelled at the timeout
        return 1.0

    scorer = scorers({"x": judge}, timeout_s=0.5)
    group = scorer.score_group(Prompt([1], data_source="x"), _completions([1], [2], [3], [4]))
    assert group.rewards == [0.0, 1.0, 0.0, 1.0] and group.timeouts == 2 and group.errors == 0
    assert scorer.timeouts == 2 and scorer.errors == 0 and scorer.calls == 4


def test_a_raising_async_reward_counts_or_is_fatal_when_strict(scorers):
    async def judge(text: str, ground_truth: str) -> float:
        if int(text) % 2:
            raise ConnectionError("judge unreachable")
        return 1.0

    prompt = Prompt([1], data_source="x", index=3)
    scorer = scorers({"x": judge})
    group = scorer.score_group(prompt, _completions([1], [2]))
    assert group.rewards == [0.0, 1.0] and group.errors == 1 and scorer.errors == 1
    assert "judge raised ConnectionError: judge unreachable for data_source='x', row 3" in scorer.error_examples[0]
    strict = scorers({"x": judge}, strict=True)
    with pytest.raises(RewardError, match=r"judge raised ConnectionError: judge unreachable for data_source='x', "
                                          r"row 3"):
        strict.score_group(prompt, _completions([2], [1]))


def test_close_stops_the_loop_thread_and_a_later_async_call_starts_another():
    def loop_threads():
        return [t for t in threading.enumerate() if t.name == "asyncrl-rewards"]

    before = len(loop_threads())
    scorer = Scorer({"x": _Overlap(hold_s=0.0)})
    assert len(loop_threads()) == before  # started on first async use only
    assert scorer.score_group(Prompt([1], data_source="x"), _completions([1])).rewards == [1.0]
    assert len(loop_threads()) == before + 1
    scorer.close()
    deadline = time.monotonic() + limit(10)
    while len(loop_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(loop_threads()) == before
    with scorer:
        assert scorer.score_group(Prompt([1], data_source="x"), _completions([1])).rewards == [1.0]
    assert scorer.calls == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="no reward functions given"):
        Scorer({})
    with pytest.raises(ValueError, match=r"timeout_s=0 must be > 0"):
        Scorer({"x": _flaky}, timeout_s=0)
    with pytest.raises(ValueError, match=r"max_concurrency=0 must be >= 1"):
        Scorer({"x": _flaky}, max_concurrency=0)

