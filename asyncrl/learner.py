"""The learner: one training step `(state, groups) -> (state, metrics)`.

    state = build_learner(policy, TrainerConfig(...), GRPO(...), reference=ref_model)
    state, metrics = train_step(state, groups)       # groups: list[Group] streamed from the agents

A step, for a batch of groups (every number comes from `asyncrl.algos`):
  1. collate groups into `[N, T]` response tensors (rewards shaped by DAPO's overlong penalty if asked);
  2. π_old: the behaviour log-probs (`use_rollout_log_probs`) or proximal log-probs recomputed now;
     π_ref log-probs if a KL is used; critic values if the algorithm has a critic;
  3. per-token rewards (outcome at the last token, minus β·KL if KL-in-reward), advantages;
  4. the loss mask: response mask ∧ version-lag cap ∧ rejection; truncated IS weights;
  5. `ppo_epochs` × mini-batches of `mini_batch_size` groups, each accumulated over micro-batches formed
     by token budget, normalised by the mini-batch's global token/row counts so accumulation is exact;
     gradient clipping, a skipped update (counted) on a non-finite gradient, AdamW + schedule;
  6. the critic's update on the GAE returns, concurrently with the actor's when configured (split placement).

Batches are `asyncrl.rollout_batch`, the response forwards `asyncrl.response_forward`, FSDP2
`asyncrl.sharding`; their public names are re-exported here.

Distributed: with `torch.distributed` initialised and the models sharded by `shard_model` (FSDP2), each
rank takes every world-th group of a mini-batch, counts are all-reduced, and ranks run equal numbers of
micro-batches (padding with zero-weight ones) so collectives line up.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import Tensor, nn

from asyncrl import algos
from asyncrl.algos._checks import value_checks
from asyncrl.config import AlgorithmConfig, OffPolicyConfig, TrainerConfig
from asyncrl.policies.model import use_fused_kernels
from asyncrl.policies.value import ValueModel
from asyncrl.response_forward import chunked_logprobs, response_logprobs, response_values
from asyncrl.rollout_batch import RolloutBatch, collate, filter_groups, micro_batches
from asyncrl.sharding import full_weights, grad_norm_, shard_model
from asyncrl.types import Group

__all__ = [
    "RolloutBatch", "collate", "filter_groups", "LearnerState", "build_learner", "train_step", "shard_model",
    "full_weights", "make_scheduler", "response_logprobs", "chunked_logprobs", "micro_batches", "policy_gradients",
    "grad_norm_", "memory_metrics",
]


# -------------------------------------------------------------------------------------------- state
@dataclasses.dataclass
class LearnerState:
    """Everything a training step reads and updates (mutated in place and returned)."""

    policy: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    config: TrainerConfig
    algorithm: AlgorithmConfig
    reference: nn.Module | None = None
    critic: nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    step: int = 0  # training steps taken (each = one batch of groups)
    optimizer_steps: int = 0
    version: int = 0  # weight version published to the agents
    kl_coef: float = 0.0  # current β of KL-in-reward (adaptive controller state)
    skipped_updates: int = 0
    critic_skipped_updates: int = 0
    group: dist.ProcessGroup | None = None  # the trainer group (FSDP2), None = one process

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device


def make_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak lr, then constant or cosine down to `min_lr_ratio`."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress = min((step - cfg.warmup_steps) / max(cfg.total_steps - cfg.warmup_steps, 1), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _adamw(params, lr: float, cfg) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def build_learner(policy: nn.Module, config: TrainerConfig, algorithm: AlgorithmConfig, *,
                  reference: nn.Module | None = None, critic: nn.Module | None = None,
                  group: dist.ProcessGroup | None = None) -> LearnerState:
    """Validate the configs, set up optimizers and schedules. Pass a frozen `reference` when the algorithm
    uses a KL, and a critic (`ValueModel.from_policy(policy)` by default) when it needs one."""
    config.validate()
    algorithm.validate()
    if algorithm.needs_reference and reference is None:
        raise ValueError(f"{type(algorithm).__name__}: kl_loss_coef / kl_in_reward_coef > 0 need a reference model; "
                         "pass reference= (a frozen copy of the initial policy)")
    if algorithm.needs_critic and critic is None:
        critic = ValueModel.from_policy(policy)
        if algorithm.critic.device is not None:
            critic = critic.to(algorithm.critic.device)
        mesh = getattr(next(policy.parameters()), "device_mesh", None)
        if mesh is not None:  # a sharded policy gets a critic sharded alike (unsharded, the ranks' copies drift)
            shard_model(critic, mesh)
    policy.train()
    policy.gradient_checkpointing = config.gradient_checkpointing
    device = next(policy.parameters()).device
    if config.fused_kernels and device.type == "cuda":
        use_fused_kernels(True, device, torch.bfloat16 if config.autocast_bf16 else next(policy.parameters()).dtype,
                          model=policy)
    optimizer = _adamw(policy.parameters(), config.optim.lr, config.optim)
    state = LearnerState(policy, optimizer, make_scheduler(optimizer, config.optim), config, algorithm,
                         reference=reference, critic=critic, kl_coef=algorithm.kl_in_reward_coef, group=group)
    if reference is not None:
        reference.eval().requires_grad_(False)
    if critic is not None:
        critic.train()
        critic.gradient_checkpointing = config.gradient_checkpointing
        state.critic_optimizer = _adamw(critic.parameters(), algorithm.critic.lr, config.optim)
        state.critic_scheduler = make_scheduler(state.critic_optimizer, config.optim)
    return state


# ------------------------------------------------------------------------------------ preparation
@dataclasses.dataclass
class _Prepared:
    batch: RolloutBatch
    logp_old: Tensor  # [N, T]
    advantages: Tensor  # [N, T]
    returns: Tensor | None  # [N, T] critic targets
    values_old: Tensor | None  # [N, T]
    logp_ref: Tensor | None  # [N, T]
    mask: Tensor  # [N, T] loss mask
    is_weights: Tensor | None  # [N, T]
    metrics: dict
    lengths: list[int] = dataclasses.field(default_factory=list)  # prompt + response per row, on the host


@torch.no_grad()
def _forward_all(state: LearnerState, model: nn.Module, batch: RolloutBatch, values: bool = False) -> Tensor:
    """No-grad log-probs (or values) of every row, micro-batched like training, on the model's own device
    (a reference or critic may live elsewhere); returned on the batch's device."""
    home = batch.tokens.device
    batch = batch.to(next(model.parameters()).device)
    lengths = (batch.prompt_lens + batch.response_lens).tolist()
    out = torch.zeros_like(batch.logp_behaviour)
    was_training = model.training
    model.eval()
    try:
        for rows in micro_batches(list(range(batch.num_rows)), lengths, state.config):
            idx = torch.tensor(rows, device=batch.tokens.device)
            autocast = state.config.autocast_bf16
            if values:
                out[idx] = response_values(model, batch, idx, autocast=autocast).to(out.dtype)
            else:
                out[idx] = response_logprobs(model, batch, idx, temperature=state.config.sampling_temperature,
                                             autocast=autocast,
                                             chunk_tokens=state.config.logits_chunk_tokens)[0].to(out.dtype)
    finally:
        model.train(was_training)
    return out.to(home)


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
    return mask, metrics


