"""Failover's pieces in one process: when a fault is recovered from (`refusal`), a rank's restore points written
after a step and restored into a freshly built learner (bitwise: the next step equals the uninterrupted one's), and
what a missing restore point says. Launched runs that recover are in tests/rpc/test_trainer_failover.py."""

from __future__ import annotations

import pytest

from asyncrl.learner import train_step
from asyncrl.rpc.failover import RestorePoints, refusal
from asyncrl.runtime.lifecycle import RunFailed
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
    points = RestorePoints(tmp_path, rank=1)
    points.start(state)  # step 1's restore point, written on a thread of its own
    points.wait()
    state, _ = train_step(state, second)
    assert points.after_step(state, None) == 1  # one rank: step 1 is committed, and every rank is idle: a new one
    points.wait()  # step 2's file; step 1's kept too
    state, _ = train_step(state, third)
    expected_policy, expected_critic, expected_step = weights(state.policy), weights(state.critic), state.step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1-s1.snap", "rank1-s2.snap"]

    fresh = build("ppo", seed=5)  # a replacement: other initial weights, no optimizer state yet
    replacement = RestorePoints(tmp_path, rank=1)
    replacement.restore(fresh, step=2)
    assert fresh.step == 2
    fresh, _ = train_step(fresh, third)
    assert fresh.step == expected_step
    assert max_diff(weights(fresh.policy), expected_policy) == 0 and max_diff(weights(fresh.critic), expected_critic) == 0
    with pytest.raises(RunFailed, match=r"trainer rank 1: no restore point of step 7 in "):
        replacement.restore(fresh, step=7)
