"""The in-process launcher (asyncrl.rpc.local.LocalRun: trainer in this thread, agents in threads) on the toy
task: version-lag bounds, verl's admission budget and the ledger over many seeded random configurations; the
modes as knob combinations; with partial rollout, behaviour log-probs that match the weights of each token's
version; lag policy "wait"; and agents that hang or fail their weight sync."""

from __future__ import annotations

import random
import time

import pytest
import torch

from asyncrl.algos.staleness import verl_max_required_samples
from asyncrl.config import AsyncConfig
from asyncrl.policies import random_model
from asyncrl.runtime.controller import LAG_BY_LENGTH
from asyncrl.runtime.roster import Fenced
from tests.rpc.helpers import (
    MODEL_CONFIG, TrainRecorder, allowed_lag, check_books, full_forward_logprobs, local_run,
)
from tests.timing import agent_timeout, detection_margin, limit

MINI = 2


def run_and_check(config: AsyncConfig, **kw):
    """Run, then check what every run must satisfy; returns (run, summary, recorder)."""
    run = local_run(config, mini_batch_size=MINI, **kw)
    rec = TrainRecorder(run)
    summary = run.run()
    errors = [(a.name, a.error) for a in run.agents if a.error is not None]
    assert not errors, errors
    batch = config.require_batches * MINI
    # the run did what it was asked
    assert summary.versions == run.state.version == config.total_versions
    assert summary.steps == len(rec.steps) >= config.total_versions * config.trigger_parameter_sync_step
    if config.max_version_lag is None or config.lag_policy == "drop":  # only "wait" adds held-back steps
        assert summary.steps == config.total_versions * config.trigger_parameter_sync_step
    assert all(len(groups) == batch for _, groups in rec.steps)
    # version lag of every trained group, at train time
    lags = rec.lags
    assert min(lags) >= 0
    bound = allowed_lag(config)
    if bound is not None:
        assert max(lags) <= bound, (config, lags)
    # verl's admission budget
    max_required = verl_max_required_samples(MINI, config.require_batches, config.staleness_threshold,
                                             config.trigger_parameter_sync_step)
    assert run.queue.budget.max_required_samples == max_required
    assert 0 < run.queue.peak_staleness_samples <= max_required
    assert all(0 <= m["fully_async/count/staleness_samples"] <= max_required for m in summary.history)
    # every admitted prompt trained or dropped, once
    check_books(run.queue.ledger, summary.ledger, rec.trained_ids,
                stale_drops_allowed=config.max_version_lag is not None and config.lag_policy == "drop")
    assert summary.ledger["trained"] == len(rec.trained_ids) == summary.steps * batch
    # each agent saw every publication, in order
    for agent in run.agents:
        seen = agent.versions_seen
        assert seen == sorted(seen) and len(set(seen)) == len(seen), (agent.name, seen)
        assert seen[0] == 0 and seen[-1] == config.total_versions
    assert len(summary.history) == config.total_versions
    # every trained sample counted once in the lag-by-length view, at the lag it was trained at
    by_length = {k: sum(m.get(k, 0) for m in summary.history) for m in summary.history for k in m
                 if k.startswith(LAG_BY_LENGTH)}
    samples = [(len(c.token_ids), max(len(s.token_ids) for s in g.completions), version - c.min_version)
               for version, groups in rec.steps for g in groups for c in g.completions if c.versions]
    totals = {field: sum(v for k, v in by_length.items() if k.rsplit("/", 1)[1] == field)
              for field in ("count", "lag_sum", "length_sum", "group_length_sum")}
    assert totals == {"count": len(samples), "lag_sum": sum(s[2] for s in samples),
                      "length_sum": sum(s[0] for s in samples), "group_length_sum": sum(s[1] for s in samples)}
    return run, summary, rec


