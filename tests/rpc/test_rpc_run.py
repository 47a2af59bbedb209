"""The multi-process launcher (asyncrl.rpc.supervise.launch: one trainer process, agent processes, RPC for control
and samples, a weight channel per agent) on CPU: a stale + partial run learns the toy task; a killed agent and a
hung agent are detected and their prompts re-admitted; a weight channel whose peer is gone or hung raises.

Every test is bounded by pytest-timeout (a hang guard derived from tests/timing.py)."""

from __future__ import annotations

import re

import pytest

from asyncrl.config import GRPO, AsyncConfig, OptimConfig, RolloutConfig, TrainerConfig
from asyncrl.learner.publication import published_weights
from asyncrl.policies.loading import random_model
from asyncrl.rpc.spec import AgentSpec, ModelSpec, RunSpec
from asyncrl.rpc.supervise import launch
from tests.envs.helpers import even_turns_runtime
from tests.rpc.collective import run_channel_drill
from tests.rpc.faults import FaultyEngines
from tests.rpc.helpers import MODEL_CONFIG, MODEL_SEED, scorer, source
from tests.timing import agent_timeout, detection_margin, limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(limit(300))]

MINI = 4


def make_spec(agents: list[AgentSpec], *, total_versions: int, agent_timeout_s: float = 60.0,
              sync_timeout_s: float = limit(60), rpc_timeout_s: float = limit(60), concurrent_prompts: int | None = None,
              lr: float = 3e-3, max_new_tokens: int = 8, env_setup=None, **async_kw) -> RunSpec:
    config = dict(staleness_threshold=0.5, trigger_parameter_sync_step=2, partial_rollout=True,
                  take_timeout_s=limit(120))
    config.update(async_kw)
    return RunSpec(model=ModelSpec(config=MODEL_CONFIG, seed=MODEL_SEED), algorithm=GRPO(),
                   trainer=TrainerConfig(mini_batch_size=MINI, optim=OptimConfig(lr=lr)),
                   rollout=RolloutConfig(n=4, max_new_tokens=max_new_tokens, max_slots=32, max_prompt_length=8,
                                         max_concurrent_prompts=concurrent_prompts),
                   async_=AsyncConfig(total_versions=total_versions, agent_timeout_s=agent_timeout_s,
                                      sync_timeout_s=sync_timeout_s, **config),
                   source_factory=source, scorer_factory=scorer, agents=agents, rpc_timeout_s=rpc_timeout_s,
                   env_setup=env_setup)


def assert_books_balance(summary, spec: RunSpec, *, every_version: bool = True) -> None:
    ledger = summary.ledger
    assert ledger["in_flight"] == ledger["pending"] == ledger["queued"] == 0, ledger
    assert ledger["admitted"] == ledger["trained"] + ledger["dropped"], ledger
    batch = spec.async_.require_batches * spec.trainer.mini_batch_size
    # every learner step trained a full batch of distinct prompts (the ledger raises on a second training)
    assert ledger["trained"] == summary.steps * batch, (ledger, summary.steps)
    if every_version:
        assert summary.steps >= spec.async_.total_versions * spec.async_.trigger_parameter_sync_step


def assert_reward_rose(summary, margin: float = 0.05) -> None:
    """The mean reward of the last two versions beats the first two's by `margin`."""
    scores = [m["critic/score/mean"] for m in summary.history]
    first, last = sum(scores[:2]) / 2, sum(scores[-2:]) / 2
    assert last > first + margin, f"reward did not rise: {[round(x, 3) for x in scores]}"


def place(spec: RunSpec, knobs: dict) -> RunSpec:
    """A mode's placement: colocated modes put an engine in each of 2 trainer ranks."""
    if knobs.get("colocated"):
        spec.trainer_devices, spec.colocate = ["cpu", "cpu"], True
    return spec


def test_three_process_stale_partial_run_learns_the_toy_task():
    spec = make_spec([AgentSpec(), AgentSpec()], total_versions=10, lr=6e-3)
    summary = launch(spec)
    assert summary.versions == 10 and summary.dead_agents == []
    assert_books_balance(summary, spec)
    assert len(summary.history) == 10
    assert_reward_rose(summary)
    # the knobs were in effect: verl's window, and weights published to both agents every version
    max_required = int(MINI * 1 * 1.5 * 2)
    assert all(m["fully_async/static/max_required_samples"] == max_required for m in summary.history)
    assert all(0 <= m["fully_async/count/staleness_samples"] <= max_required for m in summary.history)
    assert all(m["fully_async/sync_failures"] == 0 for m in summary.history)


