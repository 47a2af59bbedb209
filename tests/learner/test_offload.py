"""`--trainer.offload optimizer`: HostAdamW (moments and an fp32 master copy in host memory, the update on the
parameters' device a bucket at a time) against torch's AdamW, its state dict in both directions, and a whole
learner step and checkpoint with it. (`--trainer.offload params`, FSDP2's CPU offload, is in test_fsdp.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.checkpoint import load_checkpoint, save_checkpoint
from asyncrl.learner import train_step
from asyncrl.learner.offload import HostAdamW, host_state_bytes
from tests.dist_helpers import build, max_diff, sample_groups, trainer_config, weights
from tests.tolerances import close_tol

SETTINGS = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(shapes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) for p in params]


def _run(optimizer, params, steps, first=0, cast=None):
    for t in range(first, first + steps):
        for p, g in zip(params, _grads(params, t)):
            p.grad = (g.to(cast) if cast is not None else g).to(p.dtype)
        optimizer.step()


@settings(max_examples=25, deadline=None)
@given(shapes=st.lists(st.sampled_from([(3,), (4, 5), (1,), (2, 3, 2)]), min_size=1, max_size=5),
       bucket=st.integers(1, 2000), steps=st.integers(1, 4))
def test_host_adamw_steps_like_torch_adamw_whatever_the_buckets(shapes, bucket, steps):
    ours, theirs = _params(shapes), _params(shapes)
    _run(HostAdamW(ours, bucket_bytes=bucket, **SETTINGS), ours, steps)
    _run(torch.optim.AdamW(theirs, foreach=False, **SETTINGS), theirs, steps)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=0, atol=close_tol(torch.float32, b, terms=4))
    assert max(float((a - b).detach().abs().max()) for a, b in zip(ours, _params(shapes))) > 1e-3  # they moved


def test_bf16_weights_keep_an_fp32_master_that_takes_every_update():
    """bf16 parameters: the master follows fp32 AdamW on the same gradients, and the parameter is the master
    rounded, even where the update is far below a bf16 step (lr 1e-6 on weights near 1)."""
    shapes = [(64,), (8, 8)]
    ours = _params(shapes, torch.bfloat16)
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in ours]
    settings_ = dict(SETTINGS, lr=1e-6)
    optimizer = HostAdamW(ours, **settings_)
    _run(optimizer, ours, 5, cast=torch.bfloat16)
    _run(torch.optim.AdamW(fp32, foreach=False, **settings_), fp32, 5, cast=torch.bfloat16)
    for p, want, initial in zip(ours, fp32, _params(shapes, torch.bfloat16)):
        master = optimizer.state[p]["master"]
        assert master.dtype == torch.float32 and master.device.type == "cpu"
        assert torch.allclose(master, want, rtol=0, atol=close_tol(torch.float32, want, terms=4))
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
        moved = (master - initial.detach().float()).abs()
        assert 0 < float(moved.max()) < 2 ** -9  # under half a bf16 step of a weight near 1: bf16 alone loses it
    assert host_state_bytes(ours) == 12 * sum(p.numel() for p in ours)
    assert host_state_bytes(fp32) == 8 * sum(p.numel() for p in fp32)


@pytest.mark.parametrize("source, target", [("host", "torch"), ("torch", "host"), ("host", "host")])
def test_state_dicts_move_between_host_adamw_and_torch_adamw(source, target):
    """Three steps, a state dict, three more on a fresh optimizer of the other kind: the weights of six
    uninterrupted steps."""
    make = {"host": lambda ps: HostAdamW(ps, **SETTINGS),
            "torch": lambda ps: torch.optim.AdamW(ps, foreach=False, **SETTINGS)}
    shapes = [(4, 5), (7,)]
    straight = _params(shapes)
    _run(make["torch"](straight), straight, 6)
    first = _params(shapes)
    opt = make[source](first)
    _run(opt, first, 3)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    other = make[target](resumed)
    other.load_state_dict(opt.state_dict())
    _run(other, resumed, 3, first=3)
    for a, b in zip(resumed, straight):
        assert torch.allclose(a, b, rtol=0, atol=close_tol(torch.float32, b, terms=8))
    if target == "host":
        state = other.state[resumed[0]]
        assert state["exp_avg"].device.type == "cpu" and float(state["step"]) == 6


def test_a_mismatched_state_dict_is_refused():
    opt = HostAdamW(_params([(3,)]), **SETTINGS)
    with pytest.raises(ValueError, match="parameter groups do not match"):
        opt.load_state_dict(torch.optim.AdamW(_params([(3,), (2,)]), **SETTINGS).state_dict())


@pytest.fixture(scope="module")
def groups():
    return sample_groups(4, seed=0, n=3)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_learner_with_its_optimizer_offloaded_trains_like_one_without(groups, algorithm, tmp_path):
    """A whole train_step (several optimizer steps, clipping, warmup + cosine lr; PPO's critic too), then a
    checkpoint written with offload and read without it: the same weights and the same next step."""
    plain, _ = train_step(build(algorithm), groups)
    offloaded = build(algorithm, config=trainer_config(offload="optimizer"))
    assert isinstance(offloaded.optimizer, HostAdamW)
    offloaded, metrics = train_step(offloaded, groups)
    scale = max(float(w.abs().max()) for w in weights(plain.policy).values())
    tol = close_tol(torch.float32, scale, terms=64, depth=4)
    assert max_diff(weights(offloaded.policy), weights(plain.policy)) <= tol
    if algorithm == "ppo":
        assert isinstance(offloaded.critic_optimizer, HostAdamW)
        assert max_diff(weights(offloaded.critic), weights(plain.critic)) <= tol
    path = save_checkpoint(tmp_path, offloaded, extra={})
    reloaded = build(algorithm, seed=1)
    load_checkpoint(path, reloaded)
    assert max_diff(weights(reloaded.policy), weights(offloaded.policy)) == 0
    more = sample_groups(4, seed=0, n=3, first_id=50)
    a, _ = train_step(reloaded, more)
    b, _ = train_step(offloaded, more)
    assert max_diff(weights(a.policy), weights(b.policy)) <= tol


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the streamed update runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_the_streamed_buckets_update_like_torch_adamw(dtype):
    """CUDA: pinned host state, two buckets in flight on two streams (here 7 buckets of one parameter each):
    the weights of torch's AdamW on the same gradients (bf16: its master against fp32 AdamW)."""
    shapes = [(256, 128), (4096,), (64, 64, 3), (17,), (1024, 33), (5,), (300, 7)]
    ours = [torch.nn.Parameter(p.detach().cuda()) for p in _params(shapes, dtype)]
    theirs = [torch.nn.Parameter(p.detach().float().cuda()) for p in _params(shapes, dtype)]
    optimizer = HostAdamW(ours, bucket_bytes=1, **SETTINGS)
    assert all(s["exp_avg"].is_pinned() for s in optimizer.state.values())
    reference = torch.optim.AdamW(theirs, foreach=False, **SETTINGS)
    for t in range(4):
        for a, b, g in zip(ours, theirs, _grads(ours, t)):
            a.grad = g.to(dtype).cuda()
            b.grad = g.to(dtype).float().cuda()
        optimizer.step()
        reference.step()
    for p, want in zip(ours, theirs):
        got = optimizer.state[p]["master"] if dtype != torch.float32 else p.detach()
        assert torch.allclose(got.cuda(), want.detach(), rtol=0, atol=close_tol(torch.float32, want, terms=4))
        if dtype != torch.float32:
            assert torch.equal(p.detach().cpu(), optimizer.state[p]["master"].to(dtype))
