"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (with and without baseline).

Shapes: `[B, T]` per token, `[B]` per sequence. Outcome methods take one scalar reward per sequence and a
`group_index` `[B]` (int) naming the prompt each sequence answers; groups are formed by *value*, so rows
of a group need not be contiguous and permuting rows permutes the outputs.

Every estimator returns `AdvantageResult(advantages, returns)`, both `[B, T]`, exactly 0 at masked
positions. They are statistics of the data, not of the parameters: call them under `torch.no_grad()`.

Choices where implementations disagree (see docs/algorithms.md):
* a group of one sequence carries no comparison, so its advantage is 0 for GRPO, Dr.GRPO, RLOO and the
  REINFORCE++ baseline (verl's GRPO loop returns s/(1+ε), its RLOO loop s; its vectorised RLOO returns 0);
* a group whose rewards are all equal gets an advantage of exactly 0 (not ε-small), so it gives no gradient;
* GAE and REINFORCE++ skip masked positions inside a response (e.g. tool output): they neither add reward
  nor break the discounting chain (verl's REINFORCE++ resets the return at a hole; its GAE skips).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from asyncrl.algos._checks import (
    check_finite, check_mask, check_nonempty, check_positive, check_seq_tensor, check_token_tensor,
    check_unit_interval,
)
from asyncrl.algos.masked import check_whitenable, masked_var, masked_whiten

__all__ = [
    "AdvantageResult", "gae_advantage", "grpo_advantage", "dr_grpo_advantage", "rloo_advantage",
    "reinforce_pp_advantage", "reinforce_pp_baseline_advantage", "group_stats", "GroupStats",
]


class AdvantageResult(NamedTuple):
    advantages: Tensor  # [B, T], 0 at masked positions
    returns: Tensor  # [B, T], 0 at masked positions (value targets for GAE, = advantages for outcome methods)


class GroupStats(NamedTuple):
    """Per-row statistics of the row's group (all `[B]`)."""
    mean: Tensor
    std: Tensor  # unbiased (Bessel); exactly 0 for a constant group or a group of one
    size: Tensor  # number of rows in the group
    constant: Tensor  # bool: every reward in the group is equal (a group of one is constant)


def group_stats(rewards: Tensor, group_index: Tensor) -> GroupStats:
    """Mean, unbiased std, size and constancy of each row's group, grouping rows by the value of `group_index`.

    Args:
      rewards: [B] floats.
      group_index: [B] integers; rows with equal values form one group.
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    zeros = rewards.new_zeros(num_groups)
    size = zeros.scatter_add(0, inverse, torch.ones_like(rewards))
    mean = zeros.scatter_add(0, inverse, rewards) / size
    sq_dev = (rewards - mean[inverse]) ** 2
    var = zeros.scatter_add(0, inverse, sq_dev) / (size - 1).clamp(min=1)
    hi = zeros.scatter_reduce(0, inverse, rewards, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, inverse, rewards, "amin", include_self=False)
    constant = hi == lo
    std = torch.where(constant, torch.zeros_like(var), var.sqrt())  # exactly 0, not rounding noise
    return GroupStats(mean=mean[inverse], std=std[inverse], size=size[inverse], constant=constant[inverse])


def _check_outcome(fn: str, rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> Tensor:
    mask = check_mask(fn, "response_mask", response_mask, check_token_tensor(fn, "response_mask", response_mask, floating=False))
    check_nonempty(fn, "response_mask", mask)
    batch = mask.shape[0]
    check_seq_tensor(fn, "rewards", rewards, batch)
    check_seq_tensor(fn, "group_index", group_index, batch, floating=False)
    if group_index.is_floating_point() or group_index.dtype == torch.bool:
        raise ValueError(f"{fn}: group_index must be an integer tensor (one id per prompt), got {group_index.dtype}")
    check_finite(fn, "rewards", rewards)
    return mask


def _broadcast(seq_adv: Tensor, mask: Tensor) -> AdvantageResult:
    adv = torch.where(mask, seq_adv[:, None], torch.zeros((), dtype=seq_adv.dtype, device=seq_adv.device))
    return AdvantageResult(advantages=adv, returns=adv)


def grpo_advantage(rewards: Tensor, group_index: Tensor, response_mask: Tensor, *,
                   norm_by_std: bool = True, eps: float = 1e-6) -> AdvantageResult:
    """Group-relative outcome advantage (GRPO, DeepSeekMath arXiv:2402.03300).

    A_i = (r_i − mean_g) / (std_g + eps), std unbiased, broadcast over the valid tokens of row i.
    With `norm_by_std=False` this is Dr.GRPO (arXiv:2503.20783): A_i = r_i − mean_g.
    Groups of one and groups with equal rewards get A = 0 exactly.

    Args:
      rewards: [B] sequence rewards.
      group_index: [B] int prompt id of each row.
      response_mask: [B, T] valid response tokens.
      norm_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
      eps: added to the std (verl 1e-6; TRL 1e-4).
    """
    return _group_relative("grpo_advantage", rewards, group_index, response_mask, norm_by_std, eps)


def _group_relative(fn: str, rewards: Tensor, group_index: Tensor, response_mask: Tensor, norm_by_std: bool,
                    eps: float) -> AdvantageResult:
    mask = _check_outcome(fn, rewards, group_index, response_mask)
    check_positive(fn, "eps", eps)
    stats = group_stats(rewards, group_index)
    centred = rewards - stats.mean
    seq_adv = centred / (stats.std + eps) if norm_by_std else centred
    seq_adv = torch.where(stats.constant, torch.zeros_like(seq_adv), seq_adv)
    return _broadcast(seq_adv, mask)


def dr_grpo_advantage(rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> AdvantageResult:
    """Dr.GRPO outcome advantage (arXiv:2503.20783): A_i = r_i − mean_g, no std normalisation."""
    return _group_relative("dr_grpo_advantage", rewards, group_index, response_mask, norm_by_std=False, eps=1e-6)


def rloo_advantage(rewards: Tensor, group_index: Tensor, response_mask: Tensor) -> AdvantageResult:
    """REINFORCE leave-one-out (RLOO, arXiv:2402.14740).

    A_i = r_i − (Σ_{j≠i} r_j)/(k − 1) = k/(k − 1)·(r_i − mean_g) for a group of k > 1; 0 for k = 1.

    Args:
      rewards: [B] sequence rewards.
      group_index: [B] int prompt id of each row.
      response_mask: [B, T] valid response tokens.
    """
    mask = _check_outcome("rloo_advantage", rewards, group_index, response_mask)
    stats = group_stats(rewards, group_index)
    k = stats.size
    seq_adv = (rewards - stats.mean) * k / (k - 1).clamp(min=1)
    seq_adv = torch.where(stats.constant, torch.zeros_like(seq_adv), seq_adv)
    return _broadcast(seq_adv, mask)


def reinforce_pp_baseline_advantage(rewards: Tensor, group_index: Tensor, response_mask: Tensor,
                                    eps: float = 1e-8, *, shift_mean: bool = False) -> AdvantageResult:
    """REINFORCE++ with a group-mean baseline (arXiv:2501.03262).

      A_i = (r_i − mean_g) / sqrt(σ² + eps), broadcast over valid tokens,
    where σ² is the variance of the centred values over all valid tokens of the batch. A group of one, or a
    group whose rewards are all equal, gets exactly 0: no comparison, no signal (as GRPO and RLOO here).
    `shift_mean=True` also subtracts the batch token-mean μ before dividing (verl's `masked_whiten`), which
    moves those groups to −μ/σ: then a degenerate group is pushed down or up by the other groups' lengths
    and rewards. Needs at least two valid tokens in the batch.
    """
    fn = "reinforce_pp_baseline_advantage"
    mask = _check_outcome(fn, rewards, group_index, response_mask)
    stats = group_stats(rewards, group_index)
    centred = torch.where(stats.constant, torch.zeros_like(rewards), rewards - stats.mean)
    tiled = centred[:, None].expand(mask.shape)
    check_whitenable(fn, "response_mask", mask)
    if shift_mean:
        adv = masked_whiten(tiled, mask, eps=eps)
    else:
        scaled = tiled * torch.rsqrt(masked_var(tiled, mask) + eps)
        adv = torch.where(mask, scaled, torch.zeros((), dtype=scaled.dtype, device=scaled.device))
    return AdvantageResult(advantages=adv, returns=adv)


def _check_token_inputs(fn: str, response_mask: Tensor, **tensors: Tensor) -> Tensor:
    first = next(iter(tensors.values()))
    check_token_tensor(fn, next(iter(tensors)), first)
    mask = check_mask(fn, "response_mask", response_mask, first)
    check_nonempty(fn, "response_mask", mask)
    for name, x in tensors.items():
        check_token_tensor(fn, name, x, like=first)
        check_finite(fn, name, x, mask)
    return mask


def reinforce_pp_advantage(token_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0,
                           eps: float = 1e-8) -> AdvantageResult:
    """REINFORCE++ without a baseline (arXiv:2501.03262).

    G_t = r_t + γ·G_{next valid t}, computed over valid tokens only; A = whiten(G) over the batch.
    Needs at least two valid tokens in the batch.

    Args:
      token_rewards: [B, T] per-token rewards (outcome reward at the last valid token, optionally −β·KL).
      response_mask: [B, T] valid response tokens.
      gamma: discount.
    Returns:
      advantages: whitened G; returns: G.
    """
    fn = "reinforce_pp_advantage"
    mask = _check_token_inputs(fn, response_mask, token_rewards=token_rewards)
    check_unit_interval(fn, "gamma", gamma)
    check_whitenable(fn, "response_mask", mask)
    zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    running = token_rewards.new_zeros(token_rewards.shape[0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m, running, zero)
    return AdvantageResult(advantages=masked_whiten(returns, mask, eps=eps), returns=returns)


def gae_advantage(token_rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float = 1.0,
                  lam: float = 1.0, whiten: bool = True, eps: float = 1e-8) -> AdvantageResult:
    """Generalised advantage estimation (Schulman et al., arXiv:1506.02438).

    Backwards over valid tokens only (masked tokens are skipped, not treated as episode ends):
      δ_t = r_t + γ·V_{t'} − V_t    (t' = next valid token; V = 0 after the last one)
      A_t = δ_t + γλ·A_{t'}
    returns = A + V (the λ-return, the critic's target); advantages = whiten(A) over the batch if `whiten`.

    Args:
      token_rewards: [B, T] per-token rewards.
      values: [B, T] critic values V_t of the state before token t.
      response_mask: [B, T] valid response tokens.
      gamma: discount. lam: GAE λ. whiten: normalise advantages to mean 0, std 1 over valid tokens
        (needs at least two valid tokens). eps: variance epsilon of the whitening.
    """
    fn = "gae_advantage"
    mask = _check_token_inputs(fn, response_mask, token_rewards=token_rewards, values=values)
    check_unit_interval(fn, "gamma", gamma)
    check_unit_interval(fn, "lam", lam)
    if whiten:
        check_whitenable(fn, "response_mask", mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    next_value = values.new_zeros(values.shape[0])
    last_adv = values.new_zeros(values.shape[0])
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last_adv = torch.where(m, delta + gamma * lam * last_adv, last_adv)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = torch.where(m, last_adv, zero)
    returns = torch.where(mask, adv + values, zero)
    advantages = masked_whiten(adv, mask, eps=eps) if whiten else adv
    return AdvantageResult(advantages=advantages, returns=returns)
