"""Policy and value losses: PPO clip (asymmetric + dual clip), GSPO, CISPO, REINFORCE, clipped value loss,
and the four verl loss-aggregation modes.

Shapes: `[B, T]` per token. `logp` is log π_θ of the taken tokens (differentiable), `logp_old` the
proximal / old policy's (no gradient), `advantages` per token (expand per-sequence advantages first).
Every loss returns a named result: the scalar `loss` (differentiable) and detached statistics.

`is_weights` (optional, `[B, T]`, detached) multiply the per-token loss before aggregation: this is where
truncated importance weights behaviour → proximal plug in (`asyncrl.algos.correction`).

`num_tokens` / `num_seqs` override the local denominators of the aggregation, so that micro-batches
accumulated with the *global* count give exactly the gradient of the whole batch.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

from asyncrl.algos._checks import check_choice, check_finite, check_mask, check_nonempty, check_token_tensor
from asyncrl.algos.masked import masked_mean, masked_sum

__all__ = [
    "LossAggMode", "LOSS_AGG_MODES", "agg_loss", "PolicyLossResult", "ValueLossResult", "ppo_clip_loss",
    "gspo_loss", "cispo_loss", "reinforce_loss", "value_loss",
]

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
_LOG_RATIO_CLAMP = 20.0  # exp(20) ≈ 4.9e8: keeps the ratio finite in fp32 (verl's choice for PPO/CISPO)


class PolicyLossResult(NamedTuple):
    loss: Tensor  # scalar, differentiable
    clipfrac: Tensor  # fraction of valid tokens whose ratio was clipped (either side)
    clipfrac_lower: Tensor  # fraction of valid tokens hit by the dual clip (A < 0 and r > c)
    ppo_kl: Tensor  # mean(logp_old − logp): k1 estimate of KL(π_old ‖ π_θ)
    num_tokens: Tensor  # number of valid tokens in this batch


class ValueLossResult(NamedTuple):
    loss: Tensor  # scalar, differentiable
    clipfrac: Tensor  # fraction of valid tokens where the clipped branch was larger
    num_tokens: Tensor


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: LossAggMode = "token-mean", *, num_tokens: float | None = None,
             num_seqs: float | None = None, norm_length: float | None = None) -> Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar.

    token-mean:              Σ_{i,t} m·L / N                       (N = num_tokens or the valid-token count)
    seq-mean-token-sum:      Σ_i Σ_t m·L / S                       (S = num_seqs or the non-empty row count)
    seq-mean-token-mean:     Σ_i [Σ_t m·L / n_i] / S              (rows with n_i = 0 are skipped)
    seq-mean-token-sum-norm: Σ_{i,t} m·L / (S'·norm_length)        (S' = num_seqs or B; norm_length defaults
                             to T) — Dr.GRPO's constant normaliser (arXiv:2503.20783). verl divides by T only;
                             we also divide by the row count, as the paper and TRL do.
    An all-masked batch gives 0, not NaN. Masked entries are never read.
    """
    fn = "agg_loss"
    check_choice(fn, "mode", mode, LOSS_AGG_MODES)
    check_token_tensor(fn, "loss_mat", loss_mat)
    mask = check_mask(fn, "mask", mask, loss_mat)
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)
        return masked_sum(loss_mat, mask) / denom.clamp(min=1).to(loss_mat.dtype)
    row_sum = masked_sum(loss_mat, mask, dim=-1)
    lengths = mask.sum(dim=-1)
    if mode == "seq-mean-token-sum-norm":
        rows = loss_mat.shape[0] if num_seqs is None else num_seqs
        length = loss_mat.shape[1] if norm_length is None else norm_length
        return row_sum.sum() / max(float(rows) * float(length), 1.0)
    nonempty = lengths > 0
    if mode == "seq-mean-token-mean":
        row_sum = row_sum / lengths.clamp(min=1).to(row_sum.dtype)
    denom = nonempty.sum() if num_seqs is None else torch.as_tensor(num_seqs)
    return row_sum.sum() / denom.clamp(min=1).to(row_sum.dtype)


def _check_policy_inputs(fn: str, response_mask: Tensor, is_weights: Tensor | None, **tensors: Tensor) -> Tensor:
    first_name, first = next(iter(tensors.items()))
    check_token_tensor(fn, first_name, first)
    mask = check_mask(fn, "response_mask", response_mask, first)
    check_nonempty(fn, "response_mask", mask)
    named = dict(tensors, **({"is_weights": is_weights} if is_weights is not None else {}))
    for name, x in named.items():
        check_token_tensor(fn, name, x, like=first)
        check_finite(fn, name, x, mask)
    return mask


