"""Masked reductions over `[B, T]` token tensors.

Every reduction reads values only where the mask is set: it selects with `torch.where` before any
arithmetic, so a NaN or inf at a masked position can never leak into a result (verl's `masked_sum` has
the same property; its `seq-*` loss modes do not).
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algos._checks import check_mask, check_token_tensor

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "seq_lengths"]


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·mask over `dim` (all dims if None). Masked entries are never read."""
    mask = mask if mask.dtype == torch.bool else mask != 0
    kept = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·mask / Σ mask; 0 (not NaN) where the mask is empty."""
    mask = mask if mask.dtype == torch.bool else mask != 0
    count = mask.sum(dim=dim) if dim is not None else mask.sum()
    total = masked_sum(values, mask, dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: Tensor, mask: Tensor) -> Tensor:
    """Unbiased (Bessel-corrected) variance over all valid entries.

    Raises:
      ValueError: fewer than two valid entries (the variance is undefined).
    """
    n = int(mask.sum())
    if n < 2:
        raise ValueError(f"masked_var: needs at least 2 valid entries to estimate a variance, got {n}; "
                         "whiten larger batches or turn whitening off")
    mean = masked_mean(values, mask)
    return masked_sum((values - mean) ** 2, mask) / (n - 1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(values − μ) / sqrt(σ² + eps) with μ, σ² (unbiased) over valid entries; masked entries become 0.

    Args:
      values: [B, T] floats.
      mask: [B, T] bool.
      eps: added to the variance inside the square root (verl uses 1e-8).
    """
    fn = "masked_whiten"
    check_token_tensor(fn, "values", values)
    mask = check_mask(fn, "mask", mask, values)
    check_whitenable(fn, "mask", mask)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    out = (values - mean) * torch.rsqrt(var + eps)
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))


def check_whitenable(fn: str, name: str, mask: Tensor) -> None:
    """Whitening estimates a variance: refuse fewer than two valid entries, naming the caller and its mask."""
    n = int(mask.sum())
    if n < 2:
        raise ValueError(f"{fn}: {name} has {n} valid entr{'y' if n == 1 else 'ies'} but whitening needs at least 2 "
                         "to estimate a variance; whiten larger batches or turn whitening off")


def seq_lengths(mask: Tensor) -> Tensor:
    """Number of valid tokens per row: [B, T] bool -> [B] int64."""
    return mask.sum(dim=-1)
