"""Shared pieces of the checkpoint and FSDP2 tests: a tiny policy, engine-sampled groups with a pure reward,
and a launcher that runs a worker function on N CPU processes (gloo) with hard time limits.

Worker functions live in this module (not in the test files) so the spawned processes import only it.
Every worker writes its results with `torch.save` into a directory the test reads afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.checkpoint import export_hf, load_checkpoint, save_checkpoint
from asyncrl.checkpoint.snapshot import ShardSnapshot, exchange_in_ring
from asyncrl.config import GRPO, PPO, CriticConfig, OffPolicyConfig, OptimConfig, TrainerConfig
from asyncrl.learner import build_learner, full_weights, grad_norm_, policy_gradients, shard_model, train_step
from asyncrl.policies import ARCH_PRESETS, CausalLM, Engine, EngineConfig, SamplingParams, random_model
from asyncrl.types import Group
from tests.run_helpers import free_ports
from tests.timing import limit

VOCAB = ARCH_PRESETS["tiny-qwen2"]["vocab_size"]  # 256
STOP_IDS = tuple(range(3, 20))  # ~7% of the vocabulary: responses end at varied lengths


# ------------------------------------------------------------------------------------------ builders
def tiny_policy(seed: int = 0) -> CausalLM:
    """`tiny-qwen2` (tied embeddings, q/k/v biases) with a larger init than the preset's 0.02, so sampled
    responses and the policy gradient are far from uniform."""
    return random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.2), seed=seed)


def prompt_for(k: int) -> list[int]:
    """Prompt number k of the data stream: a pure function of k (3 to 7 tokens)."""
    gen = torch.Generator().manual_seed(10_000 + k)
    return torch.randint(20, VOCAB, (3 + k % 5,), generator=gen).tolist()


def reward_of(tokens: list[int]) -> float:
    """A pure reward: the fraction of even token ids in the response."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def sampling_params(run_seed: int, prompt_id: int, n: int, max_new_tokens: int) -> SamplingParams:
    """Per-request seed from (run seed, prompt index): a prompt samples the same tokens in any batch."""
    return SamplingParams(n=n, max_new_tokens=max_new_tokens, stop_token_ids=STOP_IDS,
                          seed=run_seed * 100_003 + prompt_id)


def small_engine(model: CausalLM, version: int = 0) -> Engine:
    return Engine(model, EngineConfig(max_slots=32, max_len=64, attend_bucket=16), version=version)


def rollout(engine: Engine, prompt_ids: list[int], *, run_seed: int = 0, n: int = 4, max_new_tokens: int = 8,
            admitted_version: int = 0) -> list[Group]:
    """Generate and score the groups of these prompt indices."""
    prompts = [prompt_for(k) for k in prompt_ids]
    outs = engine.generate(prompts, [sampling_params(run_seed, k, n, max_new_tokens) for k in prompt_ids])
    return [Group(k, p, o.completions, [reward_of(c.token_ids) for c in o.completions],
                  admitted_version=admitted_version) for k, p, o in zip(prompt_ids, prompts, outs)]


def sample_groups(num_groups: int, *, seed: int = 0, n: int = 3, max_new_tokens: int = 8,
                  first_id: int = 0) -> list[Group]:
    """Groups sampled from `tiny_policy(seed)` (behaviour log-probs = its own, version 0)."""
    return rollout(small_engine(tiny_policy(seed)), list(range(first_id, first_id + num_groups)), run_seed=seed,
                   n=n, max_new_tokens=max_new_tokens)


def trainer_config(**overrides) -> TrainerConfig:
    """Several optimizer steps per train_step (mini-batches × 2 epochs), a warmup + cosine schedule, small
    token budgets (several micro-batches per mini-batch) and an active gradient clip."""
    optim = dict(lr=1e-3, warmup_steps=2, schedule="cosine", total_steps=40, min_lr_ratio=0.1, grad_clip=0.5)
    optim.update(overrides.pop("optim", {}))
    kw = dict(mini_batch_size=2, ppo_epochs=2, max_tokens_per_micro_batch=40, max_response_length=8,
              optim=OptimConfig(**optim))
    kw.update(overrides)
    return TrainerConfig(**kw)


def recompute_config() -> TrainerConfig:
    """The learner recomputes π_old (`--trainer.off-policy.no-use-rollout-log-probs`)."""
    return trainer_config(off_policy=OffPolicyConfig(use_rollout_log_probs=False))


