"""Scoring in a run: a reward function that raises counts instead of crashing (reward 0, `reward/errors` in
the run's metrics). The scorer itself is tested in tests/data/test_scoring.py."""

import copy

from asyncrl.config import GRPO, AsyncConfig, OptimConfig, RolloutConfig, TrainerConfig
from asyncrl.data import GeneratedSource, Scorer
from asyncrl.learner import build_learner
from asyncrl.policies import ARCH_PRESETS, Engine, EngineConfig, random_model
from asyncrl.rpc.local import LocalRun
from asyncrl.runtime.run_log import QuietLog
from asyncrl.types import Prompt
from tests.timing import limit


def _flaky(text: str, ground_truth: str) -> float:
    """Raises on every response whose first token id is odd."""
    if int(text.split()[0]) % 2:
        raise RuntimeError("reward server said no")
    return 1.0


class _Rows(QuietLog):
    """The run's log: keeps every version's row."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict] = []

    def __call__(self, metrics: dict, step: int) -> None:
        self.rows.append(metrics)


def test_reward_errors_reach_the_run_metrics_and_the_run_continues():
    policy = random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.1), seed=1)
    engine = Engine(copy.deepcopy(policy), EngineConfig(max_slots=16, max_len=32))
    state = build_learner(policy, TrainerConfig(mini_batch_size=2, optim=OptimConfig(lr=1e-3)), GRPO())
    source = GeneratedSource(lambda i: Prompt([5 + i % 20, 9, 11], data_source="x", index=i))
    log = _Rows()
    run = LocalRun(state, [engine], source, Scorer({"x": _flaky}), RolloutConfig(n=4, max_new_tokens=6, max_slots=16),
                   AsyncConfig(staleness_threshold=0.0, total_versions=3, take_timeout_s=limit(60)),
                   run_log=log)
    summary = run.run()
    assert summary.versions == 3
    errors = [m["reward/errors"] for m in log.rows]
    assert errors[-1] > 0, "odd first tokens happen; their rewards raised and must be counted"
    assert errors == sorted(errors)  # cumulative
    # the agent keeps generating after the last trained group was scored, so its count can only be larger
    assert errors[-1] <= run.agents[0].scorer.errors