def random_config(seed: int) -> tuple[AsyncConfig, dict]:
    rng = random.Random(seed)
    cap = rng.choice([None, None, 0, 1, 2])
    config = AsyncConfig(
        staleness_threshold=rng.choice([0.0, 0.25, 0.5, 1.0]), trigger_parameter_sync_step=rng.choice([1, 2, 3]),
        require_batches=rng.choice([1, 2]), partial_rollout=rng.random() < 0.5, max_version_lag=cap,
        lag_policy="wait" if cap and rng.random() < 0.4 else "drop",  # (a cap of 0 with "wait": see below)
        total_versions=3, take_timeout_s=limit(60), sync_timeout_s=limit(60))
    engines = rng.choice([1, 2, 3])
    kw = dict(engines=engines, step_delays=[rng.choice([0.0, 0.0, 0.005, 0.02]) for _ in range(engines)],
              concurrent_prompts=rng.choice([1, 2, None]), max_new_tokens=rng.choice([4, 8]), seed=seed)
    return config, kw


@pytest.mark.parametrize("seed", range(12))
def test_random_configs_keep_lag_budget_and_ledger(seed):
    config, kw = random_config(seed)
    run_and_check(config, **kw)


def test_random_configs_cover_the_knobs():
    configs = [random_config(seed)[0] for seed in range(12)]
    assert {c.staleness_threshold for c in configs} == {0.0, 0.25, 0.5, 1.0}
    assert {c.trigger_parameter_sync_step for c in configs} == {1, 2, 3}
    assert {c.require_batches for c in configs} == {1, 2}
    assert {c.partial_rollout for c in configs} == {True, False}
    assert {c.max_version_lag for c in configs} == {None, 0, 1, 2}
    assert {c.lag_policy for c in configs} == {"drop", "wait"}
    assert {len(random_config(seed)[1]["step_delays"]) for seed in range(12)} == {1, 2, 3}


# ------------------------------------------------------------------------------------- lag policy "wait"
def test_wait_policy_holds_publication_back_until_old_work_is_trained():
    # a slow agent's prompts span several versions; "wait" must hold publications back (the trainer keeps
    # training on other groups meanwhile) so that none is trained more than one version old, and drop none
    config = AsyncConfig(staleness_threshold=1.0, trigger_parameter_sync_step=1, partial_rollout=True,
                         max_version_lag=1, lag_policy="wait", total_versions=4, take_timeout_s=limit(60))
    run, summary, rec = run_and_check(config, engines=2, step_delays=[0.0, 0.1], concurrent_prompts=2)
    assert max(rec.lags) <= 1
    assert summary.steps > config.total_versions  # held back at least once: extra steps at the same version
    assert "stale" not in run.queue.ledger.dropped.values()


def test_wait_policy_with_cap_zero_needs_staleness_zero():
    # staleness > 0 admits work ahead of training, which is always a version old when the next publication is
    # due: with a cap of 0 the publication could never happen (the trainer would train at version 0 forever)
    with pytest.raises(ValueError, match="--async-training.lag-policy wait is invalid: 'wait' with --async-training.max-version-lag 0"):
        local_run(AsyncConfig(staleness_threshold=0.5, max_version_lag=0, lag_policy="wait"))
    # with staleness 0 it is a synchronous run, and it runs
    config = AsyncConfig(staleness_threshold=0.0, trigger_parameter_sync_step=2, partial_rollout=True,
                         max_version_lag=0, lag_policy="wait", total_versions=3, take_timeout_s=limit(60))
    run, summary, rec = run_and_check(config, engines=2, step_delays=[0.0, 0.01])
    assert max(rec.lags) == 0 and summary.steps == 6


class DriftingRecorder(TrainRecorder):
    """Reports a drift of `per_version` nats a token for each version of the step's mean lag (the learner's real
    drift on the toy task is noise around 0): the drift budget's input, made exact."""

    def __init__(self, run, per_version: float):
        super().__init__(run)
        self.per_version = per_version

    def step(self, state, groups):
        state, metrics = super().step(state, groups)
        return state, {**metrics, "actor/behaviour_kl": self.per_version * metrics["training/version_lag/mean"]}