def ppo() -> PPO:
    return PPO(lam=0.95, critic=CriticConfig(lr=1e-3))


def make_algorithm(name: str, **kwargs):
    return {"grpo": GRPO, "ppo": lambda **kw: dataclasses.replace(ppo(), **kw)}[name](**kwargs)


def build(algorithm: str, *, sharded: bool = False, config: TrainerConfig | None = None, seed: int = 0,
          algo_kwargs: dict | None = None, offload: bool = False):
    """A learner on a fresh `tiny_policy(seed)`; `sharded`: FSDP2 over the default process group, the way
    the runtime builds a trainer rank (shard the policy, then build_learner, which makes PPO's critic from
    the sharded policy and shards it too). A KL algorithm gets a frozen `tiny_policy(seed)` as reference
    (as a run rebuilds it from the model path at start-up). `offload`: sharded with FSDP2's CPU offload
    (`--trainer.offload params`)."""
    policy = tiny_policy(seed)
    algo = make_algorithm(algorithm, **(algo_kwargs or {}))
    reference = tiny_policy(seed) if algo.needs_reference else None
    if sharded:
        shard_model(policy, offload=offload)
    return build_learner(policy, config or trainer_config(), algo, reference=reference,
                         group=dist.group.WORLD if sharded else None)


def weights(model) -> dict[str, torch.Tensor]:
    """Full (gathered) weights by HF name, cloned (collective under FSDP2: call on every rank)."""
    return {k: v.clone() for k, v in full_weights(model)}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# -------------------------------------------------------------------------------------- the launcher
