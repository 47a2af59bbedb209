"""`ShardSnapshot`, a trainer rank's restore point in host memory: restored after more training, the learner is
back at the boundary and takes the same steps again bitwise (GRPO with a KL loss; PPO with its critic), also from a
boundary before the first optimizer step; it holds 12 bytes a trained parameter plus the optimizer's step scalars;
it refuses another learner. The FSDP2 case (each rank's own shards, over gloo) is in tests/learner/test_fsdp.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncrl.checkpoint.snapshot import COUNTERS, ShardSnapshot
from asyncrl.learner import train_step
from tests.dist_helpers import build, max_diff, sample_groups, weights


@pytest.fixture(scope="module")
def batches():
    return [sample_groups(3, seed=s, n=3, first_id=100 * s) for s in range(3)]


def _state_of(state) -> dict:
    out = {"policy": weights(state.policy), **{k: getattr(state, k) for k in COUNTERS},
           "lr": state.scheduler.get_last_lr()}
    if state.critic is not None:
        out["critic"] = weights(state.critic)
    return out


def _same(a: dict, b: dict) -> None:
    for key in a:
        if key in ("policy", "critic"):
            assert max_diff(a[key], b[key]) == 0, key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_restored_snapshot_takes_the_same_steps_again(batches, algorithm):
    state = build(algorithm, algo_kwargs=dict(kl_loss_coef=0.05) if algorithm == "grpo" else None)
    state, _ = train_step(state, batches[0])
    snapshot = ShardSnapshot(state)
    state.version = 1  # published after the step
    snapshot.take(state)
    boundary = _state_of(state)
    draws = (torch.rand(3), random.random(), np.random.rand())  # each run begins with these draws
    runs = []
    for _ in range(2):
        state, first = train_step(state, batches[1])
        state.version += 1
        state, second = train_step(state, batches[2])
        state.version += 1
        runs.append((_state_of(state), first, second, (torch.rand(3), random.random(), np.random.rand())))
        snapshot.restore(state)
        _same(_state_of(state), boundary)
        again = (torch.rand(3), random.random(), np.random.rand())
        assert torch.equal(again[0], draws[0]) and again[1:] == draws[1:]  # the RNG states came back too
    (a, a1, a2, a_draws), (b, b1, b2, b_draws) = runs
    assert max_diff(a["policy"], boundary["policy"]) > 1e-4  # the steps moved the weights
    _same(a, b)
    untimed = lambda m: {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}  # noqa: E731
    assert untimed(a1) == untimed(b1) and untimed(a2) == untimed(b2)  # every other metric of both steps
    assert torch.equal(a_draws[0], b_draws[0]) and a_draws[1:] == b_draws[1:]


def test_a_snapshot_before_the_first_optimizer_step_empties_the_optimizer_again(batches):
    state = build("grpo")
    snapshot = ShardSnapshot(state)
    snapshot.take(state)
    initial = _state_of(state)
    state, _ = train_step(state, batches[0])
    once = _state_of(state)
    assert state.optimizer.state  # AdamW's moments exist now
    snapshot.restore(state)
    assert not state.optimizer.state
    _same(_state_of(state), initial)
    state, _ = train_step(state, batches[0])
    _same(_state_of(state), once)


def test_a_snapshot_holds_the_trained_tensors_and_their_moments(batches):
    state = build("ppo")
    snapshot = ShardSnapshot(state)
    trained = [p for m in (state.policy, state.critic) for p in m.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trained)
    assert snapshot.nbytes == 4 * numel  # fp32 weights; no moments before the first optimizer step
    state, _ = train_step(state, batches[0])
    snapshot.take(state)
    assert snapshot.nbytes == 12 * numel + 4 * len(trained)  # + AdamW's two moments and its step scalar
    assert (snapshot.version, snapshot.step) == (state.version, state.step) == (0, 1)


def test_a_snapshot_refuses_another_learner_and_a_restore_before_any_take(batches):
    state, other = build("grpo"), build("grpo")
    snapshot = ShardSnapshot(state)
    with pytest.raises(RuntimeError, match="no snapshot was taken"):
        snapshot.restore(state)
    with pytest.raises(ValueError, match="not the one the snapshot was built for"):
        snapshot.take(other)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_packed_snapshot_restores_a_fresh_learner_that_continues_alike(batches, algorithm):
    """The replacement's path: a snapshot packed (JSON + bytes, no pickle) and loaded into a fresh learner of the
    same layout (other initial weights, no optimizer state yet) restores it to the boundary; both then take the
    same step bitwise."""
    state, _ = train_step(build(algorithm), batches[0])
    snapshot = ShardSnapshot(state)
    snapshot.take(state)
    text, flat = snapshot.packed()
    assert isinstance(text, str) and flat.dtype == torch.uint8 and flat.numel() >= snapshot.nbytes
    boundary = _state_of(state)
    state, _ = train_step(state, batches[1])
    fresh = build(algorithm, seed=1)
    assert max_diff(weights(fresh.policy), boundary["policy"]) > 1e-3 and not fresh.optimizer.state
    other = ShardSnapshot(fresh)
    other.load_packed(text, flat)
    other.restore(fresh)
    _same(_state_of(fresh), boundary)
    fresh, _ = train_step(fresh, batches[1])
    _same(_state_of(fresh), _state_of(state))


def test_a_packed_snapshot_of_another_layout_is_refused(batches):
    snapshot = ShardSnapshot(build("ppo"))
    state = build("grpo")
    mine = ShardSnapshot(state)
    mine.take(state)
    with pytest.raises(ValueError, match="other shapes"):
        ShardSnapshot(build("ppo")).load_packed(*mine.packed())
    with pytest.raises(RuntimeError, match="no snapshot was taken"):
        snapshot.packed()
