"""KL estimators, KL-in-reward and the KL coefficient controllers.

Estimators follow Schulman, "Approximating KL divergence" (joschu.net/blog/kl-approx.html), for tokens
sampled from π_θ, with d = logp − logp_ref:
  k1  = d                                        unbiased, any sign
  abs = |d|
  k2  = ½·d²                                     ≥ 0
  k3  = e^x − x − 1, x = clamp(−d, ±20), result clamped to [−10, 10]   ≥ 0 (verl `low_var_kl`)
All are elementwise `[B, T] -> [B, T]`; aggregate with `agg_loss` and the response mask.

`straight_through=True` (verl's "k1+", "k3+") keeps the estimator's value but takes the gradient of k2,
whose gradient is the unbiased gradient of KL: value = base, gradient = ∇k2.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from asyncrl.algos._checks import check_finite, check_mask, check_nonempty, check_positive, check_token_tensor
from asyncrl.algos.masked import masked_mean

__all__ = [
    "kl_k1", "kl_k2", "kl_k3", "kl_abs", "KL_ESTIMATORS", "KLRewardResult", "kl_penalized_rewards",
    "adaptive_kl_coef",
]


def _check_pair(fn: str, logp: Tensor, logp_ref: Tensor) -> None:
    check_token_tensor(fn, "logp", logp)
    check_token_tensor(fn, "logp_ref", logp_ref, like=logp)


def _straight_through(value: Tensor, log_ratio: Tensor) -> Tensor:
    k2 = 0.5 * log_ratio.square()
    return k2 - k2.detach() + value.detach()


def kl_k1(logp: Tensor, logp_ref: Tensor, *, straight_through: bool = False) -> Tensor:
    """k1 = logp − logp_ref (per token). Unbiased for KL(π_θ ‖ π_ref); high variance; any sign."""
    _check_pair("kl_k1", logp, logp_ref)
    d = logp - logp_ref
    return _straight_through(d, d) if straight_through else d


def kl_abs(logp: Tensor, logp_ref: Tensor, *, straight_through: bool = False) -> Tensor:
    """|logp − logp_ref| (per token); ≥ 0."""
    _check_pair("kl_abs", logp, logp_ref)
    d = logp - logp_ref
    return _straight_through(d.abs(), d) if straight_through else d.abs()


def kl_k2(logp: Tensor, logp_ref: Tensor, *, straight_through: bool = False) -> Tensor:
    """k2 = ½·(logp − logp_ref)² (per token); ≥ 0; its gradient is the KL gradient (verl "mse")."""
    _check_pair("kl_k2", logp, logp_ref)
    d = logp - logp_ref
    return 0.5 * d.square()  # k2 is already its own straight-through estimator


def kl_k3(logp: Tensor, logp_ref: Tensor, *, straight_through: bool = False) -> Tensor:
    """k3 = e^x − x − 1 with x = logp_ref − logp clamped to ±20, result clamped to [−10, 10] (per token).

    Unbiased and low-variance for KL(π_θ ‖ π_ref) (verl "low_var_kl"); ≥ 0, ≤ 10.
    """
    _check_pair("kl_k3", logp, logp_ref)
    x = (logp_ref - logp).clamp(-20.0, 20.0)
    k3 = (torch.expm1(x) - x).clamp(-10.0, 10.0)  # = e^x − x − 1; expm1 avoids cancellation near x = 0 (k3 ≥ 0 holds)
    return _straight_through(k3, logp - logp_ref) if straight_through else k3


KL_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "k1": kl_k1, "kl": kl_k1, "abs": kl_abs, "k2": kl_k2, "mse": kl_k2, "k3": kl_k3, "low_var_kl": kl_k3,
}
"""verl's estimator names → functions (look up once at config time, never inside a loss)."""


class KLRewardResult(NamedTuple):
    token_rewards: Tensor  # [B, T] rewards − β·kl at valid tokens, 0 elsewhere
    kl: Tensor  # [B, T] per-token KL estimate, 0 at masked tokens
    mean_kl: Tensor  # scalar: mean over rows of each row's mean KL (the controller's input)


def kl_penalized_rewards(token_rewards: Tensor, logp_old: Tensor, logp_ref: Tensor, response_mask: Tensor, *,
                         kl_coef: float, estimator: Callable[..., Tensor] = kl_k1) -> KLRewardResult:
    """KL penalty in the reward (Ziegler et al. arXiv:1909.08593; verl `apply_kl_penalty`).

      r'_t = r_t − β·KL_t,  KL_t = estimator(logp_old_t, logp_ref_t)   at valid tokens.

    Args:
      token_rewards: [B, T] (outcome reward at the last valid token). logp_old: [B, T] rollout-policy
        log-probs; logp_ref: [B, T] reference log-probs. response_mask: [B, T].
      kl_coef: β ≥ 0. estimator: one of `KL_ESTIMATORS` (default k1, verl's default for the reward).
    """
    fn = "kl_penalized_rewards"
    check_token_tensor(fn, "token_rewards", token_rewards)
    mask = check_mask(fn, "response_mask", response_mask, token_rewards)
    check_nonempty(fn, "response_mask", mask)  # B = 0 would make mean_kl a NaN (mean over no rows)
    for name, x in (("logp_old", logp_old), ("logp_ref", logp_ref)):
        check_token_tensor(fn, name, x, like=token_rewards)
        check_finite(fn, name, x, mask)
    check_finite(fn, "token_rewards", token_rewards, mask)
    check_positive(fn, "kl_coef", kl_coef, allow_zero=True)
    if kl_coef == float("inf"):
        raise ValueError(f"{fn}: kl_coef must be finite, got {kl_coef}")
    zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    kl = torch.where(mask, estimator(torch.where(mask, logp_old, zero), torch.where(mask, logp_ref, zero)), zero)
    rewards = torch.where(mask, token_rewards - kl_coef * kl, zero)
    mean_kl = masked_mean(kl, mask, dim=-1).mean()
    return KLRewardResult(token_rewards=rewards, kl=kl, mean_kl=mean_kl)


def adaptive_kl_coef(kl_coef: float, current_kl: float, n_steps: int, *, target_kl: float = 0.1,
                     horizon: int = 10_000) -> float:
    """One update of the adaptive KL controller (Ziegler et al. arXiv:1909.08593).

      e = clip(KL / target − 1, −0.2, 0.2);   β ← β·(1 + e·n_steps / horizon)

    A fixed controller is simply a constant β. Returns the new β.
    """
    fn = "adaptive_kl_coef"
    check_positive(fn, "target_kl", target_kl)
    check_positive(fn, "horizon", horizon)
    check_positive(fn, "kl_coef", kl_coef, allow_zero=True)
    if n_steps < 0:
        raise ValueError(f"{fn}: n_steps must be >= 0 (samples or steps since the last update), got {n_steps}")
    if not (current_kl == current_kl and abs(current_kl) != float("inf")):
        raise ValueError(f"{fn}: current_kl must be finite, got {current_kl}")
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)