def _entry(rank: int, worker, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=limit(60)))
    try:
        worker(rank, world_size, pathlib.Path(out_dir), *args)
    except BaseException:
        # the traceback also reaches the parent through mp.spawn; this copy survives a hang elsewhere
        (pathlib.Path(out_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(worker, out_dir: str | os.PathLike, *args, world_size: int = 2, timeout: float = limit(60)) -> None:
    """Run `worker(rank, world_size, out_dir, *args)` on `world_size` spawned CPU processes joined in a gloo
    process group. Raises the first worker's exception; kills the workers and fails after `timeout` s."""
    ctx = mp.spawn(_entry, args=(worker, world_size, free_ports(), str(out_dir), args), nprocs=world_size,
                   join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                errors = "".join(p.read_text() for p in sorted(pathlib.Path(out_dir).glob("error*.txt")))
                raise TimeoutError(f"distributed workers did not finish within {timeout} s\n{errors}")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


# ------------------------------------------------------------------------------------------ workers
def known_grads(model) -> dict[str, torch.Tensor]:
    """A deterministic full gradient per parameter (by parameter name), the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    return {name: torch.randn(tuple(p.shape), generator=gen) for name, p in model.named_parameters()}


def clipped_grads(*, sharded: bool, max_norm: float) -> dict:
    """Give `tiny_policy()` the gradients `known_grads`, sharded like its parameters when `sharded` (FSDP2
    over the default group), then `grad_norm_`: the norm and the full gradients after clipping."""
    from torch.distributed.tensor import distribute_tensor

    model = tiny_policy()
    if sharded:
        shard_model(model)
    full = known_grads(model)
    for name, p in model.named_parameters():
        g = full[name]
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if sharded else g
    params = [p for p in model.parameters() if p.grad is not None]
    norm = grad_norm_(params, max_norm, dist.group.WORLD if sharded else None)
    grads = {n: (p.grad.full_tensor() if sharded else p.grad).clone() for n, p in model.named_parameters()}
    return dict(norm=float(norm), grads=grads)


def fsdp_worker(rank: int, world: int, out: pathlib.Path, groups: list[Group], next_groups: list[Group],
                modes: list[str], single_ckpt: str, run_dir: str, export_dir: str) -> None:
    """Every sharded scenario of tests/learner/test_fsdp.py in one launch (a launch costs two torch imports):

    0. `grad_norm_` of known sharded gradients (`clipped_grads`), per max_norm;
    1. `policy_gradients(groups)` of a sharded GRPO learner, per loss_agg_mode, and with 3-token LM-head chunks;
    2. one `train_step(groups)` of sharded GRPO and PPO learners: full weights and metrics; also GRPO with π_old
       recomputed (`recompute_config`: each rank runs the no-grad forwards of the rows dealt it);
    3. the PPO learner then saves a checkpoint, exports itself with export_hf, and steps on `next_groups`;
    4. a fresh sharded learner (other init) loads that checkpoint and takes the same step;
    5. another one loads `single_ckpt` (written by one process) and takes the same step;
    6. a PPO learner sharded with FSDP2's CPU offload (`--trainer.offload params`) takes the step of 2;
    7. in 3, each rank snapshots its shard (`ShardSnapshot`) before the step on `next_groups`, restores it after,
       and takes that step again; 8. sends it packed to the ring successor, and loads it into a fresh learner
       (other initial weights, no optimizer state), which takes the same step.
    Writes its results to `out/rank{rank}.pt`."""
    res: dict = {"grads": {}, "train": {}, "clip": {}}
    for max_norm in (0.0, 0.5, 1e6):
        res["clip"][max_norm] = clipped_grads(sharded=True, max_norm=max_norm)
    for mode in modes:
        state = build("grpo", sharded=True, algo_kwargs=dict(loss_agg_mode=mode))
        res["grads"][mode] = policy_gradients(state, groups)
    # 3-token LM-head chunks: the ranks' micro-batches (different rows) run different numbers of chunks
    res["grads_chunked"] = policy_gradients(build("grpo", sharded=True, config=trainer_config(logits_chunk_tokens=3)),
                                            groups)
    for algorithm in ("grpo", "ppo"):
        state = build(algorithm, sharded=True)
        state, metrics = train_step(state, groups)
        res["train"][algorithm] = dict(policy=weights(state.policy), metrics=metrics,
                                       critic=weights(state.critic) if state.critic is not None else None)
    recompute = build("grpo", sharded=True, config=recompute_config())
    recompute, metrics = train_step(recompute, groups)
    res["train_recompute"] = dict(policy=weights(recompute.policy), metrics=metrics)
    # `state` is the trained PPO learner
    path = save_checkpoint(run_dir, state, extra={"cursor": 17, "rank": rank})
    export_hf(state, export_dir)
    snapshot = ShardSnapshot(state)  # 7. a restore point of each rank's shard, then the same step again from it
    snapshot.take(state)
    state, _ = train_step(state, next_groups)
    res["continued"] = dict(policy=weights(state.policy), critic=weights(state.critic))
    snapshot.restore(state)
    res["restored"] = dict(policy=weights(state.policy), critic=weights(state.critic), step=state.step)
    state, _ = train_step(state, next_groups)
    res["restored_continued"] = dict(policy=weights(state.policy), critic=weights(state.critic))
    packed = snapshot.packed()  # 8. the snapshot to the ring successor; and into a fresh learner, which steps alike
    res["ring"] = dict(own=packed, replica=exchange_in_ring(packed, dist.group.WORLD))
    fresh = build("ppo", sharded=True, seed=3)
    replacement = ShardSnapshot(fresh)
    replacement.load_packed(*packed)
    replacement.restore(fresh)
    fresh, _ = train_step(fresh, next_groups)
    res["fresh_from_packed"] = dict(policy=weights(fresh.policy), critic=weights(fresh.critic))

    fresh = build("ppo", sharded=True, seed=1)
    res["extra"] = load_checkpoint(path, fresh)
    res["loaded"] = dict(policy=weights(fresh.policy), critic=weights(fresh.critic),
                         counters=(fresh.step, fresh.optimizer_steps, fresh.version),
                         lr=fresh.scheduler.get_last_lr())
    fresh, _ = train_step(fresh, next_groups)
    res["loaded_continued"] = dict(policy=weights(fresh.policy), critic=weights(fresh.critic))

    other = build("ppo", sharded=True, seed=2)
    load_checkpoint(single_ckpt, other)
    res["from_single"] = dict(policy=weights(other.policy), critic=weights(other.critic))
    other, _ = train_step(other, next_groups)
    res["from_single_continued"] = dict(policy=weights(other.policy), critic=weights(other.critic))

    offloaded, _ = train_step(build("ppo", sharded=True, offload=True), groups)
    res["offloaded"] = dict(policy=weights(offloaded.policy), critic=weights(offloaded.critic),
                            offloaded=all(p.device.type == "cpu" for p in offloaded.critic.parameters()))
    torch.save(res, out / f"rank{rank}.pt")


__all__ = [
    "VOCAB", "tiny_policy", "prompt_for", "reward_of", "sampling_params", "small_engine", "rollout",
    "sample_groups", "trainer_config", "ppo", "make_algorithm", "build", "weights", "max_diff",
    "run_distributed", "known_grads", "clipped_grads", "fsdp_worker",
]