def drifting_run(budget: float | None, per_version: float = 0.05):
    config = AsyncConfig(staleness_threshold=3.0, trigger_parameter_sync_step=1, partial_rollout=False,
                         drift_budget=budget, total_versions=8, take_timeout_s=limit(60), sync_timeout_s=limit(60))
    run = local_run(config, mini_batch_size=MINI, engines=2, step_delays=[0.0, 0.01], concurrent_prompts=2)
    rec = DriftingRecorder(run, per_version=per_version)
    summary = run.run()
    assert not [(a.name, a.error) for a in run.agents if a.error is not None]
    assert summary.versions == config.total_versions
    check_books(run.queue.ledger, summary.ledger, rec.trained_ids, stale_drops_allowed=False)
    assert "stale" not in run.queue.ledger.dropped.values()
    return summary, rec


def test_a_drift_budget_holds_publication_to_the_lag_it_affords():
    # staleness 3 lets the rollout run versions ahead (the same run without a budget trains groups 2+ versions old);
    # at 0.05 nats a version a budget of 0.05 affords a lag of 1: once a lagged step has taught the controller the
    # rate, every publication is held until no queued or in-flight work would be older than that
    _, free = drifting_run(None)
    assert max(free.lags) >= 2, free.lags
    summary, rec = drifting_run(0.05)
    capped = [m for m in summary.history if "fully_async/drift/lag_cap" in m]
    assert capped and all(m["fully_async/drift/lag_cap"] == 1 for m in capped)
    assert all(abs(m["fully_async/drift/kl_per_version"] - 0.05) < 1e-9 for m in capped)
    first = capped[0]["version"]  # the version published once the cap was known
    late = [version - g.min_version for version, groups in rec.steps if version >= first for g in groups]
    assert late and max(late) <= 1, rec.lags
    assert summary.steps > summary.versions  # held back: extra steps at the same version


# ----------------------------------------------------------------------------------------------- modes
def test_colocated_sync_mode_sleeps_the_engine_between_windows():
    config = AsyncConfig(colocated=True, staleness_threshold=0.0, trigger_parameter_sync_step=1,
                         partial_rollout=False, total_versions=4, take_timeout_s=limit(60))
    run = local_run(config, mini_batch_size=MINI, engines=1)
    engine = run.engines[0]
    events, asleep_while_training = [], []
    for name in ("sleep", "wake_up"):
        inner = getattr(engine, name)

        def wrapped(inner=inner, name=name):
            events.append(name)
            return inner()

        setattr(engine, name, wrapped)
    rec = TrainRecorder(run)
    inner_step = rec.step

    def step(state, groups):
        out = inner_step(state, groups)
        asleep_while_training.append(engine.is_sleeping)
        return out

    rec.step = step
    summary = run.run()
    assert summary.versions == 4
    # the engine freed its KV cache while the learner trained, and woke up for the next window's prompts
    assert events.count("sleep") >= 3 and events.count("wake_up") >= 3, events
    assert any(asleep_while_training), asleep_while_training
    assert rec.lags and max(rec.lags) == 0  # synchronous: every group trained at the version it was made
    check_books(run.queue.ledger, summary.ledger, rec.trained_ids, stale_drops_allowed=False)
    assert run.queue.peak_staleness_samples == MINI  # the window is exactly one step's prompts


@pytest.mark.parametrize("mode, knobs", [
    ("one-step-off", dict(staleness_threshold=1.0, trigger_parameter_sync_step=1, partial_rollout=False,
                          max_version_lag=1, lag_policy="wait")),
    ("stream", dict(staleness_threshold=0.0, trigger_parameter_sync_step=2, partial_rollout=False)),
    ("stale", dict(staleness_threshold=0.5, trigger_parameter_sync_step=2, partial_rollout=False)),
    ("stale+partial", dict(staleness_threshold=0.5, trigger_parameter_sync_step=2, partial_rollout=True)),
])
def test_modes_as_knob_combinations(mode, knobs):
    config = AsyncConfig(total_versions=4, take_timeout_s=limit(60), **knobs)
    run, summary, rec = run_and_check(config, engines=2, step_delays=[0.0, 0.01])
    batch = MINI * config.trigger_parameter_sync_step
    if config.staleness_threshold == 0:
        assert max(rec.lags) == 0
        assert run.queue.peak_staleness_samples == batch
    else:
        # generation ran ahead of training: more than one window's consumption was admitted at some point
        assert run.queue.peak_staleness_samples > batch
    # one-step-off's cap (wait) held every trained group within one version; run_and_check asserted the
    # bound, here the mode's promise is spelled out
    if mode == "one-step-off":
        assert max(rec.lags) <= 1 and "stale" not in run.queue.ledger.dropped.values()


