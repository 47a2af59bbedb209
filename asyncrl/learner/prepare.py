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
from asyncrl.learner.layout import RowLengths, plan_micro_batches, split_rows
from asyncrl.learner.routes import empty_routes, micro_routes, store_routes
from asyncrl.learner.share import Share, gather_rows, scatter_rows
from asyncrl.learner.sharding import compute_device
from asyncrl.learner.state import LearnerState, group_reduced, world
from asyncrl.policies.lora import adapters_off
from asyncrl.policies.routing_replay import Replayed, router_layers

__all__ = ["Prepared", "prepare", "prepare_share"]


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
def _forward_all(state: LearnerState, model: nn.Module, batch: RolloutBatch, lengths: RowLengths, rows: list[int], *,
                 in_step: bool, values: bool = False, routes: Tensor | None = None, known: Tensor | None = None,
                 replayed: Replayed | None = None) -> Tensor:
    """No-grad log-probs (or values) of `rows` ([N, T], other rows zero), micro-batched like training, on the
    model's own device (a reference or critic may live elsewhere); returned on the batch's device. With `routes`
    (a route grid, `asyncrl.learner.routes`) the policy's routers' choices are recorded into it; with `known` too
    (bool [N·S]) the routers first replay the grid's routes at those cells (counted into `replayed`) and choose
    elsewhere. `in_step`: the ranks of a trainer group run as many forwards each (a sharded model's collectives
    line up): this rank pads with placeholders."""
    cfg = state.config
    home = batch.tokens.device
    tokens = batch.tokens.to(compute_device(model))
    width = batch.response_mask.shape[1]
    chunks = split_rows(rows, [lengths.total(r) for r in range(batch.num_rows)], cfg)
    if in_step:
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
    return out.to(home)


@dataclasses.dataclass
class Forwards:
    """A batch's no-grad forwards, [N, T] on its device: the policy's log-probs (recomputed π_old; None when the
    behaviour log-probs serve and no routes are replayed), π_ref, the critic's values, and with routing replay the
    route grid the π_old pass recorded and what its replay of the engine's routes saw."""

    own: Tensor | None
    ref: Tensor | None
    values: Tensor | None
    routes: Tensor | None
    known: Tensor | None  # r3: the grid cells holding the engine's routes
    replayed: Replayed

    def stacked(self) -> Tensor | None:
        """The log-probs and values there are, as [N, K, T] (K in field order), None if there are none."""
        parts = [t for t in (self.own, self.ref, self.values) if t is not None]
        return torch.stack(parts, 1) if parts else None

    def unstacked(self, stacked: Tensor | None) -> "Forwards":
        """These forwards with their log-probs and values read from `stacked` (another batch's, as `stacked` gives)."""
        parts = iter(stacked.unbind(1) if stacked is not None else ())
        own, ref, values = (next(parts) if t is not None else None for t in (self.own, self.ref, self.values))
        return dataclasses.replace(self, own=own, ref=ref, values=values)


def _forwards(state: LearnerState, batch: RolloutBatch, lengths: RowLengths, rows: list[int], *,
              in_step: bool = False) -> Forwards:
    """The no-grad forwards of `rows` of `batch` (see `Forwards`)."""
    off = state.config.off_policy
    routes, known = _route_grid(state, batch)  # recorded (r3: replayed first) in the pass that computes π_old
    replayed = Replayed()
    run = dict(in_step=in_step)
    own = (_forward_all(state, state.policy, batch, lengths, rows, routes=routes, known=known, replayed=replayed, **run)
           if routes is not None or not off.use_rollout_log_probs else None)
    ref = None
    if state.reference is not None:
        ref = _forward_all(state, state.reference, batch, lengths, rows, **run)
    elif state.reference_is_base:  # π_ref of a LoRA policy: its own base, adapters off
        with adapters_off(state.policy):
            ref = _forward_all(state, state.policy, batch, lengths, rows, **run)
    values = (_forward_all(state, state.critic, batch, lengths, rows, values=True, **run)
              if state.critic is not None else None)
    return Forwards(own, ref, values, routes, known, replayed)


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
    """π_old, π_ref, values, rewards, advantages, mask and weights of `batch` in one process (see the module
    docstring)."""
    lengths = row_lengths(batch)
    return _finish(state, batch, lengths, _forwards(state, batch, lengths, list(range(batch.num_rows))))


def _finish(state: LearnerState, batch: RolloutBatch, lengths: RowLengths, forwards: Forwards) -> Prepared:
    """Everything after the forwards, from the whole batch: rewards, advantages (whitened over the batch where the
    estimator does), the mask, weights, the adaptive KL coefficient and the metrics."""
    algo, off = state.algorithm, state.config.off_policy
    metrics: dict = {}
    own, known = forwards.own, forwards.known
    if known is not None:
        metrics["rollout_corr/routing_disagreement"] = forwards.replayed.disagreement()
        real = sum(lengths.total(r) for r in range(batch.num_rows))
        metrics["rollout_corr/routed_fraction"] = float(known.sum()) / max(real, 1)  # of the rows' tokens
    logp_old = batch.logp_behaviour if off.use_rollout_log_probs else own
    logp_ref, values_old = forwards.ref, forwards.values
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
                    logp_ref, mask, is_weights, metrics, lengths, forwards.routes)


