"""Everything a step computes once before its updates: π_old (behaviour or recomputed proximal log-probs),
π_ref, the critic's values, per-token rewards, advantages, the loss mask and importance weights. Every
number comes from `asyncrl.algos`; the forwards here run without gradients."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncrl import algos
from asyncrl.config import OffPolicyConfig
from asyncrl.learner.batch import RolloutBatch
from asyncrl.learner.forward import micro_logprobs, micro_values, row_lengths
from asyncrl.learner.layout import RowLengths, balance_groups, plan_micro_batches, split_rows
from asyncrl.learner.routes import empty_routes, micro_routes, store_routes
from asyncrl.learner.sharding import compute_device
from asyncrl.learner.state import LearnerState, group_reduced, world
from asyncrl.policies.lora import adapters_off
from asyncrl.policies.routing_replay import Replayed, router_layers

__all__ = ["Prepared", "prepare"]


@dataclasses.dataclass
class Prepared:
    """A batch with what its updates need, all [N, T] on the batch's device."""

    batch: RolloutBatch
    logp_old: Tensor
    advantages: Tensor
    returns: Tensor | None  # critic targets
    values_old: Tensor | None
    logp_ref: Tensor | None
    mask: Tensor  # the loss mask
    is_weights: Tensor | None
    metrics: dict
    lengths: RowLengths  # on the host
    routes: Tensor | None = None  # --trainer.routing-replay: [N·S, routers, top_k] (`asyncrl.learner.routes`)

    def totals(self) -> list[int]:
        """Prompt + response tokens of each row."""
        return [self.lengths.total(r) for r in range(self.batch.num_rows)]


@torch.no_grad()
def _forward_all(state: LearnerState, model: nn.Module, batch: RolloutBatch, lengths: RowLengths,
                 values: bool = False, routes: Tensor | None = None, known: Tensor | None = None,
                 replayed: Replayed | None = None) -> Tensor:
    """No-grad log-probs (or values) of every row, micro-batched like training, on the model's own device
    (a reference or critic may live elsewhere); returned on the batch's device. With `routes` (a route grid,
    `asyncrl.learner.routes`) the policy's routers' choices are recorded into it; with `known` too (bool [N·S])
    the routers first replay the grid's routes at those cells (counted into `replayed`) and choose elsewhere.
    In a trainer group (without routes) each rank runs the rows `_rows_of` deals it, and one all-reduce gives
    every rank every row: each row is computed once in the group, not once a rank."""
    cfg = state.config
    home = batch.tokens.device
    tokens = batch.tokens.to(compute_device(model))
    width = batch.response_mask.shape[1]
    totals = [lengths.total(r) for r in range(batch.num_rows)]
    shared = world(state)[1] > 1 and routes is None
    chunks = split_rows(_rows_of(state, totals) if shared else list(range(batch.num_rows)), totals, cfg)
    if shared:  # every rank runs as many forwards (a sharded model's collectives line up): pad with placeholders
        count = group_reduced(state, torch.tensor([len(chunks)]), dist.ReduceOp.MAX)
        chunks = chunks + [[]] * (int(count) - len(chunks))
    micros = plan_micro_batches(tokens, chunks, lengths, packed=cfg.pack_sequences, bucketed=cfg.cuda_graphs)
    out = torch.zeros(batch.num_rows, width, device=tokens.device)
    was_training = model.training
    model.eval()
    try:
        for micro in micros:
            if values:
                result = micro_values(model, micro, width, autocast=cfg.autocast_bf16)
            else:
                with contextlib.ExitStack() as stack:
                    replay = (stack.enter_context(state.moe.replaying(micro_routes(routes, micro),
                                                                      known=micro_routes(known, micro)))
                              if known is not None else None)
                    recorded = stack.enter_context(state.moe.recording()) if routes is not None else None
                    result = micro_logprobs(model, micro, width, temperature=cfg.sampling_temperature,
                                            autocast=cfg.autocast_bf16, chunk_tokens=cfg.logits_chunk_tokens)[0]
                if replay is not None:
                    replayed.add(replay)
                if recorded is not None:
                    store_routes(routes, micro, recorded.routes())
            if not micro.empty:  # a placeholder only keeps a sharded model's collectives in step
                out[micro.rows] = result.to(out.dtype)
    finally:
        model.train(was_training)
    if shared:  # a row is zero on every rank but the one that ran it: the sum is every row, exactly
        out = group_reduced(state, out)
    return out.to(home)


