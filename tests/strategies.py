"""Hypothesis strategies for `[B, T]` token tensors and masks, shared by the algos tests."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def shapes(draw, max_b: int = 6, max_t: int = 8, min_b: int = 1, min_t: int = 1) -> tuple[int, int]:
    return draw(st.integers(min_b, max_b)), draw(st.integers(min_t, max_t))


@st.composite
def masks(draw, b: int, t: int, *, nonempty_rows: bool = False, contiguous: bool = False) -> torch.Tensor:
    """A bool [b, t] mask. `contiguous`: each row is valid on a prefix (a response); else any pattern."""
    if contiguous:
        lo = 1 if nonempty_rows else 0
        lengths = draw(st.lists(st.integers(lo, t), min_size=b, max_size=b))
        return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    mask = torch.tensor(bits, dtype=torch.bool).reshape(b, t)
    if nonempty_rows:
        mask[:, 0] = True
    return mask


def tensors(b: int, t: int, *, lo: float = -3.0, hi: float = 3.0):
    """A float64 [b, t] tensor with values in [lo, hi]."""
    return st.lists(st.floats(lo, hi, allow_nan=False, allow_infinity=False), min_size=b * t, max_size=b * t).map(
        lambda xs: torch.tensor(xs, dtype=torch.float64).reshape(b, t))


def vectors(b: int, *, lo: float = -3.0, hi: float = 3.0):
    """A float64 [b] tensor with values in [lo, hi]."""
    return st.lists(st.floats(lo, hi, allow_nan=False, allow_infinity=False), min_size=b, max_size=b).map(
        lambda xs: torch.tensor(xs, dtype=torch.float64))