def _prepare(state: LearnerState, batch: RolloutBatch) -> _Prepared:
    algo, off = state.algorithm, state.config.off_policy
    metrics: dict = {}
    logp_old = batch.logp_behaviour if off.use_rollout_log_probs else _forward_all(state, state.policy, batch)
    logp_ref = _forward_all(state, state.reference, batch) if state.reference is not None else None
    values_old = _forward_all(state, state.critic, batch, values=True) if state.critic is not None else None
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
    metrics.update(mask_metrics)
    is_weights = None
    if off.is_level != "none" and bool(mask.any()):
        fn = algos.token_tis_weights if off.is_level == "token" else algos.sequence_tis_weights
        w = fn(logp_old, batch.logp_behaviour, mask, threshold=off.is_threshold)
        is_weights = w.weights
        metrics.update({"rollout_corr/is_weight_mean": float(w.mean), "rollout_corr/is_truncated_fraction":
                        float(w.truncated_fraction), "rollout_corr/ess": float(w.ess)})
    if not off.use_rollout_log_probs:
        metrics["rollout_corr/mismatch_kl"] = float(algos.masked_mean(batch.logp_behaviour - logp_old, mask))
    lengths = (batch.prompt_lens + batch.response_lens).tolist()
    return _Prepared(batch, logp_old, adv.advantages, adv.returns if values_old is not None else None, values_old,
                     logp_ref, mask, is_weights, metrics, lengths)