# ------------------------------------------------------------------------------------- partial rollout
def test_partial_rollout_logprobs_match_the_weights_of_each_tokens_version():
    config = AsyncConfig(staleness_threshold=1.0, trigger_parameter_sync_step=1, partial_rollout=True,
                         total_versions=4, take_timeout_s=limit(60))
    # one prompt at a time, one group per learner step: prompt k+1 is being generated while the learner
    # trains on prompt k and publishes, so generations span weight updates whatever the machine's speed
    run = local_run(config, mini_batch_size=1, engines=1, step_delays=[0.02], max_new_tokens=24,
                    kv_on_update="recompute", concurrent_prompts=1, lr=1e-2)
    engine = run.engines[0]
    snapshots = {0: {k: v.detach().clone() for k, v in engine.model.state_dict().items()}}
    inner_publish = run.publisher.publish

    def publish(state, version):  # the engines' weights right after each publication
        out = inner_publish(state, version)
        snapshots[version] = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        return out

    run.publisher.publish = publish
    rec = TrainRecorder(run)
    summary = run.run()
    check_books(run.queue.ledger, summary.ledger, rec.trained_ids, stale_drops_allowed=False)
    spanning = [g for g in rec.groups if g.min_version != g.max_version]
    assert spanning, "no trained group was generated across a weight update"
    models = {}
    for version, weights in snapshots.items():
        models[version] = random_model(MODEL_CONFIG)
        models[version].load_state_dict(weights)
    # the snapshots differ (otherwise the check below could not tell versions apart)
    assert not torch.equal(snapshots[0]["model.embed_tokens.weight"], snapshots[1]["model.embed_tokens.weight"])

    checked = mismatched_if_wrong = 0
    for g in spanning:
        for c in g.completions:
            versions = torch.tensor(c.versions)
            behaviour = torch.tensor(c.logprobs)
            if len(set(c.versions)) < 2:
                continue
            expected = torch.empty_like(behaviour)
            for v in set(c.versions):
                at_v = versions == v
                expected[at_v] = full_forward_logprobs(models[v], g.prompt_ids, c.token_ids)[at_v]
            torch.testing.assert_close(behaviour, expected, atol=1e-4, rtol=0)
            checked += int((versions != versions[0]).sum())
            # the test can tell: the first version's weights do not explain the later tokens
            wrong = full_forward_logprobs(models[c.versions[0]], g.prompt_ids, c.token_ids)
            later = versions != versions[0]
            mismatched_if_wrong += int(((wrong - behaviour).abs()[later] > 1e-3).sum())
    assert checked > 0 and mismatched_if_wrong > 0


# -------------------------------------------------------------------------------------- agent failures
class _HangingHandle:
    """The roster as one agent sees it, except that the `after`-th submission hangs (no heartbeats either:
    the generation loop is stuck in it) until the run stops the agent; the group is then delivered late."""

    def __init__(self, roster, agent, after: int):
        self.roster, self.agent, self.after = roster, agent, after
        self.submitted, self.hung_at = 0, None
        self.late_refused = None
        self.last_call = time.monotonic()  # taken before each call reaches the roster: ≤ the roster's own stamp

    def request(self, agent, n):
        self.last_call = time.monotonic()
        return self.roster.request(agent, n)

    def heartbeat(self, agent):
        self.last_call = time.monotonic()
        self.roster.heartbeat(agent)

    def agent_failed(self, agent, why):
        self.roster.agent_failed(agent, why)

    def evaluating(self, agent):
        return self.roster.evaluating(agent)

    def submit_eval(self, agent, task, completions, rewards):
        self.roster.submit_eval(agent, task, completions, rewards)

    def submit(self, agent, group):
        self.submitted += 1
        if self.submitted == self.after:
            self.hung_at = self.last_call  # the agent's last sign of life: silence is counted from there
            self.agent._stop.wait()  # released when LocalRun stops its agents at the end
            try:
                self.roster.submit(agent, group)
            except Fenced:
                self.late_refused = group.prompt_id
                raise
            return
        self.last_call = time.monotonic()
        self.roster.submit(agent, group)


