"""One training step: `(state, groups) -> (state, metrics)` — collate, prepare, the critic's and the actor's
updates (concurrently when the critic has its own device), and the step's metrics in verl's names."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from asyncrl import algos
from asyncrl.learner.batch import RolloutBatch, collate
from asyncrl.learner.prepare import Prepared, prepare, prepare_share
from asyncrl.learner.share import Deal, Share, group_counts, take_share
from asyncrl.learner.state import LearnerState
from asyncrl.learner.update import Totals, accumulate, actor_loss, critic_loss, ess_lr_scale, run_updates, world
from asyncrl.types import Group

__all__ = ["train_step", "policy_gradients", "memory_metrics"]


def _as_batch(state: LearnerState, groups: list[Group] | RolloutBatch) -> RolloutBatch:
    cfg, algo = state.config, state.algorithm
    batch = groups if isinstance(groups, RolloutBatch) else collate(
        groups, max_response_length=cfg.max_response_length,
        overlong_buffer_len=algo.overlong_buffer(cfg.max_response_length),
        overlong_penalty_factor=algo.overlong_penalty_factor)
    return batch.to(state.device)


def _prepared(state: LearnerState, groups: list[Group] | RolloutBatch | Share, *, once: bool = False
              ) -> tuple[Prepared, Prepared | None, Deal]:
    """The step's batch prepared: (this rank's share, the whole batch where this rank holds it, the deal). Rank 0
    of a trainer group is given the whole batch; another rank its `Share` (`asyncrl.rpc.commands` sends only
    that) or the whole batch, which it cuts its share from. `once`: one mini-batch of every group."""
    rank, size = world(state)
    if isinstance(groups, Share):
        if rank == 0:
            raise ValueError("train_step: rank 0 of a trainer group computes what needs the whole batch; give it the "
                             "whole batch, not a share")
        share = dataclasses.replace(groups, batch=groups.batch.to(state.device))
        return *prepare_share(state, share, None), share.deal
    batch = _as_batch(state, groups)
    tokens, rows = group_counts(batch)
    deal = Deal.once(tokens, rows, size) if once else Deal.of_step(state.config, state.step, tokens, rows, size)
    if size == 1:
        prep = prepare(state, batch)
        return prep, prep, deal
    prep, whole = prepare_share(state, take_share(batch, deal, rank), batch if rank == 0 else None)
    return prep, whole, deal


def _actor_update(state: LearnerState, prep: Prepared, deal: Deal) -> dict:
    scale = ess_lr_scale if state.config.off_policy.ess_scaled_lr else None
    result = run_updates(state, prep, deal, actor_loss, state.policy, state.optimizer, state.scheduler, scale)
    state.optimizer_steps += result.updates
    state.skipped_updates += result.skipped
    out = {f"actor/{k}": v / max(result.updates, 1) for k, v in result.sums.items()}
    means = dict(result.means)
    ratio, ratio_sq = means.pop("behaviour_ratio", None), means.pop("behaviour_ratio_sq", None)
    if ratio is not None:  # the drift from μ over the step's tokens (`asyncrl.algos.drift`)
        out["actor/behaviour_ess"] = algos.effective_sample_size(ratio, ratio_sq)
    out.update({f"actor/{k}": v for k, v in means.items()})
    out["actor/grad_norm"] = result.mean_grad_norm
    out["actor/lr"] = state.scheduler.get_last_lr()[0]
    out["actor/skipped_updates"] = state.skipped_updates
    return out


def _critic_update(state: LearnerState, prep: Prepared, deal: Deal) -> dict:
    result = run_updates(state, prep, deal, critic_loss, state.critic, state.critic_optimizer, state.critic_scheduler)
    state.critic_skipped_updates += result.skipped
    # micro-batch losses are normalised by their mini-batch's counts: their sum is one update's loss
    return {"critic/vf_loss": result.sums.get("vf_loss", 0.0) / max(result.updates, 1),
            "critic/vf_clipfrac": result.means.get("vf_clipfrac", 0.0),
            "critic/grad_norm": result.mean_grad_norm, "critic/skipped_updates": state.critic_skipped_updates}


def train_step(state: LearnerState, groups: list[Group] | RolloutBatch | Share) -> tuple[LearnerState, dict]:
    """One training step on a batch of groups (in a trainer group: rank 0 the whole batch, another rank the whole
    batch or its `Share`). Returns the (mutated) state and verl-named metrics; the metrics of the batch and its
    preparation come from the rank that holds the whole batch, the update's from every rank."""
    start = time.perf_counter()
    algo = state.algorithm
    prep, whole, deal = _prepared(state, groups)
    metrics = dict(whole.metrics) if whole is not None else {}
    train_actor = state.critic is None or state.step >= algo.critic.warmup_steps
    # concurrent = the critic's update in a worker thread (split placement on its own device); in a
    # multi-process trainer group both updates use the group's collectives, so they take turns
    concurrent = state.critic is not None and algo.critic.concurrent and world(state)[1] == 1
    if state.critic is not None and not concurrent:
        metrics.update(_critic_update(state, prep, deal))
    if concurrent:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic") as pool:
            critic_future = pool.submit(_critic_update, state, prep, deal)
            if train_actor:
                metrics.update(_actor_update(state, prep, deal))
            metrics.update(critic_future.result())
    elif train_actor:
        metrics.update(_actor_update(state, prep, deal))
    state.step += 1
    if whole is not None:
        metrics.update(_batch_metrics(whole))
    metrics.update({"timing_s/update_actor": time.perf_counter() - start, "training/global_step": state.step,
                    **memory_metrics(state.device)})
    return state, metrics


def policy_gradients(state: LearnerState, groups: list[Group] | RolloutBatch) -> dict[str, torch.Tensor]:
    """The accumulated policy gradient of the whole batch as one mini-batch, without an optimizer step
    (for checking that micro-batching, packing, token budgets and sharding leave the gradient unchanged)."""
    prep, _, deal = _prepared(state, groups, once=True)
    state.optimizer.zero_grad(set_to_none=not state.config.cuda_graphs)
    accumulate(state, prep, deal.updates[0][world(state)[0]], actor_loss, state.device, Totals())
    grads = {}
    for name, p in state.policy.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone()
    state.optimizer.zero_grad(set_to_none=not state.config.cuda_graphs)
    return grads


def _batch_metrics(prep: Prepared) -> dict:
    batch, mask = prep.batch, prep.batch.response_mask
    lengths = batch.response_lens.float()
    valid = prep.advantages[mask]
    return {
        "critic/score/mean": float(batch.rewards.mean()),
        "critic/score/max": float(batch.rewards.max()),
        "critic/score/min": float(batch.rewards.min()),
        "reward/accuracy": float((batch.rewards >= 1.0 - 1e-6).float().mean()),  # for 0/1 task rewards
        "critic/advantages/mean": float(valid.mean()) if valid.numel() else 0.0,
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((lengths >= mask.shape[1]).float().mean()),
        "training/num_groups": len(batch.prompt_ids),
        "perf/total_num_tokens": int((batch.prompt_lens + batch.response_lens).sum()),
        "rollout/nonfinite_logprob_tokens": batch.nonfinite_logprobs,
    }


def memory_metrics(device: torch.device, prefix: str = "perf") -> dict:
    """Peak accelerator memory of this process since it started (verl's names), empty off CUDA."""
    if device.type != "cuda":
        return {}
    return {f"{prefix}/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            f"{prefix}/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
