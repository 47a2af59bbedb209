"""Builders and the FSDP2 worker of the LoRA learner tests (workers live outside test files, so the spawned
processes import only this module and `tests.dist_helpers`)."""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist

from asyncrl.checkpoint import export_hf, load_checkpoint, save_checkpoint
from asyncrl.config import GRPO
from asyncrl.learner import build_learner, shard_model, train_step
from asyncrl.policies.lora import apply_lora
from tests.dist_helpers import ppo, tiny_policy, trainer_config, weights

RANK, ALPHA = 4, 8.0


def lora_algorithm(name: str):
    """GRPO with a KL loss (its reference: the base, adapters off) or PPO (its critic: adapters + value head)."""
    return {"grpo-kl": lambda: GRPO(kl_loss_coef=0.1), "ppo": ppo}[name]()


def build_lora(algorithm: str, *, sharded: bool = False, seed: int = 0):
    """A LoRA learner on `tiny_policy(0)` whose adapters are drawn from `seed` (the same on every rank), as the
    run assembles one: adapters on, then (FSDP2 over the default group) sharded, then build_learner."""
    policy = tiny_policy(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        apply_lora(policy, rank=RANK, alpha=ALPHA)
        for name, p in policy.named_parameters():
            if name.endswith("lora_B.weight"):  # trained-looking adapters: they change the function
                torch.nn.init.normal_(p, 0, 0.05)
    if sharded:
        shard_model(policy)
    return build_learner(policy, trainer_config(), lora_algorithm(algorithm),
                         group=dist.group.WORLD if sharded else None)


def trained(state) -> dict:
    out = {"policy": weights(state.policy)}
    if state.critic is not None:
        out["critic"] = weights(state.critic)
    return out


def lora_fsdp_worker(rank: int, world: int, out: pathlib.Path, groups, next_groups, run_dir: str,
                     export_dir: str) -> None:
    """Sharded LoRA learners: a train_step of GRPO+KL and of PPO (full weights after it: adapters, base,
    critic); the PPO learner saves a checkpoint, exports itself merged, and steps on `next_groups`; a fresh
    sharded learner (other adapters) loads the checkpoint and takes the same step. Writes out/rank{rank}.pt."""
    res: dict = {}
    for algorithm in ("grpo-kl", "ppo"):
        state, metrics = train_step(build_lora(algorithm, sharded=True), groups)
        res[algorithm] = dict(trained(state), metrics=metrics)
    path = save_checkpoint(run_dir, state)  # the PPO learner
    export_hf(state, export_dir)
    state, _ = train_step(state, next_groups)
    res["continued"] = trained(state)
    fresh = build_lora("ppo", sharded=True, seed=1)
    load_checkpoint(path, fresh)
    res["loaded"] = trained(fresh)
    fresh, _ = train_step(fresh, next_groups)
    res["loaded_continued"] = trained(fresh)
    torch.save(res, out / f"rank{rank}.pt")


__all__ = ["RANK", "ALPHA", "lora_algorithm", "build_lora", "trained", "lora_fsdp_worker"]
