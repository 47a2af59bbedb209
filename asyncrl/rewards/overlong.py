"""DAPO overlong reward shaping (Yu et al. arXiv:2503.14476, §3.4; verl `DAPORewardManager`)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["overlong_penalty"]


def overlong_penalty(lengths: Tensor | int, *, max_response_length: int, buffer_length: int,
                     penalty_factor: float = 1.0) -> Tensor | float:
    """Soft penalty for responses that run into the last `buffer_length` tokens of the budget.

      r_len(L) = min(−f·(L − (L_max − L_buf)) / L_buf, 0),   floored at −f for L ≥ L_max

    0 up to L_max − L_buf, linear inside the buffer, −f at (and beyond) L_max: non-positive and
    non-increasing in L. Add it to the task reward.

    Args:
      lengths: an int or a [B] integer tensor of valid response lengths.
      max_response_length: L_max. buffer_length: L_buf, 1 ≤ L_buf ≤ L_max. penalty_factor: f ≥ 0.
    """
    fn = "overlong_penalty"
    if not 1 <= buffer_length <= max_response_length:
        raise ValueError(f"{fn}: need 1 <= buffer_length <= max_response_length, got buffer_length={buffer_length}, "
                         f"max_response_length={max_response_length}")
    if penalty_factor < 0:
        raise ValueError(f"{fn}: penalty_factor must be >= 0, got {penalty_factor}")
    start = max_response_length - buffer_length
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise ValueError(f"{fn}: lengths must be a [B] integer tensor, got shape {list(lengths.shape)} "
                             f"and dtype {lengths.dtype}")
        if bool((lengths < 0).any()):
            raise ValueError(f"{fn}: lengths must be >= 0, got min {int(lengths.min())}")
        over = (lengths.to(torch.float64) - start).clamp(0, buffer_length)
        return (-penalty_factor * (over / buffer_length)).to(torch.float32)
    if int(lengths) != lengths or lengths < 0:
        raise ValueError(f"{fn}: a length must be a non-negative integer, got {lengths}")
    over = min(max(lengths - start, 0), buffer_length)
    return -penalty_factor * (over / buffer_length)