def _rows_of(state: LearnerState, totals: list[int]) -> list[int]:
    """This rank's rows for the no-grad forwards: dealt by token count (`balance_groups` over rows), in order."""
    rank, size = world(state)
    return balance_groups(list(range(len(totals))), dict(enumerate(totals)), size)[rank]


def _reference_logprobs(state: LearnerState, batch: RolloutBatch, lengths: RowLengths) -> Tensor | None:
    """π_ref of every row: the reference model's, or (LoRA) the policy's own base with its adapters off."""
    if state.reference is not None:
        return _forward_all(state, state.reference, batch, lengths)
    if state.reference_is_base:
        with adapters_off(state.policy):
            return _forward_all(state, state.policy, batch, lengths)
    return None


def _token_rewards(batch: RolloutBatch) -> Tensor:
    """The outcome reward placed on each row's last response token in the mask: [N, T]."""
    out = torch.zeros_like(batch.logp_behaviour)
    mask = batch.response_mask
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last = (mask * positions).argmax(-1)  # the last token in the mask (the last generated one unless left out)
    out[torch.arange(batch.num_rows, device=out.device), last] = batch.rewards.to(out.dtype)
    return torch.where(batch.response_mask, out, torch.zeros_like(out))


def _loss_mask(off: OffPolicyConfig, batch: RolloutBatch, logp_old: Tensor, version: int) -> tuple[Tensor, dict]:
    mask, metrics = batch.response_mask, {}
    lag = algos.version_lag(batch.token_versions, version, mask)
    metrics["training/version_lag/mean"] = float(lag.seq_max.float().mean())
    metrics["training/version_lag/max"] = int(lag.seq_max.max())
    if off.max_version_lag is not None:
        capped = algos.staleness_mask(batch.token_versions, version, mask, max_version_lag=off.max_version_lag,
                                      level=off.stale_level)
        metrics["training/stale_masked_fraction"] = float(1 - capped.sum() / mask.sum().clamp(min=1))
        mask = capped
    if off.rs_stat != "none" and bool(mask.any()):
        kwargs = dict(stat=off.rs_stat, lower=off.rs_lower, upper=off.rs_upper)
        rs = (algos.token_rejection_mask(logp_old, batch.logp_behaviour, mask, **kwargs) if off.rs_level == "token"
              else algos.sequence_rejection_mask(logp_old, batch.logp_behaviour, mask, reduce=off.rs_level, **kwargs))
        metrics["rollout_corr/rejected_fraction"] = float(rs.rejected_fraction)
        mask = rs.mask
    if off.m2_threshold is not None and bool(mask.any()):
        m2 = algos.m2po_mask(logp_old, batch.logp_behaviour, mask, threshold=off.m2_threshold)
        metrics["rollout_corr/m2po_rejected_fraction"] = float(m2.rejected_fraction)
        mask = m2.mask
    return mask, metrics


def _is_weights(off: OffPolicyConfig, batch: RolloutBatch, logp_old: Tensor, mask: Tensor) -> tuple[Tensor | None, dict]:
    if off.is_level == "none" or not bool(mask.any()):
        return None, {}
    fn = algos.token_tis_weights if off.is_level == "token" else algos.sequence_tis_weights
    w = fn(logp_old, batch.logp_behaviour, mask, threshold=off.is_threshold)
    return w.weights, {"rollout_corr/is_weight_mean": float(w.mean),
                       "rollout_corr/is_truncated_fraction": float(w.truncated_fraction),
                       "rollout_corr/ess": float(w.ess)}


