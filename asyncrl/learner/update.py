"""The updates: `ppo_epochs` × mini-batches of `mini_batch_size` groups, each accumulated over micro-batches
and normalised by the mini-batch's global token/row counts (so accumulation is exact), then gradient
clipping and an optimizer step, skipped (and counted) on a non-finite gradient. One loop serves the actor
and the critic; they differ only in the loss of a micro-batch.

Distributed (FSDP2 over the trainer group): each rank takes the groups of a mini-batch that the step's deal
(`asyncrl.learner.share.Deal`: `balance_groups`, token counts even over the ranks) gives it, counts are
all-reduced, and ranks run equal numbers of micro-batches (padding with zero-weight ones) so collectives line up.
Statistics stay on the device and are read back once per update, so nothing in the micro-batch loop waits for the
device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncrl import algos
from asyncrl.algos._checks import value_checks
from asyncrl.learner.forward import micro_logprobs, micro_values
from asyncrl.learner.layout import MicroBatch, plan_micro_batches, split_rows
from asyncrl.learner.routes import micro_routes, real_tokens
from asyncrl.learner.prepare import Prepared
from asyncrl.learner.share import Deal
from asyncrl.learner.sharding import compute_device, grad_norm_
from asyncrl.learner.state import LearnerState, group_reduced, world
from asyncrl.runtime.kill_points import kill_point

__all__ = ["Counts", "MicroStats", "Totals", "UpdateResult", "run_updates", "actor_loss", "critic_loss", "accumulate",
           "ess_lr_scale", "world"]


@dataclasses.dataclass(frozen=True)
class Counts:
    """A mini-batch's global normalisers: valid tokens, rows, and the seq-mean-token-sum-norm length."""

    tokens: float
    seqs: float
    length: float

    def loss_kwargs(self) -> dict:
        return dict(num_tokens=self.tokens, num_seqs=self.seqs, norm_length=self.length)


@dataclasses.dataclass
class MicroStats:
    """A micro-batch's detached statistics: `sums` add up over an update as they are (losses already
    normalised by the mini-batch's counts); `means` are averaged over tokens, weighted by `tokens`."""

    sums: dict[str, Tensor]
    means: dict[str, Tensor]
    tokens: Tensor


@dataclasses.dataclass
class UpdateResult:
    sums: dict[str, float]  # summed over all micro-batches of all updates
    means: dict[str, float]  # token-weighted means over all micro-batches
    grad_norms: list[float]  # per update; non-finite for a skipped one
    updates: int

    @property
    def skipped(self) -> int:
        return sum(not math.isfinite(g) for g in self.grad_norms)

    @property
    def mean_grad_norm(self) -> float:
        finite = [g for g in self.grad_norms if math.isfinite(g)]  # skipped updates have no norm to average
        return sum(finite) / max(len(finite), 1)


MicroLoss = Callable[[LearnerState, Prepared, MicroBatch, Counts], MicroStats]