def prepare_share(state: LearnerState, share: Share, whole: RolloutBatch | None) -> tuple[Prepared, Prepared | None]:
    """A trainer group's `prepare`: this rank's share of the step prepared as one process would prepare the whole
    batch, and on rank 0 (`whole`: the step's batch, which rank 0 alone holds) the whole batch's `Prepared` too
    (its metrics are the step's; other ranks return None and report none).

    Each rank runs the no-grad forwards of the rows dealt it in the first epoch (every row once in the group);
    rank 0 gathers them, computes what the whole batch decides (advantages whitened over the batch, masks such as
    M2PO's, the adaptive KL coefficient, the metrics) and scatters each rank the rows of its share. The route grid
    stays where the forwards recorded it when every rank trains only its forwarded rows (one epoch); else its rows
    travel the same way."""
    rank, size = world(state)
    deal, batch = share.deal, share.batch
    lengths = row_lengths(batch)
    forwarded = [deal.rows(deal.forwarded(r)) for r in range(size)]
    mine = share.positions(forwarded[rank])
    forwards = _forwards(state, batch, lengths, mine, in_step=True)
    if forwards.known is not None:  # the replay's counts over the group
        seen = group_reduced(state, torch.tensor([float(forwards.replayed.differed), float(forwards.replayed.tokens)],
                                                 dtype=torch.float64))
        forwards.replayed = Replayed(int(seen[0]), int(seen[1]))
    device = state.device
    stacked = forwards.stacked()
    gathered = (gather_rows(state.group, stacked[mine], [len(f) for f in forwarded], device)
                if stacked is not None else None)
    trained = [deal.held(r) for r in range(size)]
    counts = [len(t) for t in trained]
    prepared, parts = None, None
    fields = _shared_fields(state)
    if rank == 0:
        full = _placed(gathered, forwarded, whole.num_rows) if gathered is not None else None
        prepared = _finish(state, whole, row_lengths(whole), dataclasses.replace(
            forwards.unstacked(full), routes=None, known=whole.routed if forwards.known is not None else None))
        parts = _dealt(_field_table(prepared, fields), trained)
    like = torch.zeros(1, len(fields), batch.response_mask.shape[1], device=batch.tokens.device)
    values = dict(zip(fields, scatter_rows(state.group, parts, counts, like, device).unbind(1)))
    routes = forwards.routes
    if routes is not None and not deal.stationary:
        routes = _moved_routes(state, share, forwards.routes, forwarded, trained)
    prep = Prepared(batch, values["logp_old"], values["advantages"], values.get("returns"), values.get("values_old"),
                    values.get("logp_ref"), values["mask"].bool(), values.get("is_weights"),
                    prepared.metrics if prepared is not None else {}, lengths, routes)
    return prep, prepared


def _placed(gathered: Tensor, forwarded: list[list[int]], num_rows: int) -> Tensor:
    """Rows gathered in rank order (rank r's step rows `forwarded[r]`) at their places in a [num_rows, ...] tensor
    (rows none ran: zeros)."""
    order = torch.tensor([r for rows in forwarded for r in rows], dtype=torch.long, device=gathered.device)
    full = torch.zeros(num_rows, *gathered.shape[1:], dtype=gathered.dtype, device=gathered.device)
    full[order] = gathered
    return full


def _dealt(full: Tensor, trained: list[list[int]]) -> list[Tensor]:
    """Each rank's rows of a whole-batch tensor."""
    return [full[torch.tensor(rows, dtype=torch.long, device=full.device)] for rows in trained]


def _shared_fields(state: LearnerState) -> list[str]:
    """The per-token fields of `Prepared` an update reads (the same list on every rank: it follows the config)."""
    fields = ["logp_old", "advantages", "mask"]
    if state.config.off_policy.is_level != "none":
        fields.append("is_weights")
    if state.reference is not None or state.reference_is_base:
        fields.append("logp_ref")
    if state.critic is not None:
        fields += ["values_old", "returns"]
    return fields


def _field_table(prep: Prepared, fields: list[str]) -> Tensor:
    """`prep`'s `fields` as one fp32 [N, K, T] table (the mask as 0/1; no importance weights: ones)."""
    columns = []
    for name in fields:
        value = getattr(prep, name)
        columns.append(torch.ones_like(prep.logp_old) if value is None else value.float())
    return torch.stack(columns, 1)


def _moved_routes(state: LearnerState, share: Share, routes: Tensor, forwarded: list[list[int]],
                  trained: list[list[int]]) -> Tensor:
    """The route grid of the share's rows, from the ranks whose forwards recorded them (through rank 0)."""
    rank, width = world(state)[0], share.batch.tokens.shape[1]
    grid = routes.view(share.batch.num_rows, width, *routes.shape[1:])
    index = torch.tensor(share.positions(forwarded[rank]), dtype=torch.long, device=grid.device)
    gathered = gather_rows(state.group, grid[index], [len(f) for f in forwarded], state.device)
    parts = _dealt(_placed(gathered, forwarded, sum(share.deal.group_rows)), trained) if rank == 0 else None
    out = scatter_rows(state.group, parts, [len(t) for t in trained], grid[:1], state.device)
    return out.flatten(0, 1)


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
