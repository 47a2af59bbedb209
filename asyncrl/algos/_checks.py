"""Input contracts shared by every function in `asyncrl.algos`.

Shape convention: `[B, T]` per token (B sequences, T padded response length), `[B]` per sequence.
Masks are bool or {0, 1} floats of shape `[B, T]`; a value at a masked position never reaches an
output. Each check raises `ValueError` naming the function, the argument, what it received and the fix;
nothing is ever broadcast silently (a `[B]` tensor is never accepted where `[B, T]` is expected).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import Tensor

_VALUE_CHECKS = contextvars.ContextVar("asyncrl_value_checks", default=True)


@contextlib.contextmanager
def value_checks(enabled: bool):
    """Turn the value checks (finite values, {0, 1} masks) on or off in this thread; shape checks always run.

    Each value check reads a result back from the device, which stalls a GPU training loop; the learner
    turns them off in its inner loop, where a non-finite value shows up as a non-finite gradient norm and
    the update is skipped and counted instead.
    """
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def _shape(x: Tensor) -> str:
    return "[" + ", ".join(str(d) for d in x.shape) + "]"


def check_tensor(fn: str, name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}; wrap it with torch.as_tensor")
    return x


def check_token_tensor(fn: str, name: str, x: object, like: Tensor | None = None, *, floating: bool = True) -> Tensor:
    """A per-token tensor: 2-D `[B, T]`, floating point, and the same shape as `like` if given."""
    x = check_tensor(fn, name, x)
    if x.dim() != 2:
        hint = " (a per-sequence [B] tensor? expand it with x[:, None].expand(B, T) if that is what you mean)" if x.dim() == 1 else ""
        raise ValueError(f"{fn}: {name} must be a per-token tensor [B, T], got shape {_shape(x)}{hint}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{fn}: {name} must be floating point, got {x.dtype}; cast it with .float()")
    if like is not None and x.shape != like.shape:
        raise ValueError(f"{fn}: {name} has shape {_shape(x)} but must match {_shape(like)}; pass tensors of one [B, T] layout")
    if like is not None and x.device != like.device:
        raise ValueError(f"{fn}: {name} is on {x.device} but the other inputs are on {like.device}; move it with .to()")
    return x


def check_seq_tensor(fn: str, name: str, x: object, batch: int, *, floating: bool = True) -> Tensor:
    """A per-sequence tensor: 1-D `[B]`."""
    x = check_tensor(fn, name, x)
    if x.dim() != 1 or x.shape[0] != batch:
        raise ValueError(f"{fn}: {name} must be a per-sequence tensor [B] with B={batch}, got shape {_shape(x)}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{fn}: {name} must be floating point, got {x.dtype}; cast it with .float()")
    return x


def check_mask(fn: str, name: str, mask: object, like: Tensor) -> Tensor:
    """A `[B, T]` mask with values in {0, 1}; returned as bool."""
    mask = check_tensor(fn, name, mask)
    if mask.shape != like.shape:
        raise ValueError(f"{fn}: {name} has shape {_shape(mask)} but the values have shape {_shape(like)}; "
                         "the mask must cover the same [B, T] positions")
    if mask.dtype != torch.bool:
        if _VALUE_CHECKS.get() and not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{fn}: {name} must hold only 0 and 1 (or be bool); got other values")
        mask = mask != 0
    return mask


def check_finite(fn: str, name: str, x: Tensor, mask: Tensor | None = None) -> None:
    """Non-finite values are refused at valid positions; at masked positions they are allowed (and ignored)."""
    if not _VALUE_CHECKS.get():
        return
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & mask
    if bool(bad.any()):
        where = "at valid (unmasked) positions " if mask is not None else ""
        raise ValueError(f"{fn}: {name} holds {int(bad.sum())} non-finite value(s) {where}"
                         "(NaN or inf); find where they come from (a log of 0, an overflow) before calling")


def check_nonempty(fn: str, name: str, x: Tensor) -> None:
    if x.shape[0] == 0:
        raise ValueError(f"{fn}: {name} is empty (B=0); pass at least one sequence")


def check_positive(fn: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{fn}: {name} must be {bound}, got {value}")


def check_unit_interval(fn: str, name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{fn}: {name} must lie in [0, 1], got {value}")


def check_choice(fn: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{fn}: {name}={value!r} is not one of {', '.join(map(repr, choices))}")