MODES = {  # verl's modes, by their knobs: (RunSpec overrides, the largest version lag a trained token may have)
    "stale+partial": (dict(staleness_threshold=0.5, trigger_parameter_sync_step=2, partial_rollout=True), None),
    "one-step-off": (dict(staleness_threshold=1.0, trigger_parameter_sync_step=1, partial_rollout=False,
                          max_version_lag=1, lag_policy="wait"), 1),
    "colocated-sync": (dict(staleness_threshold=0.0, trigger_parameter_sync_step=1, partial_rollout=False,
                            colocated=True, concurrent_prompts=MINI // 2), 0),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_multi_turn_episodes_learn_across_processes_in_every_mode(mode):
    """Two-turn episodes whose environment rewards each turn (the toy task per turn): the environment's tokens
    travel between turns, every mode's lag bound holds with episodes, and the reward rises."""
    knobs, max_lag = MODES[mode]
    spec = make_spec([AgentSpec(), AgentSpec()], total_versions=10, lr=6e-3, max_new_tokens=16,
                     env_setup=even_turns_runtime, **knobs)
    summary = launch(place(spec, knobs))
    assert summary.versions == 10 and summary.dead_agents == []
    assert_books_balance(summary, spec)
    assert_reward_rose(summary)
    for m in summary.history:  # every episode had both turns, the environment answered in time, no failures
        assert m["env/turns_per_episode"] == 2 and m["env/errors"] == m["env/timeouts"] == 0, m
        assert 0 < m["env/trained_token_share"] < 1, m
        # the second turn continued its held K/V: of its prompt (3 + a turn of up to 4 tokens + 2 from the
        # environment), only the last sampled token and the environment's 2 were prefilled
        assert 0.6 <= m["env/reused_prompt_share"] <= 6 / 9 + 1e-9, m
        if max_lag is not None:
            assert m["training/version_lag/max"] <= max_lag, (mode, m["training/version_lag/max"])


def test_killed_agent_is_declared_dead_and_its_prompts_readmitted():
    killer = FaultyEngines(mode="kill", after=3, agents=("agent1",))
    spec = make_spec([AgentSpec(), AgentSpec(engine_factory=killer)], total_versions=6, concurrent_prompts=4)
    summary = launch(spec)
    assert summary.versions == 6
    assert summary.dead_agents == ["agent1"]
    assert_books_balance(summary, spec)
    last = summary.history[-1]
    assert last["fully_async/dead_agents"] == 1
    # it died holding work (it had 4 prompts and finished 3): that work went back to agent0
    assert last["fully_async/count/readmitted"] >= 1


def test_a_bucket_failing_mid_publication_leaves_the_agent_at_its_old_version_and_loses_nothing():
    """The weights reach an agent in buckets, the version with the last one: a bucket that fails halfway
    through a publication must not advance the agent's version (its half-loaded weights must never generate
    tokens stamped with either version); the agent is dropped, its work goes to the other."""
    faults = FaultyEngines(mode="bucket", after=2, agents=("agent1",))
    spec = make_spec([AgentSpec(), AgentSpec(engine_factory=faults)], total_versions=6, concurrent_prompts=4,
                     trigger_parameter_sync_step=1)
    summary = launch(spec)
    assert summary.versions == 6 and summary.dead_agents == ["agent1"]
    assert_books_balance(summary, spec)
    broken = summary.agents["agent1"]
    assert broken["last_version"] == 2, broken  # version 3's publication failed in its first bucket
    assert "injected: a weight bucket failed to load" in str(broken), broken
    assert summary.agents["agent0"]["last_version"] == 6
    assert sum(m["fully_async/sync_failures"] for m in summary.history) == 1
    # the run's versions went on with the healthy agent, one per window
    assert [m["fully_async/count/current_param_version"] for m in summary.history] == [1, 2, 3, 4, 5, 6]


def test_hung_agent_is_reported_within_about_the_agent_timeout(capfd):
    timeout = agent_timeout()
    # the healthy agent is slowed down so that the run outlasts the timeout (a tiny run is over in a second)
    faults = FaultyEngines(mode="hang", after=3, delay_s=0.02, agents=("agent1",))
    # the run goes on (agent0 feeds it) until some time after the death: a time budget, not a version count
    spec = make_spec([AgentSpec(engine_factory=faults), AgentSpec(engine_factory=faults)], total_versions=100_000,
                     agent_timeout_s=timeout, concurrent_prompts=4,
                     time_budget_s=timeout + detection_margin() + limit(5))
    summary = launch(spec)
    err = capfd.readouterr().err  # the child processes log to the inherited stderr
    assert summary.dead_agents == ["agent1"]
    assert_books_balance(summary, spec, every_version=False)
    silent = [float(s) for s in re.findall(r"rollout agent agent1 is dead \(silent for ([0-9.]+) s", err)]
    assert len(silent) == 1, err[-3000:]
    # declared dead about agent_timeout_s after its last heartbeat (the roster checks on its own thread), not
    # after an RPC or collective timeout of minutes
    assert timeout <= silent[0] <= timeout + detection_margin(), silent


# ---------------------------------------------------------------------------------- collectives
def test_weight_channel_with_a_gone_or_hung_peer_raises_instead_of_hanging():
    outcomes = run_channel_drill()
    for case, (outcome, seconds, detail) in outcomes.items():
        assert outcome == "raised" and seconds < limit(10), (case, outcome, seconds, detail)
    # the hung peer's channel raised on its own timeout (3 s), not on a closed connection
    assert 2.0 <= outcomes["hung peer, sending"][1], outcomes


# ------------------------------------------------------------------------ trainer groups, colocation
def test_two_trainer_ranks_and_two_agents_learn_with_fsdp2():
    """The scaled layout (issue: FSDP2 trainer group + several agents): 2 trainer ranks sharding the policy
    over gloo, 2 rollout agents each fed from rank 0 over its own group; 4 processes."""
    spec = make_spec([AgentSpec(), AgentSpec()], total_versions=8, lr=6e-3)
    spec.trainer_devices = ["cpu", "cpu"]
    summary = launch(spec)
    assert summary.versions == 8 and summary.dead_agents == []
    assert_books_balance(summary, spec)
    assert_reward_rose(summary)
    assert all(m["fully_async/sync_failures"] == 0 for m in summary.history)


def test_four_trainer_ranks_publish_to_two_agents():
    """A 4-rank FSDP2 trainer group (gloo) feeding 2 rollout agents, 6 processes: rank 0 gathers the sharded
    weights and every publication reaches both agents (no failed or late sync, the full weights' bytes each
    time), and the books balance."""
    spec = make_spec([AgentSpec(), AgentSpec()], total_versions=3, lr=6e-3)
    spec.trainer_devices = ["cpu"] * 4
    summary = launch(spec)
    assert summary.versions == 3 and summary.dead_agents == []
    assert_books_balance(summary, spec)
    weight_bytes = _published_bytes()
    for m in summary.history:
        assert m["fully_async/agents/live"] == 2 and m["fully_async/sync_failures"] == 0, m
        assert m["fully_async/sync_late"] == 0 and m["param_sync/bytes"] == weight_bytes, m


def _published_bytes() -> int:
    """What one publication of the test model's full fp32 weights sends."""
    model = random_model(MODEL_CONFIG, seed=MODEL_SEED)
    return sum(t.numel() * t.element_size() for _, t in published_weights(model))


def test_colocated_sync_run_hosts_an_engine_in_each_trainer_rank_and_stays_on_policy():
    """verl's colocated baseline: 2 processes, each a trainer rank (FSDP2) hosting its own engine; staleness 0,
    trigger 1, no partial rollout: every trained token was sampled by the weights being trained."""
    spec = make_spec([AgentSpec(), AgentSpec()], total_versions=8, lr=6e-3, staleness_threshold=0.0,
                     trigger_parameter_sync_step=1, partial_rollout=False, colocated=True, concurrent_prompts=MINI // 2)
    spec.trainer_devices, spec.colocate = ["cpu", "cpu"], True
    assert spec.num_agent_processes == 0  # the engines live in the trainer processes
    summary = launch(spec)
    assert summary.versions == 8 and summary.dead_agents == []
    assert_books_balance(summary, spec)
    assert all(m["training/version_lag/max"] == 0 for m in summary.history), \
        [m["training/version_lag/max"] for m in summary.history]
    assert all(m["fully_async/partial/partial_ratio"] == 0 for m in summary.history)
    assert_reward_rose(summary)


def test_colocate_needs_one_agent_per_trainer_rank():
    with pytest.raises(ValueError, match="one agent per trainer rank"):
        RunSpec(model=ModelSpec(config=MODEL_CONFIG), algorithm=GRPO(), trainer=TrainerConfig(),
                rollout=RolloutConfig(), async_=AsyncConfig(), source_factory=source, scorer_factory=scorer,
                agents=[AgentSpec()], trainer_devices=["cpu", "cpu"], colocate=True)