# -------------------------------------------------------------------------------------- distribution
def _world(state: LearnerState) -> tuple[int, int]:
    if state.group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(state.group), dist.get_world_size(state.group)


def _group(state: LearnerState):
    """The trainer group when there is more than one rank, else None."""
    return state.group if _world(state)[1] > 1 else None


def _all_reduce(state: LearnerState, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
    if _world(state)[1] == 1:
        return values
    # a NCCL group reduces only accelerator tensors; gloo takes host ones
    device = state.device if dist.get_backend(state.group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=state.group)
    return t.tolist()


def _minibatches(state: LearnerState, num_groups: int, epoch: int) -> list[list[int]]:
    """Group indices per mini-batch for one epoch (shuffled with a seed derived from the step)."""
    order = list(range(num_groups))
    if state.config.shuffle:
        gen = torch.Generator().manual_seed(state.config.seed * 1_000_003 + state.step * 1009 + epoch)
        order = torch.randperm(num_groups, generator=gen).tolist()
    size = state.config.mini_batch_size
    return [order[i:i + size] for i in range(0, num_groups, size)]


# --------------------------------------------------------------------------------------- the updates
def _optimizer_step(model: nn.Module, optimizer, scheduler, clip: float, group=None) -> tuple[float, bool]:
    """Clip, then step unless the gradient norm is non-finite (then zero the gradients and skip)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0, True
    norm = float(grad_norm_(params, clip, group))
    ok = math.isfinite(norm)
    if ok:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, ok


def _rows_of(prep: _Prepared, groups: list[int]) -> list[int]:
    gi = prep.batch.group_index.tolist()
    chosen = set(groups)
    return [r for r in range(prep.batch.num_rows) if gi[r] in chosen]


def _local_micro_batches(state: LearnerState, prep: _Prepared, groups: list[int]) -> tuple[list[list[int]], list[int]]:
    """This rank's share of a mini-batch (every world-th group) as micro-batches, padded with empty ones so
    every rank runs the same number (FSDP2 collectives must line up)."""
    rank, world = _world(state)
    rows = _rows_of(prep, groups[rank::world])
    micros = micro_batches(rows, prep.lengths, state.config)
    count = int(_all_reduce(state, [len(micros)], dist.ReduceOp.MAX)[0])
    return micros + [[]] * (count - len(micros)), rows


def _denominators(state: LearnerState, prep: _Prepared, rows: list[int]) -> tuple[float, float, float]:
    """Global valid-token and row counts of the mini-batch, and the length normaliser."""
    idx = torch.tensor(rows, dtype=torch.long, device=prep.mask.device)
    mask = prep.mask[idx] if rows else prep.mask[:0]
    tokens, nonempty, all_rows = _all_reduce(state, [float(mask.sum()), float(mask.any(-1).sum()), float(len(rows))])
    seqs = all_rows if state.algorithm.loss_agg_mode == "seq-mean-token-sum-norm" else nonempty
    length = state.config.max_response_length or prep.batch.response_mask.shape[1]
    return max(tokens, 1.0), max(seqs, 1.0), float(length)


def _actor_micro(state: LearnerState, prep: _Prepared, rows: list[int], counts) -> dict:
    """Forward/backward of one micro-batch; returns detached statistics."""
    cfg, algo = state.config, state.algorithm
    world = _world(state)[1]
    empty = not rows
    idx = torch.tensor(rows or [0], device=prep.mask.device)
    need_entropy = algo.entropy_coef > 0
    width = max(prep.lengths[r] for r in rows) if rows else None
    logp, ent = response_logprobs(state.policy, prep.batch, idx, temperature=cfg.sampling_temperature, entropy=True,
                                  autocast=cfg.autocast_bf16, entropy_grad=need_entropy, width=width,
                                  chunk_tokens=cfg.logits_chunk_tokens)
    mask = prep.mask[idx] & (not empty)
    tokens, seqs, length = counts
    loss_fn_args = dict(num_tokens=tokens, num_seqs=seqs, norm_length=length)
    weights = prep.is_weights[idx] if prep.is_weights is not None else None
    pg = algo.policy_loss(logp, prep.logp_old[idx], prep.advantages[idx], mask, is_weights=weights, **loss_fn_args)
    loss = pg.loss
    agg = dict(mode=algo.loss_agg_mode, num_tokens=tokens, num_seqs=seqs, norm_length=length)
    entropy = algos.agg_loss(ent if need_entropy else ent.detach(), mask, **agg)
    if need_entropy:
        loss = loss - algo.entropy_coef * entropy
    kl_loss = torch.zeros((), device=logp.device)
    if algo.kl_loss_coef > 0:
        kl_loss = algos.agg_loss(algo.kl_estimator()(logp, prep.logp_ref[idx]), mask, **agg)
        loss = loss + algo.kl_loss_coef * kl_loss
    (loss * world).backward()  # FSDP2 averages gradients over ranks; counts are already global
    # tensors, read back once per mini-batch by the caller (no sync per micro-batch)
    return {"pg_loss": pg.loss.detach() * world, "pg_clipfrac": pg.clipfrac, "ppo_kl": pg.ppo_kl,
            "pg_clipfrac_lower": pg.clipfrac_lower, "entropy": entropy.detach() * world,
            "kl_loss": kl_loss.detach() * world, "tokens": mask.sum()}


def _accumulate(state: LearnerState, prep: _Prepared, groups: list[int], sums: dict[str, float]) -> None:
    """Forward/backward every micro-batch of one mini-batch (gradients add up in .grad). Value checks are
    off here (no device syncs mid-backward): a non-finite value surfaces as a skipped update instead."""
    micros, rows = _local_micro_batches(state, prep, groups)
    counts = _denominators(state, prep, rows)
    for micro in micros:
        with value_checks(False):
            stats = _actor_micro(state, prep, micro, counts)
        weight = stats.pop("tokens").to(torch.float32)
        for k in ("pg_loss", "entropy", "kl_loss"):  # summed on the device, read back once per step
            sums[k] = sums.get(k, 0.0) + stats[k].float()  # already normalised by the mini-batch count
        for k in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
            sums[k] = sums.get(k, 0.0) + stats[k].float() * weight
        sums["_tokens"] = sums.get("_tokens", 0.0) + weight


def policy_gradients(state: LearnerState, groups: list[Group] | RolloutBatch) -> dict[str, Tensor]:
    """The accumulated policy gradient of the whole batch as one mini-batch, without an optimizer step
    (for checking that micro-batching, token budgets and sharding leave the gradient unchanged)."""
    prep = _prepare(state, _as_batch(state, groups))
    state.optimizer.zero_grad(set_to_none=True)
    _accumulate(state, prep, list(range(len(prep.batch.prompt_ids))), {})
    grads = {}
    for name, p in state.policy.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone()
    state.optimizer.zero_grad(set_to_none=True)
    return grads


def _actor_update(state: LearnerState, prep: _Prepared) -> dict:
    cfg = state.config
    sums: dict[str, float] = {}
    grad_norms, updates = [], 0
    num_groups = len(prep.batch.prompt_ids)
    for epoch in range(cfg.ppo_epochs):
        for groups in _minibatches(state, num_groups, epoch):
            _accumulate(state, prep, groups, sums)
            norm, ok = _optimizer_step(state.policy, state.optimizer, state.scheduler, cfg.optim.grad_clip,
                                       _group(state))
            grad_norms.append(norm)
            updates += 1
            state.optimizer_steps += 1
            state.skipped_updates += 0 if ok else 1
    sums = {k: float(v) for k, v in sums.items()}
    tokens = max(sums.pop("_tokens", 0.0), 1.0)
    out = {f"actor/{k}": v / updates for k, v in sums.items() if k in ("pg_loss", "entropy", "kl_loss")}
    out.update({f"actor/{k}": v / tokens for k, v in sums.items() if k not in ("pg_loss", "entropy", "kl_loss")})
    finite = [g for g in grad_norms if math.isfinite(g)]  # skipped updates have no norm to average
    out["actor/grad_norm"] = sum(finite) / max(len(finite), 1)
    out["actor/lr"] = state.scheduler.get_last_lr()[0]
    out["actor/skipped_updates"] = state.skipped_updates
    return out


def _critic_update(state: LearnerState, prep: _Prepared) -> dict:
    cfg, critic_cfg = state.config, state.algorithm.critic
    device = next(state.critic.parameters()).device
    batch = prep.batch.to(device)
    returns, values_old, mask = prep.returns.to(device), prep.values_old.to(device), prep.mask.to(device)
    losses, clipfracs, norms, updates = [], [], [], 0
    for epoch in range(cfg.ppo_epochs):
        for groups in _minibatches(state, len(batch.prompt_ids), epoch):
            micros, rows = _local_micro_batches(state, prep, groups)
            tokens, seqs, length = _denominators(state, prep, rows)
            for micro in micros:
                idx = torch.tensor(micro or [0], device=device)
                values = response_values(state.critic, batch, idx, autocast=cfg.autocast_bf16)
                vl = algos.value_loss(values, values_old[idx], returns[idx], mask[idx] & bool(micro),
                                      clip_range=critic_cfg.value_clip, loss_agg_mode=state.algorithm.loss_agg_mode,
                                      num_tokens=tokens, num_seqs=seqs, norm_length=length)
                (vl.loss * _world(state)[1]).backward()
                losses.append(float(vl.loss.detach()) * _world(state)[1])
                clipfracs.append(float(vl.clipfrac))
            norm, ok = _optimizer_step(state.critic, state.critic_optimizer, state.critic_scheduler,
                                       cfg.optim.grad_clip, _group(state))
            updates += 1
            if ok:
                norms.append(norm)
            else:
                state.critic_skipped_updates += 1
    # micro-batch losses are normalised by their mini-batch's counts: their sum is one update's loss
    return {"critic/vf_loss": sum(losses) / max(updates, 1), "critic/vf_clipfrac": sum(clipfracs) / max(len(clipfracs), 1),
            "critic/grad_norm": sum(norms) / max(len(norms), 1), "critic/skipped_updates": state.critic_skipped_updates}


_CRITIC_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic")


def _as_batch(state: LearnerState, groups: list[Group] | RolloutBatch) -> RolloutBatch:
    cfg, algo = state.config, state.algorithm
    batch = groups if isinstance(groups, RolloutBatch) else collate(
        groups, max_response_length=cfg.max_response_length,
        overlong_buffer_len=algo.overlong_buffer(cfg.max_response_length),
        overlong_penalty_factor=algo.overlong_penalty_factor)
    return batch.to(state.device)


def train_step(state: LearnerState, groups: list[Group] | RolloutBatch) -> tuple[LearnerState, dict]:
    """One training step on a batch of groups. Returns the (mutated) state and verl-named metrics."""
    start = time.perf_counter()
    algo = state.algorithm
    prep = _prepare(state, _as_batch(state, groups))
    critic_future: Future | None = None
    metrics = dict(prep.metrics)
    if state.critic is not None:
        # concurrent = the critic's update in a worker thread (split placement on its own device); in a
        # multi-process trainer group both updates use the group's collectives, so they take turns
        concurrent = algo.critic.concurrent and _world(state)[1] == 1
        critic_future = _CRITIC_POOL.submit(_critic_update, state, prep) if concurrent else None
        if not concurrent:
            metrics.update(_critic_update(state, prep))
    if state.critic is None or state.step >= algo.critic.warmup_steps:
        metrics.update(_actor_update(state, prep))
    if critic_future is not None:
        metrics.update(critic_future.result())
    state.step += 1
    metrics.update(_batch_metrics(prep, time.perf_counter() - start, state))
    return state, metrics


def _batch_metrics(prep: _Prepared, seconds: float, state: LearnerState) -> dict:
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
        "timing_s/update_actor": seconds,
        "training/global_step": state.step,
        "training/num_groups": len(batch.prompt_ids),
        "perf/total_num_tokens": int((batch.prompt_lens + batch.response_lens).sum()),
        "rollout/nonfinite_logprob_tokens": batch.nonfinite_logprobs,
        **memory_metrics(state.device),
    }


def memory_metrics(device: torch.device, prefix: str = "perf") -> dict:
    """Peak accelerator memory of this process since it started (verl's names), empty off CUDA."""
    if device.type != "cuda":
        return {}
    return {f"{prefix}/max_memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            f"{prefix}/max_memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
