"""Your own code cannot stop an agent: a sync reward or environment step that hangs (a GIL-holding C call, as
model output can provoke) is cut off by killing its worker process, counted, and named once in the log, while
everything else goes on; an async reward that blocks its event loop is named. Last, a real multi-process run
with such a reward trains on: the agent keeps heartbeating and is never declared dead."""

from __future__ import annotations

import logging
import pathlib

import pytest

from asyncrl.tools.background_loop import BackgroundLoop
from asyncrl.data.scoring import Scorer
from asyncrl.envs import EpisodeRunner
from asyncrl.envs.isolated import runs_isolated
from asyncrl.envs.registry import load_env
from asyncrl.policies import Engine, SamplingParams
from asyncrl.rewards.plugin import RewardTable
from asyncrl.rpc.agent_server import USER_CODE_MODULES
from asyncrl.rpc.worker_pool import WorkerPool
from asyncrl.types import Completion, Prompt
from tests.envs.helpers import Recording, run_episodes, runtime
from tests.policies.helpers import small_config, tiny_model
from tests.rpc.jobs import TOY, Job
from tests.timing import limit

pytestmark = pytest.mark.timeout(limit(400))

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "user_code"
REWARD = f"{FIXTURES / 'hostile_reward.py'}:score"
ENV = f"{FIXTURES / 'hanging_env.py'}:HangsOnOddRows"


@pytest.fixture
def workers():
    pool = WorkerPool(4, name="test-user-code", preload=USER_CODE_MODULES)  # a worker per episode below
    yield pool
    pool.close()


def _completion(ids: list[int]) -> Completion:
    return Completion(token_ids=ids, logprobs=[0.0] * len(ids), versions=[0] * len(ids), finish_reason="stop")


@pytest.mark.e2e
def test_a_sync_reward_that_hangs_scores_0_is_counted_and_named_once_and_the_rest_is_scored(workers, caplog):
    scorer = Scorer(RewardTable.from_specs([REWARD]), timeout_s=1.0, workers=workers)
    prompt = Prompt([1, 2], data_source="toy", index=5)
    with caplog.at_level(logging.WARNING, logger="asyncrl.data.scoring"):
        group = scorer.score_group(prompt, [_completion([2, 4]), _completion([7, 1]), _completion([3, 4])])
        again = scorer.score_group(prompt, [_completion([14, 2])])
    assert group.rewards == [1.0, 0.0, 0.5] and group.timeouts == 1 and group.errors == 0
    assert again.rewards == [0.0] and scorer.timeouts == 2
    named = [r.getMessage() for r in caplog.records if "did not return within 1 s" in r.getMessage()]
    assert len(named) == 1, named
    assert "hostile_reward.py:score" in named[0] and "data_source='toy', row 5" in named[0]
    assert "its worker process was killed and replaced" in named[0]
    assert workers.killed == 2


@pytest.mark.e2e
def test_an_environment_of_your_own_lives_in_a_worker_and_a_hung_step_ends_only_its_episodes(workers, caplog):
    factory = load_env(ENV)
    assert runs_isolated(ENV, factory) and not runs_isolated("retry", load_env("retry"))
    engine = Recording(Engine(tiny_model(0), small_config(max_slots=8, max_len=64)))
    env_runtime = runtime(factory, max_turn_tokens=4, step_timeout_s=1.0)
    env_runtime.isolated_spec, env_runtime.workers = ENV, workers
    runner = EpisodeRunner(engine, env_runtime)
    prompts = [Prompt([5, 9, 11], index=0), Prompt([6, 9, 11], index=1)]  # the odd row's second step hangs
    with caplog.at_level(logging.WARNING, logger="asyncrl.envs.runner"):
        groups = run_episodes(runner, engine, prompts, SamplingParams(n=2, max_new_tokens=40, seed=4))
    runner.close()
    good, bad = groups["p0"], groups["p1"]
    assert good.env_stats["env_timeouts"] == 0 and good.env_stats["turns"] == 6
    assert bad.env_stats["env_timeouts"] == 2 and bad.env_rewards == [0.0, 0.0]
    assert all(not any(c.loss_mask) for c in bad.completions)
    named = [r.getMessage() for r in caplog.records if "did not return within 1 s" in r.getMessage()]
    assert len(named) == 1 and "row 1" in named[0] and "worker process was killed" in named[0]


def test_a_coroutine_that_blocks_the_event_loop_is_named(caplog):
    import asyncio
    import time

    async def stalls():
        time.sleep(1.0)

    loop = BackgroundLoop(4, name="test-loop", blocked_warn_s=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger="asyncrl.tools.background_loop"):
            loop.submit(stalls()).result(limit(30))
            loop.submit(asyncio.sleep(0.6)).result(limit(30))  # awaiting is not blocking
    finally:
        loop.stop()
    assert loop.stalls == 1
    message = next(r.getMessage() for r in caplog.records if "blocked for" in r.getMessage())
    assert "stalls (" in message and "test_user_code_isolation.py" in message


@pytest.mark.e2e
@pytest.mark.slow
def test_a_run_whose_reward_hangs_on_some_responses_trains_on_with_its_agent_alive(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTILE_REWARD_COUNT", str(tmp_path / "hangs"))
    job = Job(tmp_path, *TOY, "--reward.fn", f"{FIXTURES / 'hostile_reward.py'}:score_hangs_twice",
              "--reward.timeout-s", "1", "--async-training.total-versions", "6",
              "--async-training.agent-timeout-s", str(limit(10)))
    try:
        assert job.finish(limit(300)) == 0, job.tail()
    finally:
        job.kill()
    summary = job.summary()
    assert summary["steps"] == 6 and summary["agents"]["agent0"]["status"] != "dead", summary["agents"]
    assert (tmp_path / "hangs").read_text() == "xx"  # two calls hung, each holding its worker's GIL
    assert max(m.get("reward/timeouts", 0) for m in job.metrics()) >= 1
    text = job.text()
    assert text.count("did not return within 1 s") == 1 and "hostile_reward.py:score_hangs_twice" in text
    assert "declared dead" not in text  # the agent kept heartbeating while its reward hung
