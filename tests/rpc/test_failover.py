"""Failover's pieces in one process: when a fault is recovered from (`refusal`), a rank's restore points written
after a step and restored into a freshly built learner (bitwise: the next step equals the uninterrupted one's), and
what a missing restore point says. Launched runs that recover are in tests/rpc/test_trainer_failover.py."""

from __future__ import annotations

import datetime
import time
import types

import pytest
import torch.distributed as dist

from asyncrl.learner import train_step
from asyncrl.rpc.failover import Failover, Heartbeat, RestorePoints, Silence, refusal
from asyncrl.rpc.reform import Abandoned, join_trainer_group
from asyncrl.rpc.store import RunStore
from asyncrl.runtime.kill_points import GENERATION_ENV
from asyncrl.runtime.lifecycle import RunFailed
from tests.run_helpers import free_ports
from tests.timing import limit
from tests.dist_helpers import build, max_diff, sample_groups, weights


def test_a_fault_is_recovered_from_with_a_committed_step_a_recovery_left_and_a_step_trained_since_the_last():
    assert refusal(recoveries=0, max_recoveries=1, committed=4, at_step=5, last_fault_at=None) is None
    assert refusal(recoveries=1, max_recoveries=3, committed=4, at_step=6, last_fault_at=5) is None
    assert refusal(recoveries=1, max_recoveries=1, committed=5, at_step=6, last_fault_at=4) == \
        "--trainer.max-recoveries 1 spent"
    assert refusal(recoveries=0, max_recoveries=2, committed=-1, at_step=0, last_fault_at=None) == \
        "no restore point was committed yet"
    assert refusal(recoveries=1, max_recoveries=2, committed=3, at_step=4, last_fault_at=4) == \
        "a second fault before another step was trained (both at step 4)"


def test_restore_points_put_a_fresh_learner_back_to_the_committed_step_bitwise(tmp_path):
    first, second, third = (sample_groups(4, seed=0, n=3, first_id=i) for i in (0, 100, 200))
    state, _ = train_step(build("ppo"), first)
    points = RestorePoints(tmp_path, rank=1, world=2)
    points.start(state)  # step 1's restore point, written on a thread of its own
    points.wait()
    state, _ = train_step(state, second)
    assert points.after_step(state, None) == 1  # one rank: step 1 is committed, and every rank is idle: a new one
    points.wait()  # step 2's file; step 1's kept too
    state, _ = train_step(state, third)
    expected_policy, expected_critic, expected_step = weights(state.policy), weights(state.critic), state.step
    assert sorted(p.name for p in (tmp_path / "world2").iterdir()) == ["rank1-s1.snap", "rank1-s2.snap"]

    fresh = build("ppo", seed=5)  # a replacement: other initial weights, no optimizer state yet
    replacement = RestorePoints(tmp_path, rank=1, world=2)
    replacement.restore(fresh, step=2)
    assert fresh.step == 2
    fresh, _ = train_step(fresh, third)
    assert fresh.step == expected_step
    assert max_diff(weights(fresh.policy), expected_policy) == 0 and max_diff(weights(fresh.critic), expected_critic) == 0
    with pytest.raises(RunFailed, match=r"trainer rank 1: no restore point of step 7 in .*world2 \(rank1-s7.snap\)"):
        replacement.restore(fresh, step=7)


def test_a_fault_while_the_group_re_forms_restarts_the_recovery_and_counts_against_the_limit(monkeypatch):
    """A follower started again that dies before the group is ready: its fault is taken on without the same-step rule
    (no step was trained in between), counts as one of --trainer.max-recoveries, and the recovery names both."""
    monkeypatch.setenv(GENERATION_ENV, "0")
    spec = types.SimpleNamespace(trainer=types.SimpleNamespace(max_recoveries=2),
                                 async_=types.SimpleNamespace(agent_timeout_s=1.0), num_trainers=3,
                                 trainer_devices=["cpu"] * 3)
    failover = Failover(spec, store=None, points=None, device="cpu", build=None)
    failover.committed = 3
    state = types.SimpleNamespace(step=4, version=6)
    failover.take_on(state, {"generation": 1, "why": "trainer rank 2 exited with code 9"})
    state.step = 0  # rebuilt, not restored yet
    failover.take_on(state, {"generation": 2, "why": "trainer rank 1 exited with code 9"})
    assert (failover.faults, failover.generation) == (2, 2)
    done = failover.recovered(types.SimpleNamespace(step=4, version=6))
    assert done.why == "trainer rank 2 exited with code 9; then trainer rank 1 exited with code 9"
    assert done.generation == 2
    with pytest.raises(RunFailed, match=r"trainer rank 2 exited with code 9; not recovered: "
                                        r"--trainer.max-recoveries 2 spent"):
        failover.take_on(state, {"generation": 3, "why": "trainer rank 2 exited with code 9"})


def test_a_re_formed_group_waits_for_its_members_only_while_no_newer_generation_is_called():
    """Before the backend's rendezvous (which nothing interrupts), a re-formed generation's members assemble: a
    newer generation called meanwhile ends the wait at once, and a member that never comes is named."""
    store = dist.HashStore()
    calls = []
    with pytest.raises(Abandoned, match="generation 1: a newer generation was called"):
        join_trainer_group(store, generation=1, rank=0, world_size=3, backend="gloo",
                           timeout=datetime.timedelta(seconds=5), startup_timeout_s=limit(60),
                           abandoned=lambda: calls.append(1) or len(calls) > 3)
    assert not dist.is_initialized()
    dist.PrefixStore("asyncrl/trainers/gen2/here", store).set("1", "1")
    with pytest.raises(TimeoutError, match=r"generation 2: rank\(s\) 2 did not come within 0.3 s \(--startup-timeout-s\)"):
        join_trainer_group(store, generation=2, rank=0, world_size=3, backend="gloo",
                           timeout=datetime.timedelta(seconds=5), startup_timeout_s=0.3)
    assert not dist.is_initialized()


def test_a_followers_heartbeat_counts_from_its_start_on_its_own_thread_until_stopped_or_the_run_ends():
    """The first beat is in before the constructor returns (a process stopped right after it is still judged by
    its watcher: a count of 0 never is); the rest come from a thread; `stop()` ends them, as does the run's end."""
    port = free_ports()
    store = RunStore("127.0.0.1", port, serve=True, timeout_s=limit(30))
    beat = Heartbeat("127.0.0.1", port, rank=2, generation=3, timeout_s=limit(30), period_s=0.01)
    first = store.trainer_beats(2, 3)
    assert first >= 1 and store.trainer_beats(2, 0) == 0  # its generation's count only
    _until(lambda: store.trainer_beats(2, 3) >= first + 3)  # the thread beats on
    beat.stop()
    _stands_still(store, rank=2, generation=3)
    Heartbeat("127.0.0.1", port, rank=1, generation=0, timeout_s=limit(30), period_s=0.01)
    store.shut_down()  # the run's end: its thread sees it and stops
    _stands_still(store, rank=1, generation=0)


def _stands_still(store: RunStore, rank: int, generation: int) -> None:
    """The count stops moving (`Silence` finds it unmoved for a tenth of a second)."""
    watch = Silence(timeout_s=0.1)
    _until(lambda: watch.past_timeout(store.trainer_beats(rank, generation)) is not None)


def _until(predicate, timeout_s: float = limit(10)) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