def _valid(x: Tensor, mask: Tensor) -> Tensor:
    """x where valid, 0 elsewhere: masked garbage (even NaN) never reaches values or gradients."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _check_clip(fn: str, low: float | None, high: float) -> None:
    if low is not None and not 0.0 <= low < 1.0:
        raise ValueError(f"{fn}: clip_ratio_low must lie in [0, 1) so that 1 − clip_ratio_low > 0, got {low}")
    if high < 0:
        raise ValueError(f"{fn}: clip_ratio_high must be >= 0, got {high}")


def ppo_clip_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, response_mask: Tensor, *,
                  clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 3.0,
                  loss_agg_mode: LossAggMode = "token-mean", is_weights: Tensor | None = None,
                  num_tokens: float | None = None, num_seqs: float | None = None,
                  norm_length: float | None = None) -> PolicyLossResult:
    """Clipped surrogate loss of PPO (arXiv:1707.06347) with asymmetric clip (DAPO clip-higher,
    arXiv:2503.14476) and dual clip (arXiv:1912.09729).

      r = exp(clamp(logp − logp_old, ±20))
      L = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))
      L = min(L, −A·c)   where A < 0 (dual clip; `clip_ratio_c=None` disables it)
    then L·is_weights, aggregated with `loss_agg_mode`. Clipped tokens get exactly zero gradient.

    Args:
      logp, logp_old, advantages: [B, T]. response_mask: [B, T] valid tokens.
      clip_ratio_low, clip_ratio_high: ε_low, ε_high (DAPO: 0.2, 0.28). clip_ratio_c: dual-clip bound c > 1.
      loss_agg_mode: see `agg_loss`. is_weights: optional [B, T] detached per-token weights.
      num_tokens, num_seqs, norm_length: global denominators for gradient accumulation (see `agg_loss`).
    """
    fn = "ppo_clip_loss"
    check_choice(fn, "loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    mask = _check_policy_inputs(fn, response_mask, is_weights, logp=logp, logp_old=logp_old, advantages=advantages)
    _check_clip(fn, clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"{fn}: clip_ratio_c must be > 1 (it bounds the loss of negative advantages), got {clip_ratio_c}; "
                         "use None to disable the dual clip")
    adv = _valid(advantages, mask)
    log_ratio = _valid(logp - logp_old.detach(), mask).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    dual_hit = torch.zeros_like(mask)
    if clip_ratio_c is not None:
        loss_dual = -adv * clip_ratio_c
        dual_hit = (adv < 0) & (per_token > loss_dual)
        per_token = torch.where(adv < 0, torch.minimum(per_token, loss_dual), per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    norm_length=norm_length)
    with torch.no_grad():
        return PolicyLossResult(
            loss=loss,
            clipfrac=masked_mean((loss_clipped > loss_unclipped).to(logp.dtype), mask),
            clipfrac_lower=masked_mean(dual_hit.to(logp.dtype), mask),
            ppo_kl=masked_mean(-log_ratio, mask),
            num_tokens=mask.sum(),
        )


def gspo_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, response_mask: Tensor, *,
              clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4, is_weights: Tensor | None = None,
              num_seqs: float | None = None) -> PolicyLossResult:
    """Group sequence policy optimisation, GSPO-token form (arXiv:2507.18071).

      log s_i   = Σ_t m·(logp − logp_old) / n_i                       (geometric-mean sequence ratio)
      log s_i,t = sg[log s_i] + logp_t − sg[logp_t], clamped at 10    (value s_i, gradient s_i·∇logp_t)
      L         = max(−A·s, −A·clip(s, 1 − ε_low, 1 + ε_high))
    always aggregated `seq-mean-token-mean` (as in the paper and verl). No dual clip.
    Defaults are the paper's clip range (3e-4, 4e-4).
    """
    fn = "gspo_loss"
    mask = _check_policy_inputs(fn, response_mask, is_weights, logp=logp, logp_old=logp_old, advantages=advantages)
    _check_clip(fn, clip_ratio_low, clip_ratio_high)
    adv = _valid(advantages, mask)
    logp_v = _valid(logp, mask)
    log_ratio = logp_v - _valid(logp_old.detach(), mask)
    lengths = mask.sum(dim=-1).clamp(min=1).to(logp.dtype)
    seq_log_ratio = log_ratio.sum(dim=-1) / lengths  # [B]
    token_log_ratio = (seq_log_ratio.detach()[:, None] + logp_v - logp_v.detach()).clamp(max=10.0)
    ratio = torch.exp(token_log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = agg_loss(per_token, mask, "seq-mean-token-mean", num_seqs=num_seqs)
    with torch.no_grad():
        return PolicyLossResult(
            loss=loss,
            clipfrac=masked_mean((loss_clipped > loss_unclipped).to(logp.dtype), mask),
            clipfrac_lower=torch.zeros((), dtype=logp.dtype, device=logp.device),
            ppo_kl=masked_mean(-log_ratio, mask),
            num_tokens=mask.sum(),
        )


def cispo_loss(logp: Tensor, logp_old: Tensor, advantages: Tensor, response_mask: Tensor, *,
               clip_ratio_low: float | None = None, clip_ratio_high: float = 0.2,
               loss_agg_mode: LossAggMode = "token-mean", is_weights: Tensor | None = None,
               num_tokens: float | None = None, num_seqs: float | None = None,
               norm_length: float | None = None) -> PolicyLossResult:
    """Clipped IS-weight policy optimisation (CISPO, MiniMax-M1 arXiv:2506.13585).

      r = exp(clamp(logp − logp_old, ±20)),  r̂ = sg[clip(r, 1 − ε_low, 1 + ε_high)]
      L = −r̂·A·logp
    Unlike PPO every token keeps a gradient (r̂·A·∇logp); only the weight is clipped.
    `clip_ratio_low=None` drops the lower bound, as the paper does. Note the loss *value* depends on logp
    itself, not only on the ratio.
    """
    fn = "cispo_loss"
    check_choice(fn, "loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    mask = _check_policy_inputs(fn, response_mask, is_weights, logp=logp, logp_old=logp_old, advantages=advantages)
    _check_clip(fn, clip_ratio_low, clip_ratio_high)
    adv = _valid(advantages, mask)
    logp_v = _valid(logp, mask)
    log_ratio = (logp_v - _valid(logp_old.detach(), mask)).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio.detach())
    lower = 0.0 if clip_ratio_low is None else 1.0 - clip_ratio_low
    clipped_ratio = ratio.clamp(lower, 1.0 + clip_ratio_high)
    per_token = -clipped_ratio * adv * logp_v
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    norm_length=norm_length)
    with torch.no_grad():
        return PolicyLossResult(
            loss=loss,
            clipfrac=masked_mean((clipped_ratio != ratio).to(logp.dtype), mask),
            clipfrac_lower=torch.zeros((), dtype=logp.dtype, device=logp.device),
            ppo_kl=masked_mean(-log_ratio, mask),
            num_tokens=mask.sum(),
        )


def reinforce_loss(logp: Tensor, advantages: Tensor, response_mask: Tensor, *,
                   loss_agg_mode: LossAggMode = "token-mean", is_weights: Tensor | None = None,
                   num_tokens: float | None = None, num_seqs: float | None = None,
               norm_length: float | None = None) -> PolicyLossResult:
    """Policy-gradient (REINFORCE, Williams 1992) loss: L = −A·w·logp.

    With `is_weights` = min(π_θ/π_behaviour, C) (detached) this is verl's bypass-mode REINFORCE for stale
    samples. The ratio statistics are reported as 0 (no old policy here).
    """
    fn = "reinforce_loss"
    check_choice(fn, "loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    mask = _check_policy_inputs(fn, response_mask, is_weights, logp=logp, advantages=advantages)
    per_token = -_valid(advantages, mask) * _valid(logp, mask)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = agg_loss(per_token, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    norm_length=norm_length)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return PolicyLossResult(loss=loss, clipfrac=zero, clipfrac_lower=zero, ppo_kl=zero, num_tokens=mask.sum())


def value_loss(values: Tensor, values_old: Tensor, returns: Tensor, response_mask: Tensor, *,
               clip_range: float | None = 0.5, loss_agg_mode: LossAggMode = "token-mean",
               num_tokens: float | None = None, num_seqs: float | None = None,
               norm_length: float | None = None) -> ValueLossResult:
    """Clipped value loss (PPO; verl `compute_value_loss`).

      V_clip = clip(V, V_old − c, V_old + c)
      L      = ½·agg(max((V − R)², (V_clip − R)²))
    `clip_range=None` gives the plain squared error ½·agg((V − R)²).

    Args:
      values: [B, T] current critic output (differentiable). values_old: [B, T] critic output at rollout time.
      returns: [B, T] targets (e.g. GAE returns). response_mask: [B, T].
    """
    fn = "value_loss"
    check_choice(fn, "loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    mask = _check_policy_inputs(fn, response_mask, None, values=values, values_old=values_old, returns=returns)
    if clip_range is not None and clip_range <= 0:
        raise ValueError(f"{fn}: clip_range must be > 0 or None (no clipping), got {clip_range}")
    v = _valid(values, mask)
    target = _valid(returns, mask)
    err_unclipped = (v - target) ** 2
    if clip_range is None:
        per_token, clipped = err_unclipped, torch.zeros_like(mask)
    else:
        v_old = _valid(values_old.detach(), mask)
        v_clip = v.clamp(min=v_old - clip_range, max=v_old + clip_range)  # exactly V where not clipped
        err_clipped = (v_clip - target) ** 2
        per_token, clipped = torch.maximum(err_unclipped, err_clipped), err_clipped > err_unclipped
    loss = 0.5 * agg_loss(per_token, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    norm_length=norm_length)
    with torch.no_grad():
        return ValueLossResult(loss=loss, clipfrac=masked_mean(clipped.to(values.dtype), mask), num_tokens=mask.sum())