def _record_deaths(run):
    deaths = []
    inner = run.roster.declare_dead

    def declare_dead(agent, why):
        ledger = run.queue.ledger
        holding = [pid for pid in ledger.ids("in_flight") if ledger.agent[pid] == agent]
        deaths.append((agent, why, time.monotonic(), holding, run.controller.state.version))
        return inner(agent, why)

    run.roster.declare_dead = declare_dead
    return deaths


def test_dynamic_sampling_that_finds_no_signal_fails_the_run_instead_of_spinning():
    """DAPO's dynamic sampling with every sample scoring alike (a broken reward, or data far too hard) would drop
    every group forever; after --algorithm.max-num-gen-batches batches' worth the run fails and says why."""
    from asyncrl.config.algorithm import DAPO
    from asyncrl.config import OptimConfig, TrainerConfig
    from asyncrl.learner import build_learner
    from tests.rpc.helpers import tiny_model
    state = build_learner(tiny_model(), TrainerConfig(mini_batch_size=MINI, optim=OptimConfig(lr=1e-3)),
                          DAPO(max_num_gen_batches=3))
    run = local_run(AsyncConfig(total_versions=2, take_timeout_s=limit(60), sync_timeout_s=limit(60)), state=state,
                    reward=lambda text, ground_truth: 0.0)
    with pytest.raises(RuntimeError, match=r"dynamic sampling \(--algorithm.filter-groups\) dropped 6 groups .*"
                                           r"--algorithm.max-num-gen-batches 3"):
        run.run()
    assert run.state.version == 0 and run.queue.ledger.counts["dropped/filtered"] >= 6


def test_hung_agent_is_declared_dead_while_the_others_keep_the_trainer_fed():
    timeout = agent_timeout()  # agents heartbeat every second: well above that, so a busy machine gives no false alarm
    # agent0 alone keeps the trainer fed, slowly enough for the run to outlast the timeout
    config = AsyncConfig(staleness_threshold=1.0, trigger_parameter_sync_step=1, partial_rollout=True,
                         total_versions=400, agent_timeout_s=timeout, take_timeout_s=limit(60))
    run = local_run(config, mini_batch_size=MINI, engines=2, step_delays=[0.03, 0.0], concurrent_prompts=2)
    hung = _HangingHandle(run.roster, run.agents[1], after=2)
    run.agents[1].roster = hung
    deaths = _record_deaths(run)
    rec = TrainRecorder(run)
    inner_step = rec.step

    def step(state, groups):  # stop the run three versions after the death was declared
        if deaths and state.version >= deaths[0][4] + 3:
            run.controller.request_stop("enough")
        return inner_step(state, groups)

    rec.step = step
    summary = run.run()
    assert summary.interrupted == "enough" and summary.dead_agents == ["agent1"]
    assert len(deaths) == 1 and deaths[0][0] == "agent1" and "silent" in deaths[0][1]
    latency = deaths[0][2] - hung.hung_at
    assert timeout <= latency <= timeout + detection_margin(), latency  # the roster's own thread
    # the trainer kept stepping after the death (on agent0's groups)
    assert summary.versions >= deaths[0][4] + 3
    ledger = run.queue.ledger
    assert deaths[0][3] and ledger.counts["readmitted"] == len(deaths[0][3])  # its prompts went to agent0 ...
    # ... and the stuck agent's late delivery was refused (fenced), never queued
    assert hung.late_refused is not None and run.roster.counts["fenced_submissions"] == 1
    assert ledger.agent[hung.late_refused] != "agent1" or ledger.state[hung.late_refused] == "dropped"
    check_books(ledger, summary.ledger, rec.trained_ids, stale_drops_allowed=False)