def prepare(state: LearnerState, batch: RolloutBatch) -> Prepared:
    """π_old, π_ref, values, rewards, advantages, mask and weights of `batch` (see the module docstring)."""
    algo, off = state.algorithm, state.config.off_policy
    metrics: dict = {}
    lengths = row_lengths(batch)
    routes, known = _route_grid(state, batch)  # recorded (r3: replayed first) in the pass that computes π_old
    vs_rollout = Replayed()
    own = (_forward_all(state, state.policy, batch, lengths, routes=routes, known=known, replayed=vs_rollout)
           if routes is not None or not off.use_rollout_log_probs else None)
    if known is not None:
        metrics["rollout_corr/routing_disagreement"] = vs_rollout.disagreement()
        real = sum(lengths.total(r) for r in range(batch.num_rows))
        metrics["rollout_corr/routed_fraction"] = float(known.sum()) / max(real, 1)  # of the rows' tokens
    logp_old = batch.logp_behaviour if off.use_rollout_log_probs else own
    logp_ref = _reference_logprobs(state, batch, lengths)
    values_old = (_forward_all(state, state.critic, batch, lengths, values=True)
                  if state.critic is not None else None)
    token_rewards = _token_rewards(batch)
    if algo.kl_in_reward_coef > 0:
        kl = algos.kl_penalized_rewards(token_rewards, logp_old, logp_ref, batch.response_mask, kl_coef=state.kl_coef)
        token_rewards = kl.token_rewards
        metrics["actor/reward_kl"] = float(kl.mean_kl)
        metrics["actor/kl_coef"] = state.kl_coef
        if algo.kl_target is not None:
            state.kl_coef = algos.adaptive_kl_coef(state.kl_coef, float(kl.mean_kl), batch.num_rows,
                                                   target_kl=algo.kl_target, horizon=algo.kl_horizon)
    with torch.no_grad():
        adv = algo.advantages(batch.rewards, token_rewards, batch.group_index, batch.response_mask, values_old)
    mask, mask_metrics = _loss_mask(off, batch, logp_old, state.version)
    is_weights, is_metrics = _is_weights(off, batch, logp_old, mask)
    metrics.update(mask_metrics)
    metrics.update(is_metrics)
    if own is not None:  # how far the behaviour log-probs are from the learner's (with r3: on the engine's experts)
        metrics["rollout_corr/mismatch_kl"] = float(algos.masked_mean(batch.logp_behaviour - own, mask))
    return Prepared(batch, logp_old, adv.advantages, adv.returns if values_old is not None else None, values_old,
                    logp_ref, mask, is_weights, metrics, lengths, routes)


def _route_grid(state: LearnerState, batch: RolloutBatch) -> tuple[Tensor | None, Tensor | None]:
    """Where the learner replays routes (`--trainer.routing-replay`): the batch's route grid and, with r3 and a
    batch that brought the engine's routes, the cells holding them (bool [N·S]); else (None, None)."""
    replay = state.config.routing_replay
    if replay == "off":
        return None, None
    top_k = {int(router.top_k) for _, router in state.moe.routers}
    if len(top_k) != 1:
        raise ValueError(f"--trainer.routing-replay: the routers choose {sorted(top_k)} experts; one top_k is needed")
    k = top_k.pop()
    grid = empty_routes(batch.num_rows, batch.tokens.shape[1], routers=len(state.moe.routers), top_k=k,
                        device=batch.tokens.device)
    engine = batch.rollout_routes
    if replay != "r3" or engine is None:
        return grid, None
    layers = router_layers(state.moe.names)
    if engine.shape[2] != k or max(layers) >= engine.shape[1]:
        raise ValueError(f"--trainer.routing-replay r3: the engine's routes are [positions, {engine.shape[1]} layers, "
                         f"top_k {engine.shape[2]}], but the learner's routers sit in layers up to {max(layers)} and "
                         f"choose {k} experts: the engine serves another model")
    known = batch.routed.to(grid.device)
    grid[known] = engine.to(grid.device)[known][:, layers].to(grid.dtype)
    return grid, known
