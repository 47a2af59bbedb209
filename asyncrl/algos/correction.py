"""Off-policy correction for stale and mismatched rollouts.

Three policies (decoupled PPO, Hilton et al. arXiv:2110.00641; AReaL arXiv:2505.24298):
  π_behaviour (μ) — the engine that sampled the tokens (its per-token logprobs come with the rollout);
  π_proximal      — the learner's policy at the start of the update (recomputed, or = μ when
                    `use_rollout_log_probs`);
  π_θ             — the policy being optimised.
The full ratio factorises π_θ/μ = (π_proximal/μ)·(π_θ/π_proximal): the first factor (staleness and
engine/trainer mismatch) is corrected here by importance weights or rejection; the second is PPO's ratio.

Shapes: `[B, T]` per token. With λ_t = logp_proximal_t − logp_behaviour_t (clamped to ±20), ρ_t = e^λ_t.
Every weight and mask here is a statistic of the data: detached, 0 / False at masked positions.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from asyncrl.algos._checks import (
    check_choice, check_finite, check_mask, check_nonempty, check_positive, check_seq_tensor, check_token_tensor,
    check_unit_interval,
)
from asyncrl.algos.masked import masked_mean, masked_sum

__all__ = [
    "ISWeightsResult", "token_tis_weights", "sequence_tis_weights", "RejectionResult", "token_rejection_mask",
    "sequence_rejection_mask", "m2po_mask", "decoupled_ppo_weights", "VTraceResult", "vtrace",
]

_CLAMP = 20.0


class ISWeightsResult(NamedTuple):
    weights: Tensor  # [B, T] detached, 0 at masked positions
    mean: Tensor  # mean weight over valid tokens
    max: Tensor
    truncated_fraction: Tensor  # fraction of valid tokens whose raw ratio exceeded the threshold
    ess: Tensor  # normalised effective sample size (Σw)²/(N·Σw²) ∈ (0, 1]
    mismatch_kl: Tensor  # mean(logp_behaviour − logp_proximal): k1 estimate of KL(μ ‖ π_proximal)


class RejectionResult(NamedTuple):
    mask: Tensor  # [B, T] bool: the response mask with rejected tokens removed (never adds a token)
    rejected_fraction: Tensor  # fraction of the originally valid tokens that were rejected


def _log_ratio(fn: str, logp_proximal: Tensor, logp_behaviour: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    check_token_tensor(fn, "logp_proximal", logp_proximal)
    check_token_tensor(fn, "logp_behaviour", logp_behaviour, like=logp_proximal)
    mask = check_mask(fn, "response_mask", response_mask, logp_proximal)
    check_nonempty(fn, "response_mask", mask)
    check_finite(fn, "logp_proximal", logp_proximal, mask)
    check_finite(fn, "logp_behaviour", logp_behaviour, mask)
    zero = torch.zeros((), dtype=logp_proximal.dtype, device=logp_proximal.device)
    log_ratio = torch.where(mask, logp_proximal.detach() - logp_behaviour.detach(), zero)
    return log_ratio, mask  # not clamped: a sequence's sum must see every token's true log-ratio


def _ratio(log_ratio: Tensor) -> Tensor:
    """exp of a log-ratio clamped to ±20 (e^20 ≈ 4.9e8: finite in fp32)."""
    return torch.exp(log_ratio.clamp(-_CLAMP, _CLAMP))


def _weights_result(raw: Tensor, weights: Tensor, threshold: float, log_ratio: Tensor, mask: Tensor) -> ISWeightsResult:
    n = mask.sum().clamp(min=1).to(weights.dtype)
    total = masked_sum(weights, mask)
    return ISWeightsResult(
        weights=weights,
        mean=total / n,
        max=torch.where(mask, weights, torch.zeros_like(weights)).max(),
        truncated_fraction=masked_mean((raw > threshold).to(weights.dtype), mask),
        ess=total.square() / (n * masked_sum(weights.square(), mask)).clamp(min=1e-30),
        mismatch_kl=masked_mean(-log_ratio, mask),
    )


def _check_threshold(fn: str, threshold: float) -> None:
    if not threshold >= 1.0:
        raise ValueError(f"{fn}: threshold C must be >= 1 (weights of agreeing policies are 1), got {threshold}")


def token_tis_weights(logp_proximal: Tensor, logp_behaviour: Tensor, response_mask: Tensor, *,
                      threshold: float = 2.0, batch_normalize: bool = False) -> ISWeightsResult:
    """Token-level truncated importance sampling (TIS; Yao et al., fengyao.notion.site/off-policy-rl).

      w_t = min(ρ_t, C),  ρ_t = exp(clamp(logp_proximal − logp_behaviour, ±20))
    No lower truncation (as verl). `batch_normalize` divides by the mean valid weight afterwards (then
    weights may exceed C). Weights lie in [0, C] and equal 1 where the policies agree.
    """
    fn = "token_tis_weights"
    _check_threshold(fn, threshold)
    log_ratio, mask = _log_ratio(fn, logp_proximal, logp_behaviour, response_mask)
    raw = _ratio(log_ratio)
    weights = torch.where(mask, raw.clamp(max=threshold), torch.zeros_like(raw))
    if batch_normalize:
        mean = masked_mean(weights, mask)
        weights = weights / mean if float(mean) > 1e-8 else weights
    return _weights_result(raw, weights, threshold, log_ratio, mask)


def sequence_tis_weights(logp_proximal: Tensor, logp_behaviour: Tensor, response_mask: Tensor, *,
                         threshold: float = 2.0, batch_normalize: bool = False) -> ISWeightsResult:
    """Sequence-level truncated importance sampling (Seq-TIS).

      w_i = min(exp(clamp(Σ_t m·λ_t, ±20)), C), the same weight on every valid token of row i.
    The sum is taken before the clamp (as verl): tokens at −40 and +25 give e^−15, not 1 or C.
    `batch_normalize` divides by the mean weight over non-empty rows.
    """
    fn = "sequence_tis_weights"
    _check_threshold(fn, threshold)
    log_ratio, mask = _log_ratio(fn, logp_proximal, logp_behaviour, response_mask)
    seq_raw = _ratio(log_ratio.sum(dim=-1))  # [B]
    seq_w = seq_raw.clamp(max=threshold)
    if batch_normalize:
        nonempty = mask.any(dim=-1)
        mean = seq_w[nonempty].mean() if bool(nonempty.any()) else seq_w.new_ones(())
        seq_w = seq_w / mean if float(mean) > 1e-8 else seq_w
    raw = torch.where(mask, seq_raw[:, None].expand_as(mask), torch.zeros_like(log_ratio))
    weights = torch.where(mask, seq_w[:, None].expand_as(mask), torch.zeros_like(log_ratio))
    return _weights_result(raw, weights, threshold, log_ratio, mask)


RejectStat = Literal["k1", "k2", "k3"]


def _token_stat(log_ratio: Tensor, stat: str) -> Tensor:
    if stat == "k2":
        return 0.5 * log_ratio.square()
    if stat == "k3":
        clamped = log_ratio.clamp(-_CLAMP, _CLAMP)  # keeps e^λ finite
        return torch.expm1(clamped) - clamped  # ρ − 1 − λ without cancellation near λ = 0
    return log_ratio


def _ratio_bounds(fn: str, stat: str, lower: float | None, upper: float | None) -> tuple[float, float]:
    if stat != "k1":
        if lower is not None:
            raise ValueError(f"{fn}: stat={stat!r} is a divergence (≥ 0): give only `upper`, got lower={lower}")
        if upper is None:
            raise ValueError(f"{fn}: stat={stat!r} needs an `upper` bound on the divergence")
        check_positive(fn, "upper", upper, allow_zero=True)
        return float("-inf"), upper
    if upper is None and lower is None:
        raise ValueError(f"{fn}: stat='k1' needs ratio bounds: `upper` (lower defaults to 1/upper) and/or `lower`")
    if upper is not None:
        check_positive(fn, "upper", upper)
    if lower is None:
        lower = 1.0 / upper
    if upper is None:
        upper = float("inf")
    check_positive(fn, "lower", lower)
    if lower > upper:
        raise ValueError(f"{fn}: lower={lower} exceeds upper={upper}; the kept ratio interval would be empty")
    return lower, upper


def _reject(value: Tensor, stat: str, lower: float, upper: float, mask: Tensor) -> RejectionResult:
    if stat == "k1":  # value is a log-ratio; bounds are on the ratio ρ = e^value
        ratio = torch.exp(value.to(torch.float64))  # e^±100 is 0 / inf in float64 too: compared correctly
        keep = (ratio >= lower) & (ratio <= upper)
    else:
        keep = value <= upper
    new_mask = mask & keep
    rejected = (mask.sum() - new_mask.sum()).to(value.dtype) / mask.sum().clamp(min=1).to(value.dtype)
    return RejectionResult(mask=new_mask, rejected_fraction=rejected)


def token_rejection_mask(logp_proximal: Tensor, logp_behaviour: Tensor, response_mask: Tensor, *,
                         stat: RejectStat = "k1", lower: float | None = None,
                         upper: float | None = None) -> RejectionResult:
    """Reject single tokens whose behaviour/proximal disagreement is too large (verl `token_k*`; IcePop).

      stat="k1": keep iff lower ≤ ρ_t ≤ upper  (a single `upper` U means [1/U, U])
      stat="k2": keep iff ½λ_t² ≤ upper;   stat="k3": keep iff ρ_t − 1 − λ_t ≤ upper
    Note: verl's k1 filter bounds 1/ρ, which differs from this for asymmetric bounds; we bound ρ itself.
    """
    fn = "token_rejection_mask"
    check_choice(fn, "stat", stat, ("k1", "k2", "k3"))
    lo, hi = _ratio_bounds(fn, stat, lower, upper)
    log_ratio, mask = _log_ratio(fn, logp_proximal, logp_behaviour, response_mask)
    return _reject(_token_stat(log_ratio, stat), stat, lo, hi, mask)


def sequence_rejection_mask(logp_proximal: Tensor, logp_behaviour: Tensor, response_mask: Tensor, *,
                            stat: RejectStat = "k1", reduce: Literal["sum", "mean", "max"] = "mean",
                            lower: float | None = None, upper: float | None = None) -> RejectionResult:
    """Reject whole sequences (verl `seq_{sum,mean,max}_k*`; Seq-MIS, Geo-RS).

    The per-token statistic (k1: λ_t, k2: ½λ_t², k3: ρ_t − 1 − λ_t) is reduced over the valid tokens of
    each row (`sum`, `mean`, or `max` for k2/k3), then tested as in `token_rejection_mask`; for k1 with
    `mean` the tested ratio is the geometric mean exp(mean λ) (Geo-RS, typical bounds 0.999–1.001).
    """
    fn = "sequence_rejection_mask"
    check_choice(fn, "stat", stat, ("k1", "k2", "k3"))
    check_choice(fn, "reduce", reduce, ("sum", "mean", "max"))
    if stat == "k1" and reduce == "max":
        raise ValueError(f"{fn}: reduce='max' is defined for the divergences k2/k3 only; use 'sum' or 'mean' with k1")
    lo, hi = _ratio_bounds(fn, stat, lower, upper)
    log_ratio, mask = _log_ratio(fn, logp_proximal, logp_behaviour, response_mask)
    per_token = _token_stat(log_ratio, stat)
    if reduce == "sum":
        seq = masked_sum(per_token, mask, dim=-1)
    elif reduce == "mean":
        seq = masked_mean(per_token, mask, dim=-1)
    else:
        seq = torch.where(mask, per_token, torch.zeros_like(per_token)).amax(dim=-1)
    return _reject(seq[:, None].expand_as(mask), stat, lo, hi, mask)


def m2po_mask(logp_proximal: Tensor, logp_behaviour: Tensor, response_mask: Tensor, *,
              threshold: float) -> RejectionResult:
    """M2PO's second-moment trust region (arXiv:2510.01161; AReaL `m2_threshold`): with m2_t = λ_t² over the
    valid tokens, reject the fewest tokens, largest m2 first, that bring the mean m2 of the kept ones below τ:

        sort m2 descending: m_(1) ≥ m_(2) ≥ … ≥ m_(N);   k = min{k : mean(m_(k+1) … m_(N)) < τ}
        reject the k tokens of largest m2 (ties broken by position); if no k < N qualifies, keep one token.

    Nothing is rejected when the mean m2 is already below τ, so on-policy data (λ = 0) is untouched; unlike a
    per-token bound, a few large mismatches are dropped only when they move the batch's second moment. The
    statistic is over all valid tokens of the call (the learner passes one mini-batch).
    """
    fn = "m2po_mask"
    check_positive(fn, "threshold", threshold)
    log_ratio, mask = _log_ratio(fn, logp_proximal, logp_behaviour, response_mask)
    m2 = log_ratio.to(torch.float64).square()[mask]  # [N] in row-major order of the valid tokens
    n = m2.numel()
    if n == 0:
        return RejectionResult(mask=mask.clone(), rejected_fraction=log_ratio.new_zeros(()))
    order = torch.sort(m2, descending=True, stable=True).indices
    suffix = torch.flip(torch.cumsum(torch.flip(m2[order], [0]), 0), [0])  # suffix[k] = Σ of all but the k largest
    suffix_mean = suffix / torch.arange(n, 0, -1, dtype=torch.float64, device=m2.device)
    below = torch.nonzero(suffix_mean < threshold)
    k = int(below[0]) if below.numel() else n - 1
    keep = torch.ones(n, dtype=torch.bool, device=m2.device)
    keep[order[:k]] = False
    new_mask = mask.clone()
    new_mask[mask] = keep
    rejected = torch.tensor(k / n, dtype=logp_proximal.dtype, device=logp_proximal.device)
    return RejectionResult(mask=new_mask, rejected_fraction=rejected)


def decoupled_ppo_weights(logp_proximal: Tensor, logp_behaviour: Tensor, response_mask: Tensor, *,
                          cap: float | None = 5.0, drop_above_cap: bool = False) -> ISWeightsResult:
    """Behaviour weights of decoupled PPO (Hilton et al. arXiv:2110.00641; AReaL arXiv:2505.24298).

      J = E_μ[ w_t · min(r_t·A_t, clip(r_t)·A_t) ],  w_t = π_proximal/μ,  r_t = π_θ/π_proximal
    With `drop_above_cap=False`, w_t = min(ρ_t, cap) (AReaL "clamp"; `cap=None` leaves w unbounded).
    With `drop_above_cap=True`, tokens with ρ_t > cap get weight 0 and the rest keep ρ_t (AReaL "mask").
    Returns ISWeightsResult; `truncated_fraction` counts tokens above the cap.
    """
    fn = "decoupled_ppo_weights"
    if cap is not None:
        check_positive(fn, "cap", cap)
    elif drop_above_cap:
        raise ValueError(f"{fn}: drop_above_cap=True needs a cap")
    log_ratio, mask = _log_ratio(fn, logp_proximal, logp_behaviour, response_mask)
    raw = _ratio(log_ratio)
    bound = float("inf") if cap is None else cap
    if drop_above_cap:
        weights = torch.where(raw > bound, torch.zeros_like(raw), raw)
    else:
        weights = raw.clamp(max=bound)
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    return _weights_result(raw, weights, bound, log_ratio, mask)


class VTraceResult(NamedTuple):
    vs: Tensor  # [B, T] V-trace value targets v_s, 0 at masked positions
    pg_advantages: Tensor  # [B, T] min(ρ̄_pg, ρ_s)·(q_s − V(x_s)), 0 at masked positions
    errors: Tensor  # [B, T] v_s − V(x_s)


def vtrace(log_rhos: Tensor, discounts: Tensor, rewards: Tensor, values: Tensor, bootstrap_value: Tensor,
           response_mask: Tensor, *, lambda_: float = 1.0, clip_rho_threshold: float = 1.0,
           clip_pg_rho_threshold: float = 1.0) -> VTraceResult:
    """V-trace targets and policy-gradient advantages (IMPALA, Espeholt et al. arXiv:1802.01561).

    Over the valid steps s of each row (masked steps are skipped), with x_{s+1} the next valid step and
    V(x_{s+1}) = bootstrap_value after the last one:
      ρ̄_s = min(ρ̄, ρ_s),  c_s = λ·min(1, ρ_s),  δ_s = ρ̄_s·(r_s + γ_s·V(x_{s+1}) − V(x_s))
      v_s − V(x_s) = δ_s + γ_s·c_s·(v_{s+1} − V(x_{s+1}))
      q_s = r_s + γ_s·(λ·v_{s+1} + (1 − λ)·V(x_{s+1}))     (last step: r_s + γ_s·bootstrap)
      pg_adv_s = min(ρ̄_pg, ρ_s)·(q_s − V(x_s))
    With ρ ≡ 1 and λ = 1, v_s is the discounted return bootstrapped from `bootstrap_value`.

    Args:
      log_rhos: [B, T] log(π_target/π_behaviour) per step. discounts: [B, T] γ_s (0 at a terminal step).
      rewards, values: [B, T]. bootstrap_value: [B] V after the last valid step. response_mask: [B, T].
      lambda_: trace λ ∈ [0, 1]. clip_rho_threshold: ρ̄. clip_pg_rho_threshold: ρ̄_pg.
    """
    fn = "vtrace"
    check_token_tensor(fn, "log_rhos", log_rhos)
    mask = check_mask(fn, "response_mask", response_mask, log_rhos)
    check_nonempty(fn, "response_mask", mask)
    for name, x in (("log_rhos", log_rhos), ("discounts", discounts), ("rewards", rewards), ("values", values)):
        check_token_tensor(fn, name, x, like=log_rhos)
        check_finite(fn, name, x, mask)
    check_seq_tensor(fn, "bootstrap_value", bootstrap_value, mask.shape[0])
    check_finite(fn, "bootstrap_value", bootstrap_value)
    check_unit_interval(fn, "lambda_", lambda_)
    check_positive(fn, "clip_rho_threshold", clip_rho_threshold)
    check_positive(fn, "clip_pg_rho_threshold", clip_pg_rho_threshold)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    rhos = torch.exp(torch.where(mask, log_rhos, zero).clamp(-_CLAMP, _CLAMP))
    next_value = bootstrap_value.clone()  # V(x_{s+1})
    next_target = bootstrap_value.clone()  # λ·v_{s+1} + (1 − λ)·V(x_{s+1}); the bootstrap after the last step
    acc = torch.zeros_like(next_value)  # v_{s+1} − V(x_{s+1})
    vs, pg_adv = torch.zeros_like(values), torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m, rho, gamma, v, r = mask[:, t], rhos[:, t], discounts[:, t], values[:, t], rewards[:, t]
        delta = rho.clamp(max=clip_rho_threshold) * (r + gamma * next_value - v)
        err = delta + gamma * lambda_ * rho.clamp(max=1.0) * acc
        q = r + gamma * next_target
        vs[:, t] = torch.where(m, v + err, zero)
        pg_adv[:, t] = torch.where(m, rho.clamp(max=clip_pg_rho_threshold) * (q - v), zero)
        acc = torch.where(m, err, acc)
        next_target = torch.where(m, lambda_ * (v + err) + (1.0 - lambda_) * v, next_target)
        next_value = torch.where(m, v, next_value)
    errors = torch.where(mask, vs - values, zero)
    return VTraceResult(vs=vs, pg_advantages=pg_adv, errors=errors)