def test_agent_whose_weight_sync_fails_is_declared_dead_and_its_prompts_readmitted():
    config = AsyncConfig(staleness_threshold=1.0, trigger_parameter_sync_step=1, partial_rollout=True,
                         total_versions=5, take_timeout_s=limit(60))
    run = local_run(config, mini_batch_size=MINI, engines=2, step_delays=[0.0, 0.02], concurrent_prompts=2)
    broken = run.agents[1]
    inner_load = broken.load_weights

    def load_weights(named_tensors, version):
        if version is not None and version >= 2:
            raise RuntimeError("injected: weight transfer failed")
        return inner_load(named_tensors, version)

    broken.load_weights = load_weights
    deaths = _record_deaths(run)
    rec = TrainRecorder(run)
    summary = run.run()
    assert summary.versions == 5 and summary.dead_agents == ["agent1"]
    assert [d[0] for d in deaths] == ["agent1"] and deaths[0][1].startswith("its weight sync failed")
    assert "injected: weight transfer failed" in deaths[0][1]
    assert summary.history[1]["fully_async/sync_failures"] == 1
    assert broken.versions_seen == [0, 1] and run.agents[0].versions_seen == [0, 1, 2, 3, 4, 5]
    # nothing it held was lost: what was in flight on it went to agent0 (same ids), and was trained or dropped
    ledger = run.queue.ledger
    holding = deaths[0][3]
    assert holding, "agent1 held no prompt when its sync failed (partial rollout: it should have)"
    assert ledger.counts["readmitted"] == len(holding)
    for pid in holding:
        assert ledger.agent[pid] == "agent0" or ledger.dropped.get(pid) == "run_end", pid
    check_books(ledger, summary.ledger, rec.trained_ids, stale_drops_allowed=False)


def test_agent_whose_loop_raises_is_declared_dead_at_once_and_the_last_one_stops_the_run():
    config = AsyncConfig(staleness_threshold=1.0, trigger_parameter_sync_step=1, partial_rollout=True,
                         total_versions=4, take_timeout_s=limit(60), agent_timeout_s=agent_timeout(60))
    run = local_run(config, mini_batch_size=MINI, engines=2, concurrent_prompts=2)
    deaths = _record_deaths(run)
    broken = run.agents[1]

    def fail():
        raise RuntimeError("injected: engine crashed")

    broken.engine.step = fail
    start = time.monotonic()
    summary = run.run()
    assert summary.versions == 4 and summary.dead_agents == ["agent1"]
    assert deaths[0][0] == "agent1" and "injected: engine crashed" in deaths[0][1]
    assert deaths[0][2] - start < limit(10), "declared dead only after agent_timeout_s of silence"
    # the last agent failing ends the run with its reason instead of waiting out take_timeout_s
    run = local_run(config, mini_batch_size=MINI, engines=1, concurrent_prompts=2)
    run.agents[0].engine.step = fail
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="every rollout agent is dead.*injected: engine crashed"):
        run.run()
    assert time.monotonic() - start < limit(10)


def test_agents_get_a_fair_share_of_a_versions_admissions():
    """First come, first served let one agent take a whole version's budget while others idled (seen with
    1 trainer + 3 rollout GPUs): each live agent may hold at most ceil(budget / live agents) prompts."""
    config = AsyncConfig(staleness_threshold=0.5, trigger_parameter_sync_step=2, total_versions=1)
    run = local_run(config, mini_batch_size=MINI, engines=3, concurrent_prompts=8)
    budget = run.queue.budget.max_required_samples  # int(2 × 1.5 × 2) = 6
    assert budget == 6
    roster = run.roster
    assert len(roster.request("agent0", 8)) == 2  # ceil(6 / 3)
    assert roster.request("agent0", 8) == []  # holds its share already
    assert len(roster.request("agent1", 8)) == 2 and len(roster.request("agent2", 8)) == 2
    roster.declare_dead("agent2", "test")  # its 2 prompts go back; the share grows to ceil(6 / 2) = 3
    got = roster.request("agent0", 8)
    assert len(got) == 1 and got[0].prompt_id in (4, 5)  # re-admitted first
    assert run.queue.ledger.in_flight == {"agent0": 3, "agent1": 2, "agent2": 0}
