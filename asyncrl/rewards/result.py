"""What a reward function returns, checked: a finite score and numeric extras.

    normalize_result(0.5, fn_name="my_reward.py:score", data_source="x", index=3)   # RewardResult(0.5, {})
    normalize_result({"score": 1, "acc": True, "pred": "72"}, ...)                  # RewardResult(1.0, {"acc": 1.0})

A reward returns a number (int, float, bool, a numpy scalar, a 0-dim tensor) or a dict with a `score` and
further entries; numeric, finite entries become extras (logged, not trained on), others (verl's strings)
are ignored. NaN, inf and anything else raise `RewardValueError`, naming the function, data source and row.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

__all__ = ["RewardResult", "RewardValueError", "normalize_result"]


class RewardValueError(ValueError):
    """A reward function returned something that is not a finite score (NaN, inf, a string, ...)."""


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """One completion's reward: the score that is trained on, and numeric extras that are only logged."""

    score: float
    extras: dict[str, float] = dataclasses.field(default_factory=dict)


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _number(value) -> float | None:
    """`value` as a float when it is a real number (bools, numpy scalars and 0-dim tensors included), else None."""
    if isinstance(value, str):
        return None
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if not isinstance(value, (bool, numbers.Real)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float range
        return math.inf if value > 0 else -math.inf


def normalize_result(raw: Any, *, fn_name: str, data_source: str, index: int) -> RewardResult:
    """A reward function's raw result as a RewardResult.

    A number becomes the score; a dict gives its `score` and its other numeric, finite entries as extras
    (other entries, such as verl's strings, are ignored).

    Raises:
      RewardValueError: the score is NaN or infinite, or not a number (naming the function, data_source and row).
    """
    where = f"for data_source={data_source!r}, row {index}"
    extras = {}
    value = raw
    if isinstance(raw, Mapping):
        if "score" not in raw:
            keys = ", ".join(map(str, raw)) or "none"
            raise RewardValueError(f"{fn_name} returned a dict without 'score' (keys: {keys}) {where}; "
                                   "put the reward under 'score'")
        value = raw["score"]
        for key, extra in raw.items():
            number = _number(extra)
            if key != "score" and number is not None and math.isfinite(number):
                extras[str(key)] = number
    score = _number(value)
    if score is None:
        raise RewardValueError(f"{fn_name} returned {_short(value)} ({type(value).__name__}), not a number, {where}; "
                               "return a float or a dict with a 'score'")
    if not math.isfinite(score):
        raise RewardValueError(f"{fn_name} returned {score} {where}")
    return RewardResult(score, extras)
