"""The evaluation board (`asyncrl.runtime.evaluation`): evaluations pinned to a weight version, leased to agents
at that version, results carrying another version refused, a dead agent's prompts handed out again, an
evaluation nobody can finish reported incomplete, verl's metric names, and the schedule a checkpoint keeps."""

from __future__ import annotations

import pytest

from asyncrl.config.evaluation import EvalConfig
from asyncrl.runtime.evaluation import EvalBoard, pass_at_k
from asyncrl.types import Completion, Prompt


def prompts(k: int, source: str = "sums") -> list[Prompt]:
    return [Prompt([1, 2, i], data_source=source, ground_truth=str(i), index=i) for i in range(k)]


def samples(version: int, lengths=(3, 5)) -> list[Completion]:
    return [Completion(list(range(n)), [0.0] * n, [version] * n, "stop") for n in lengths]


def board(k=3, **cfg) -> EvalBoard:
    return EvalBoard(prompts(k), EvalConfig(**{"every_versions": 2, "n": 2, "temperature": 1.0, **cfg}), seed=5,
                     max_new_tokens=16, clock=iter(range(0, 1000, 10)).__next__)


def test_an_evaluation_is_due_every_k_versions_and_scheduled_once():
    b = board()
    assert [v for v in range(7) if b.due(v)] == [2, 4, 6]
    assert b.schedule(2) and not b.schedule(2)
    assert b.busy()


def test_prompts_go_only_to_agents_holding_the_evaluations_version():
    b = board()
    b.schedule(2)
    assert b.lease("a", 1, 5) == [] and b.lease("a", None, 5) == []
    tasks = b.lease("a", 2, 2)
    assert [(t.version, t.unit) for t in tasks] == [(2, 0), (2, 1)] and b.holds("a") == 2
    assert tasks[0].params.n == 2 and tasks[0].params.max_new_tokens == 16 and tasks[0].params.temperature == 1.0
    b.schedule(4)
    assert [(t.version, t.unit) for t in b.lease("b", 4, 5)] == [(4, 0), (4, 1), (4, 2)]
    # the same prompt samples with the same seed in every evaluation (versions compared on the same draws)
    again = board()
    again.schedule(8)
    assert again.lease("x", 8, 1)[0].params.seed == tasks[0].params.seed


def test_a_result_with_a_token_of_another_version_is_refused_and_handed_out_again():
    b = board(k=1)
    b.schedule(2)
    [task] = b.lease("a", 2, 1)
    mixed = samples(2) + [Completion([7, 8], [0.0, 0.0], [2, 3], "stop")]
    assert not b.submit("a", task, mixed, [1.0, 1.0, 1.0])
    assert b.settle({2}) == []  # nothing accepted yet
    [again] = b.lease("b", 2, 1)
    assert again.unit == task.unit
    assert b.submit("b", again, samples(2), [1.0, 0.0])
    [outcome] = b.settle({2})
    assert outcome.complete and outcome.refused == 1 and outcome.metrics()["val/refused_results"] == 1


def test_a_dead_agents_prompts_go_to_another_agent_at_the_same_version_and_its_late_result_is_refused():
    b = board(k=2)
    b.schedule(2)
    first = b.lease("a", 2, 2)
    assert b.agent_failed("a") == 2 and b.holds("a") == 0
    assert not b.submit("a", first[0], samples(2), [1.0, 1.0])  # fenced: the lease is gone
    for task in b.lease("b", 2, 2):
        assert b.submit("b", task, samples(2), [1.0, 0.0])
    [outcome] = b.settle({2})
    assert outcome.complete and outcome.prompts == 2


def test_an_evaluation_no_live_agent_can_finish_is_reported_incomplete():
    b = board(k=3)
    b.schedule(2)
    [task] = b.lease("a", 2, 1)
    assert b.submit("a", task, samples(2), [1.0, 1.0])
    b.lease("a", 2, 1)
    assert b.settle({4}) == []  # a prompt is still leased: its agent may finish it
    b.agent_failed("a")
    [outcome] = b.settle({4})
    assert not outcome.complete and len(outcome.results) == 1
    metrics = outcome.metrics()
    assert metrics["val/complete"] == 0.0 and metrics["val/prompts"] == 1 and metrics["val/prompts_planned"] == 3
    assert "INCOMPLETE (1 of 3 prompts)" in outcome.line()
    assert not b.busy()