# -------------------------------------------------------------------------------------- distribution
def _all_reduce(state: LearnerState, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    if world(state)[1] == 1:
        return values
    return group_reduced(state, torch.tensor(values, dtype=torch.float64), op).tolist()


def _local_rows(prep: Prepared, groups: list[int]) -> list[int]:
    """This rank's rows of a mini-batch: those of `groups`, the mini-batch's groups dealt this rank (`Deal`)."""
    chosen = set(groups)
    return [r for r, g in enumerate(prep.batch.group_index.tolist()) if g in chosen]


def _plan(state: LearnerState, prep: Prepared, rows: list[int], device: torch.device) -> list[MicroBatch]:
    """This rank's micro-batches, padded with empty ones so every rank runs the same number (FSDP2
    collectives must line up)."""
    micros = split_rows(rows, prep.totals(), state.config)
    count = int(_all_reduce(state, [len(micros)], dist.ReduceOp.MAX)[0])
    micros = micros + [[]] * (count - len(micros))
    return plan_micro_batches(prep.batch.tokens.to(device), micros, prep.lengths, packed=state.config.pack_sequences,
                              bucketed=state.config.cuda_graphs)


def _counts(state: LearnerState, prep: Prepared, rows: list[int]) -> Counts:
    """Global valid-token and row counts of the mini-batch, and the length normaliser."""
    idx = torch.tensor(rows, dtype=torch.long, device=prep.mask.device)
    mask = prep.mask[idx] if rows else prep.mask[:0]
    tokens, nonempty, all_rows = _all_reduce(state, [float(mask.sum()), float(mask.any(-1).sum()), float(len(rows))])
    seqs = all_rows if state.algorithm.loss_agg_mode == "seq-mean-token-sum-norm" else nonempty
    length = state.config.max_response_length or prep.batch.response_mask.shape[1]
    return Counts(max(tokens, 1.0), max(seqs, 1.0), float(length))


# -------------------------------------------------------------------------------------- the losses
def actor_loss(state: LearnerState, prep: Prepared, micro: MicroBatch, counts: Counts) -> MicroStats:
    """Policy loss (− entropy bonus + KL loss) of one micro-batch; backward; detached statistics. With routes
    (`--trainer.routing-replay r2`) the routers pick the recorded experts, and `routing_disagreement` is the
    share of (token, router) pairs whose own choice differed. A MoE policy's routers are tapped: their load
    (`asyncrl.algos.moe`) is reported, and with `--trainer.router-aux-loss-coef` its auxiliary loss trains."""
    if state.moe is None:
        return _actor_loss(state, prep, micro, counts)
    counted = real_tokens(micro, prep.lengths)
    with contextlib.ExitStack() as stack:  # the forward and its backward's recompute
        replayed = (stack.enter_context(state.moe.replaying(micro_routes(prep.routes, micro), counted))
                    if prep.routes is not None else None)
        tapped = stack.enter_context(state.moe.tapping())
        stats = _actor_loss(state, prep, micro, counts, lambda: _router_terms(tapped, counted))
    if replayed is not None:
        stats.means["routing_disagreement"] = replayed.share().to(stats.tokens.device)
    return stats


def _router_terms(tapped: dict, counted: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The routers' mean auxiliary loss and their load statistics (over the tapped routers, in forward order).
    A model that runs a packed micro-batch as padded rows of its own (its packing probe failed) shows its routers
    other tokens than the micro-batch's: there every token they saw counts, its padding too."""
    terms = [algos.load_balancing(logits, indices, counted if counted.shape[0] == logits.shape[0] else None)
             for logits, indices in tapped.values()]
    loads = torch.stack([t.load for t in terms]).detach()
    aux = torch.stack([t.loss for t in terms]).mean()
    return aux, {"moe/expert_load_max": loads.max(), "moe/expert_load_mean": loads.mean(),
                 "moe/aux_loss": aux.detach()}


def _actor_loss(state: LearnerState, prep: Prepared, micro: MicroBatch, counts: Counts,
                router_terms=None) -> MicroStats:
    cfg, algo = state.config, state.algorithm
    size = world(state)[1]
    idx = micro.rows
    logp, ent = micro_logprobs(state.policy, micro, prep.mask.shape[1], temperature=cfg.sampling_temperature,
                               autocast=cfg.autocast_bf16, chunk_tokens=cfg.logits_chunk_tokens)
    mask = prep.mask[idx] & (not micro.empty)
    pg_mask, opsm = mask, None
    if cfg.off_policy.opsm_threshold is not None:  # stale negative sequences the policy has moved away from: no loss
        opsm = algos.off_policy_sequence_mask(logp, prep.batch.logp_behaviour[idx], prep.advantages[idx], mask,
                                              threshold=cfg.off_policy.opsm_threshold)
        pg_mask = opsm.mask
    weights = prep.is_weights[idx] if prep.is_weights is not None else None
    pg = algo.policy_loss(logp, prep.logp_old[idx], prep.advantages[idx], pg_mask, is_weights=weights,
                          **counts.loss_kwargs())
    agg = dict(mode=algo.loss_agg_mode, **counts.loss_kwargs())
    entropy = algos.agg_loss(ent if algo.entropy_coef > 0 else ent.detach(), mask, **agg)
    loss = pg.loss - algo.entropy_coef * entropy if algo.entropy_coef > 0 else pg.loss
    kl_loss = torch.zeros((), device=logp.device)
    if algo.kl_loss_coef > 0:
        kl_loss = algos.agg_loss(algo.kl_estimator()(logp, prep.logp_ref[idx]), mask, **agg)
        loss = loss + algo.kl_loss_coef * kl_loss
    behaviour_kl = algos.agg_loss(algos.kl_k3(logp, prep.batch.logp_behaviour[idx]), mask, **agg)
    drift = algos.behaviour_drift(logp, prep.batch.logp_behaviour[idx], mask)
    if cfg.off_policy.behaviour_kl_coef > 0:
        loss = loss + cfg.off_policy.behaviour_kl_coef * behaviour_kl
    moe: dict[str, Tensor] = {}
    if router_terms is not None:
        aux, moe = router_terms()
        if cfg.router_aux_loss_coef > 0:  # weighted by this micro-batch's share of the mini-batch's tokens
            loss = loss + cfg.router_aux_loss_coef * aux * (mask.sum() / counts.tokens)
    kill_point("backward", world(state)[0], state.version)
    (loss * size).backward()  # FSDP2 averages gradients over ranks; counts are already global
    return MicroStats(sums={"pg_loss": pg.loss.detach() * size, "entropy": entropy.detach() * size,
                            "kl_loss": kl_loss.detach() * size, "behaviour_kl": behaviour_kl.detach() * size},
                      means={"pg_clipfrac": pg.clipfrac, "ppo_kl": pg.ppo_kl, "pg_clipfrac_lower": pg.clipfrac_lower,
                             "behaviour_k1": drift.k1, "behaviour_ratio": drift.ratio,
                             "behaviour_ratio_sq": drift.ratio_sq, **moe,
                             **({"opsm_masked_fraction": opsm.masked_fraction} if opsm is not None else {})},
                      tokens=mask.sum())


def critic_loss(state: LearnerState, prep: Prepared, micro: MicroBatch, counts: Counts) -> MicroStats:
    """Clipped value loss of one micro-batch on the critic's device; backward; detached statistics."""
    device = micro.tokens.device
    idx = micro.rows
    values = micro_values(state.critic, micro, prep.mask.shape[1], autocast=state.config.autocast_bf16)
    mask = prep.mask.to(device)[idx] & (not micro.empty)
    vl = algos.value_loss(values, prep.values_old.to(device)[idx], prep.returns.to(device)[idx], mask,
                          clip_range=state.algorithm.critic.value_clip, loss_agg_mode=state.algorithm.loss_agg_mode,
                          **counts.loss_kwargs())
    size = world(state)[1]
    (vl.loss * size).backward()
    return MicroStats(sums={"vf_loss": vl.loss.detach() * size}, means={"vf_clipfrac": vl.clipfrac}, tokens=mask.sum())


# -------------------------------------------------------------------------------------- the loop
def _optimizer_step(model: nn.Module, optimizer, scheduler, clip: float, group=None, keep_grads: bool = False,
                    lr_scale: float = 1.0, committed: Callable[[], None] | None = None) -> float:
    """Clip, then step unless the gradient norm is non-finite (then zero the gradients and skip). Returns
    the norm (non-finite: skipped). `keep_grads`: zero the gradients in place instead of freeing them (CUDA
    graphs accumulate into stable buffers). `lr_scale`: this step's learning rate is the schedule's times it.
    `committed`: called once every rank has agreed on the norm, before the step (a failover drill's kill point)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = float(grad_norm_(params, clip, group))
    if committed is not None:
        committed()
    if math.isfinite(norm):
        scheduled = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * lr_scale
        try:
            optimizer.step()
        finally:
            for g, lr in zip(optimizer.param_groups, scheduled):
                g["lr"] = lr
        scheduler.step()
    optimizer.zero_grad(set_to_none=not keep_grads)
    return norm


@dataclasses.dataclass
class Totals:
    """Statistics added up on the device over micro-batches (read back once per step)."""

    sums: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    weighted: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # Σ mean × tokens
    tokens: Tensor | float = 0.0

    def add(self, stats: MicroStats) -> None:
        tokens = stats.tokens.float()
        for k, v in stats.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v.float()
        for k, v in stats.means.items():
            self.weighted[k] = self.weighted.get(k, 0.0) + v.float() * tokens
        self.tokens = self.tokens + tokens

    def merge(self, other: "Totals") -> None:
        """Add another's statistics to these."""
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in other.weighted.items():
            self.weighted[k] = self.weighted.get(k, 0.0) + v
        self.tokens = self.tokens + other.tokens


def accumulate(state: LearnerState, prep: Prepared, groups: list[int], loss: MicroLoss, device: torch.device,
               totals: Totals) -> None:
    """Forward/backward every micro-batch of this rank's `groups` of one mini-batch (gradients add up in .grad;
    statistics in `totals`). Value checks are off here (no device syncs mid-backward): a non-finite value surfaces
    as a skipped update instead."""
    rows = _local_rows(prep, groups)
    counts = _counts(state, prep, rows)
    for micro in _plan(state, prep, rows, device):
        kill_point("forward", world(state)[0], state.version)
        with value_checks(False):
            totals.add(loss(state, prep, micro, counts))


def run_updates(state: LearnerState, prep: Prepared, deal: Deal, loss: MicroLoss, model: nn.Module, optimizer,
                scheduler, lr_scale: Callable[[LearnerState, Totals], float] | None = None) -> UpdateResult:
    """`ppo_epochs` passes over the batch's mini-batches (as `deal` deals them), one optimizer step each;
    `lr_scale` (of the update's statistics) scales each step's learning rate."""
    cfg = state.config
    device = compute_device(model)
    group = state.group if world(state)[1] > 1 else None
    totals = Totals()
    grad_norms, scales = [], []
    rank = world(state)[0]
    for update in deal.updates:
        these = Totals()
        accumulate(state, prep, update[rank], loss, device, these)
        scales.append(lr_scale(state, these) if lr_scale is not None else 1.0)
        kill_point("norm", rank, state.version)
        grad_norms.append(_optimizer_step(model, optimizer, scheduler, cfg.optim.grad_clip, group,
                                          keep_grads=cfg.cuda_graphs, lr_scale=scales[-1],
                                          committed=lambda: kill_point("step", rank, state.version)))
        totals.merge(these)
    sums, weighted, tokens = _group_totals(state, totals)
    means = {k: v / max(tokens, 1.0) for k, v in weighted.items()}
    if lr_scale is not None:
        means["lr_scale"] = sum(scales) / len(scales)
    return UpdateResult(sums=sums, means=means, grad_norms=grad_norms, updates=len(grad_norms))


def ess_lr_scale(state: LearnerState, totals: Totals) -> float:
    """--trainer.off-policy.ess-scaled-lr (VCPO, arXiv:2602.17616): an update's learning rate times the normalised
    effective sample size of its token ratios π_θ/μ over the trainer group (`asyncrl.algos.drift`), measured in
    the update's own forwards, before its step: 1 on-policy, smaller the further the policy has drifted from the
    data's sampler. One all-reduce of three numbers per update."""
    tokens = totals.tokens
    ratio, ratio_sq = totals.weighted.get("behaviour_ratio", 0.0), totals.weighted.get("behaviour_ratio_sq", 0.0)
    ratio, ratio_sq, tokens = _all_reduce(state, [float(ratio), float(ratio_sq), float(tokens)])
    if tokens <= 0:
        return 1.0
    return algos.effective_sample_size(ratio / tokens, ratio_sq / tokens)


def _group_totals(state: LearnerState, totals: Totals) -> tuple[dict[str, float], dict[str, float], float]:
    """The step's statistics over the whole trainer group, so every rank reports what one process would: a
    rank's loss sums are world × its share (losses are normalised by the group's global counts), so their
    mean over ranks is the loss; token-weighted means add up with their tokens. One all-reduce of a few
    scalars per step (every rank runs the same loss, so the keys agree)."""
    sum_keys, mean_keys = sorted(totals.sums), sorted(totals.weighted)
    values = ([float(totals.sums[k]) for k in sum_keys] + [float(totals.weighted[k]) for k in mean_keys]
              + [float(totals.tokens)])
    size = world(state)[1]
    values = _all_reduce(state, values)
    sums = {k: v / size for k, v in zip(sum_keys, values)}
    weighted = dict(zip(mean_keys, values[len(sum_keys):]))
    return sums, weighted, values[-1]
