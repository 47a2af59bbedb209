"""Scoring: data_source -> pure reward function; a reward function that raises counts instead of crashing
(reward 0, `reward/errors` in the run's metrics), unless strict."""

import copy

import pytest

from asyncrl.config import GRPO, AsyncConfig, OptimConfig, RolloutConfig, TrainerConfig
from asyncrl.data import GeneratedSource, Scorer
from asyncrl.learner import build_learner
from asyncrl.policies import ARCH_PRESETS, Engine, EngineConfig, random_model
from asyncrl.rewards import even_token_reward
from asyncrl.rpc.local import LocalRun
from asyncrl.types import Completion, Prompt


def _flaky(text: str, ground_truth: str) -> float:
    """Raises on every response whose first token id is odd."""
    if int(text.split()[0]) % 2:
        raise RuntimeError("reward server said no")
    return 1.0


def test_scorer_picks_the_reward_by_data_source_and_decodes_ids():
    scorer = Scorer({"toy": even_token_reward, "ones": lambda text, gt: 1.0})
    completion = Completion([2, 3, 4, 6], [0.0] * 4, [0] * 4, "stop")
    assert scorer(Prompt([1], data_source="toy"), completion) == 0.75  # 3 of 4 ids are even
    assert scorer(Prompt([1], data_source="ones"), completion) == 1.0
    assert scorer.score(Prompt([1], data_source="toy"), completion)[1] == "2 3 4 6"
    with pytest.raises(ValueError, match="no reward function for data_source='gsm8k'"):
        scorer(Prompt([1], data_source="gsm8k"), completion)
    assert Scorer({"toy": even_token_reward}, default="toy")(Prompt([1], data_source="other"), completion) == 0.75


def test_a_raising_reward_counts_or_is_fatal_when_strict():
    completion_odd = Completion([3, 4], [0.0, 0.0], [0, 0], "stop")
    completion_even = Completion([2, 4], [0.0, 0.0], [0, 0], "stop")
    scorer = Scorer({"x": _flaky})
    prompt = Prompt([1], data_source="x")
    assert scorer(prompt, completion_odd) == 0.0 and scorer.errors == 1
    assert scorer(prompt, completion_even) == 1.0 and scorer.errors == 1
    with pytest.raises(RuntimeError, match="reward server said no"):
        Scorer({"x": _flaky}, strict=True)(prompt, completion_odd)


def test_reward_errors_reach_the_run_metrics_and_the_run_continues():
    policy = random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.1), seed=1)
    engine = Engine(copy.deepcopy(policy), EngineConfig(max_slots=16, max_len=32))
    state = build_learner(policy, TrainerConfig(mini_batch_size=2, optim=OptimConfig(lr=1e-3)), GRPO())
    source = GeneratedSource(lambda i: Prompt([5 + i % 20, 9, 11], data_source="x", index=i))
    rows = []
    run = LocalRun(state, [engine], source, Scorer({"x": _flaky}), RolloutConfig(n=4, max_new_tokens=6, max_slots=16),
                   AsyncConfig(staleness_threshold=0.0, total_versions=3, take_timeout_s=60),
                   log_metrics=lambda m, v: rows.append(m))
    summary = run.run()
    assert summary.versions == 3
    errors = [m["reward/errors"] for m in rows]
    assert errors[-1] > 0, "odd first tokens happen; their rewards raised and must be counted"
    assert errors == sorted(errors)  # cumulative
    # the agent keeps generating after the last trained group was scored, so its count can only be larger
    assert errors[-1] <= run.agents[0].scorer.errors