def test_metrics_have_verls_names_and_values_per_data_source():
    b = EvalBoard(prompts(2, "sums") + prompts(1, "gsm8k"), EvalConfig(at_end=True, n=4, temperature=0.6), seed=0,
                  max_new_tokens=8)
    b.schedule(6, "end")
    rewards = {0: [1, 0, 0, 0], 1: [1, 1, 1, 1], 2: [0, 0, 0, 0]}
    for task in b.lease("a", 6, 3):
        assert b.submit("a", task, samples(6, (2, 4, 6, 8)), rewards[task.unit])
    [outcome] = b.settle({6})
    m = outcome.metrics()
    assert m["val/version"] == 6 and m["val/complete"] == 1.0 and m["val/prompts"] == 3
    assert m["val-core/sums/reward/mean@4"] == pytest.approx(5 / 8)
    assert m["val-core/gsm8k/reward/mean@4"] == 0.0
    assert m["val-aux/sums/reward/pass@1"] == pytest.approx((0.25 + 1.0) / 2)
    assert m["val-aux/sums/reward/pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["val-aux/sums/reward/pass@4"] == 1.0 and m["val-aux/gsm8k/reward/pass@4"] == 0.0
    assert m["val-aux/sums/response_length/mean"] == 5.0
    assert outcome.line().startswith("eval v6: gsm8k 0.000, sums 0.625 (mean@4 over 3 prompts")


@pytest.mark.parametrize("n, c, k, want", [(4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 0, 4, 0.0), (4, 4, 1, 1.0),
                                           (10, 3, 5, 1 - 21 / 252)])
def test_pass_at_k_golden_values(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_the_schedule_a_checkpoint_keeps():
    """Ended evaluations are not run again; an open one is returned so the resume can re-run it at its version."""
    b = board(k=1)
    b.schedule(2)
    [task] = b.lease("a", 2, 1)
    b.submit("a", task, samples(2), [1.0, 1.0])
    b.settle({2})
    b.schedule(4)
    state = b.state_dict()
    assert state == {"reported": [2], "open": [4]}
    resumed = board(k=1)
    assert resumed.load_state_dict(state) == [4]
    assert not resumed.schedule(2) and resumed.schedule(4)


def test_bad_eval_flags_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--eval.n 4 is invalid: greedy decoding \(--eval.temperature 0\)"):
        EvalConfig(every_versions=2, n=4).validate()
    with pytest.raises(ValueError, match=r"--eval.max-share 0 is invalid: must lie in \(0, 1\]"):
        EvalConfig(every_versions=2, max_share=0).validate()
    with pytest.raises(ValueError, match="--eval.data held.csv is invalid: must be .jsonl or .parquet"):
        EvalConfig(every_versions=2, data=("held.csv",)).validate()
    with pytest.raises(ValueError, match="nothing schedules an evaluation of it: add --eval.every-versions K"):
        EvalConfig(data=("held.jsonl",)).validate()
    assert EvalConfig(n=8, temperature=1.0).k_values() == [1, 2, 4, 8]
    assert EvalConfig(n=6, temperature=1.0).k_values() == [1, 2, 4, 6]


def test_the_roster_hands_out_evaluation_prompts_within_the_share_and_takes_a_dead_agents_back():
    """Through the roster: an agent gets evaluation prompts of the version it holds first, at most `eval_slots`
    at a time, then training prompts; declared dead, its evaluation prompts go to another agent at that version,
    and its late result is fenced."""
    from asyncrl.data.sources import GeneratedSource
    from asyncrl.runtime.queue import SampleQueue, Task
    from asyncrl.runtime.roster import Fenced, Roster

    queue = SampleQueue(GeneratedSource(lambda i: Prompt([3, i % 50], data_source="sums", index=i)),
                        max_required_samples=64)
    b = board(k=4)
    roster = Roster(queue, agent_timeout_s=60, evals=b, eval_slots=2)
    for name in ("a", "b"):
        roster.add(name, live=True)
        roster.synced(name, 2)
    assert not roster.evaluating("a")
    b.schedule(2)
    assert roster.evaluating("a") and roster.live_versions() == {2}
    got = roster.request("a", 5)
    evals = [t for t in got if not isinstance(t, Task)]
    assert [t.unit for t in evals] == [0, 1] and len(got) == 5  # two evaluation prompts, three training ones
    assert [t for t in roster.request("a", 2) if not isinstance(t, Task)] == []  # its share is full
    roster.declare_dead("a", "test")
    with pytest.raises(Fenced):
        roster.submit_eval("a", evals[0], samples(2), [1.0, 1.0])
    again = [t for t in roster.request("b", 8) if not isinstance(t, Task)]
    assert sorted(t.unit for t in again) == [0, 1]
    for task in again:
        roster.submit_eval("b", task, samples(2), [1.0, 0.0])
    rest = [t for t in roster.request("b", 8) if not isinstance(t, Task)]
    for task in rest:
        roster.submit_eval("b", task, samples(2), [1.0, 0.0])
    [outcome] = b.settle(roster.live_versions())
    assert outcome.complete and not roster.evaluating("b")


def test_an_agent_kept_on_old_weights_by_an_evaluation_takes_only_its_prompts_then_catches_up():
    """A publication the agent has not taken (it keeps its weights while their evaluation runs) leaves it no
    training prompt, whose stamp would be the new version and its lag one the budget never allowed; it takes
    evaluation prompts with every slot it asks for instead, and training prompts again once it holds the new
    version."""
    from asyncrl.data.sources import GeneratedSource
    from asyncrl.runtime.queue import SampleQueue, Task
    from asyncrl.runtime.roster import Roster

    queue = SampleQueue(GeneratedSource(lambda i: Prompt([3, i % 50], data_source="sums", index=i)),
                        max_required_samples=64, version=2)
    b = board(k=6)
    roster = Roster(queue, agent_timeout_s=60, evals=b, eval_slots=2)
    roster.add("a", live=True)
    roster.synced("a", 2)
    b.schedule(2)
    queue.new_version(3)  # the trainer published; "a" still holds 2
    got = roster.request("a", 5)
    assert [type(t) for t in got if isinstance(t, Task)] == [] and len(got) == 5  # past eval_slots (2)
    for task in got:
        roster.submit_eval("a", task, samples(2), [1.0, 0.0])
    assert [t.unit for t in roster.request("a", 5)] == [5]  # the last one; still no training prompt
    roster.synced("a", 3)
    assert [t.admitted_version for t in roster.request("a", 4)] == [3] * 4


def test_an_evaluation_falls_due_every_s_seconds_from_the_first_publication_then_from_each_opening():
    now = [100.0]
    b = EvalBoard(prompts(2), EvalConfig(every_seconds=30, n=2, temperature=1.0), seed=5, max_new_tokens=16,
                  clock=lambda: now[0])
    assert EvalConfig(every_seconds=30).enabled and not b.due(0)
    assert not b.due(1)  # the first publication starts the clock (start-up is not training)
    now[0] = 125.0
    assert not b.due(2)
    now[0] = 131.0
    assert b.due(3) and b.schedule(3)
    now[0] = 150.0
    assert not b.due(4)  # 19 s after the last opening
    now[0] = 161.5
    assert b.due(5)
    both = EvalBoard(prompts(2), EvalConfig(every_versions=4, every_seconds=1000, n=2, temperature=1.0), seed=5,
                     max_new_tokens=16, clock=lambda: now[0])
    assert [v for v in range(1, 9) if both.due(v)] == [4, 8]  # either schedule opens one
    with pytest.raises(ValueError, match="--eval.every-seconds -1"):
        EvalConfig(every_seconds=-1).validate()
