"""Drift: how far the policy being trained has moved from the behaviour policy μ that sampled its tokens, read off
the log-ratio the policy loss already computes. With λ_t = log π_θ(y_t) − log μ(y_t) and r_t = e^λ_t over the
valid tokens (samples of μ):

    k1     = mean(−λ)              the k1 estimate of KL(μ ‖ π_θ): unbiased, so a batch's value can be negative
    ratio  = mean(r),  ratio_sq = mean(r²)
    ess    = ratio² / ratio_sq     the normalised effective sample size (Σr)² / (N·Σr²) ∈ (0, 1] of the ratios

Every field is a mean over tokens, so micro-batches and ranks combine them weighted by their tokens, and the ESS of
the union is `effective_sample_size` of the combined means. On-policy (λ = 0): k1 0, ratio 1, ess 1.

    drift = behaviour_drift(logp, logp_behaviour, mask)       # [B, T] each
    effective_sample_size(drift.ratio, drift.ratio_sq)

A drift budget bounds the version lag in drift units: each learner step's KL(μ‖π_θ) over its batch's mean lag
updates an estimate of the drift one version of lag adds, and the lag cap is the largest lag whose predicted drift
fits the budget (linear in the lag; re-estimated every step, so a drift that grows faster than linearly is caught
at the lags the run actually trains):

    rate = drift_rate_update(rate, kl=step_kl, mean_lag=step_lag)   # DriftRate() at the start
    cap = drift_lag_cap(budget, rate)                                # None until a lagged step was seen
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from asyncrl.algos._checks import check_mask, check_token_tensor
from asyncrl.algos.masked import masked_mean

__all__ = ["BehaviourDrift", "behaviour_drift", "effective_sample_size", "SequenceMask", "off_policy_sequence_mask",
           "DriftRate", "drift_rate_update", "drift_lag_cap"]

_CLAMP = 20.0
UNBOUNDED_LAG = 2**20
"""A drift budget affording more versions of lag than this bounds nothing a run reaches: no cap."""  # as the importance weights': e^20 is finite in fp32


class BehaviourDrift(NamedTuple):
    k1: Tensor  # mean(log μ − log π_θ) over valid tokens (0-d; 0 without any)
    ratio: Tensor  # mean of r = π_θ / μ (log-ratio clamped to ±20)
    ratio_sq: Tensor  # mean of r²


def behaviour_drift(logp: Tensor, logp_behaviour: Tensor, response_mask: Tensor) -> BehaviourDrift:
    """Token means of the drift from μ (module docstring), detached.

    Args:
      logp: [B, T] log π_θ of the sampled tokens.
      logp_behaviour: [B, T] log μ of the same tokens (the engine's).
      response_mask: [B, T] bool, the tokens that count.
    """
    fn = "behaviour_drift"
    check_token_tensor(fn, "logp", logp)
    check_token_tensor(fn, "logp_behaviour", logp_behaviour, like=logp)
    mask = check_mask(fn, "response_mask", response_mask, logp)
    log_ratio = torch.where(mask, (logp.detach() - logp_behaviour.detach()).float(), 0.0)  # masked: 0, never ±inf
    ratio = torch.exp(log_ratio.clamp(-_CLAMP, _CLAMP))
    return BehaviourDrift(k1=masked_mean(-log_ratio, mask), ratio=masked_mean(ratio, mask),
                          ratio_sq=masked_mean(ratio.square(), mask))


class SequenceMask(NamedTuple):
    mask: Tensor  # [B, T] bool: the response mask with the masked sequences' tokens removed (never adds a token)
    masked_fraction: Tensor  # 0-d: the share of the valid tokens removed


def off_policy_sequence_mask(logp: Tensor, logp_behaviour: Tensor, advantages: Tensor, response_mask: Tensor, *,
                             threshold: float) -> SequenceMask:
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556, "OPSM"): a sequence with a negative advantage
    whose drift from μ, the mean over its valid tokens of log μ − log π_θ (its k1 estimate of KL(μ‖π_θ)), exceeds
    `threshold` (δ) gets no loss; every other sequence keeps its tokens. Stale samples that would push the policy
    away from what it did badly, computed for a policy that has since moved on, are the ones that destabilise
    off-policy updates; positive-advantage sequences and those the policy still explains are kept. The loss's
    normalisers are not changed (the masked tokens count as zeros, as in the paper).

    Args:
      logp: [B, T] log π_θ of the sampled tokens (the policy being trained; detached here).
      logp_behaviour: [B, T] log μ of the same tokens.
      advantages: [B, T] per-token advantages (a sequence is negative where its valid tokens' mean is).
      response_mask: [B, T] bool.
      threshold: δ ≥ 0, in nats a token.
    """
    fn = "off_policy_sequence_mask"
    check_token_tensor(fn, "logp", logp)
    check_token_tensor(fn, "logp_behaviour", logp_behaviour, like=logp)
    check_token_tensor(fn, "advantages", advantages, like=logp)
    mask = check_mask(fn, "response_mask", response_mask, logp)
    if not threshold >= 0:
        raise ValueError(f"{fn}: threshold δ must be >= 0 (nats a token), got {threshold}")
    drift = masked_mean(torch.where(mask, (logp_behaviour - logp).detach().float(), 0.0), mask, dim=-1)  # [B]
    negative = masked_mean(torch.where(mask, advantages.detach().float(), 0.0), mask, dim=-1) < 0
    kept = mask & ~(negative & (drift > threshold))[:, None]
    removed = (mask.sum() - kept.sum()).float() / mask.sum().clamp(min=1).float()
    return SequenceMask(kept, removed)


def effective_sample_size(ratio: float, ratio_sq: float) -> float:
    """The normalised ESS (E r)² / E r² ∈ (0, 1] of token means of r and r² (1 when there were no tokens)."""
    return ratio * ratio / ratio_sq if ratio_sq > 0 else 1.0


class DriftRate(NamedTuple):
    per_version: float = 0.0  # estimated KL(μ‖π_θ) a version of lag adds, nats a token
    steps: int = 0  # lagged steps that informed it (0: unknown)


def drift_rate_update(rate: DriftRate, *, kl: float, mean_lag: float, decay: float = 0.7) -> DriftRate:
    """The drift-per-version estimate after one learner step whose batch had drift `kl` (a KL(μ‖π_θ) estimate
    over its tokens; a negative k1 counts as 0) at a mean version lag of `mean_lag`: an exponential moving
    average of kl / mean_lag with weight `decay` on the past (the first lagged step sets it). A step of mean lag
    below 1/2 says little about the rate (its drift is mostly the engine–learner numerical gap) and leaves the
    estimate as it was."""
    if not 0 <= decay < 1:
        raise ValueError(f"drift_rate_update: decay must lie in [0, 1), got {decay}")
    if not (math.isfinite(kl) and math.isfinite(mean_lag)) or mean_lag < 0.5:
        return rate
    observed = max(kl, 0.0) / mean_lag
    value = observed if rate.steps == 0 else decay * rate.per_version + (1 - decay) * observed
    return DriftRate(value, rate.steps + 1)


def drift_lag_cap(budget: float, rate: DriftRate) -> int | None:
    """The largest version lag L ≥ 1 with L · rate.per_version ≤ `budget` (nats a token); None while the rate is
    unknown, zero, or so small that L would pass UNBOUNDED_LAG (no cap). Never below 1: work admitted at the current version has lag 1 once the next version
    is published, so a cap of 0 could never publish."""
    if not budget > 0:
        raise ValueError(f"drift_lag_cap: budget must be > 0 nats, got {budget}")
    if rate.steps == 0 or rate.per_version <= 0 or budget / rate.per_version > UNBOUNDED_LAG:
        return None
    return max(1, math.floor(budget / rate.per_version * (1 + 1e-9)))  # 0.06 / 0.02 is 3, not 2.999…
