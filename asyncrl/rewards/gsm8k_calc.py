"""GSM8K-calc reward (data_source "gsm8k-calc", rows from `asyncrl data convert-gsm8k-calc`).

    gsm8k_calc_reward("48/2 = 24.0", "24")        # 1.0: the same number
    gsm8k_calc_reward("It costs $1,000.", "1000")  # 1.0
    gsm8k_calc_reward("0.33", "0.3")              # 0.0

The answer is the last number of the response, found by GSM8K's flexible extractor (`extract_gsm8k_answer`: the
last 300 characters only, ASCII digits, "," "$" and a trailing "." removed), and it must equal the ground truth
exactly as a number: both are read as `Fraction`s, so "24", "24.0" and "24.00" are one number and 0.1 + 0.2 is
not an issue. Reading at most 300 characters of digits costs microseconds, whatever the response.
"""

from __future__ import annotations

import re
from fractions import Fraction

from asyncrl.rewards.gsm8k import extract_gsm8k_answer

__all__ = ["gsm8k_calc_reward"]

_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")


def _exact(text: str) -> Fraction | None:
    """The decimal number `text` ("-12", "0.25", ".5", "24.") exactly, or None if it is not one."""
    return Fraction(text) if _DECIMAL.fullmatch(text) else None


def gsm8k_calc_reward(response: str, ground_truth: str) -> float:
    """1 if the last number in the response equals the ground truth as a number ("24.00", "$24" and "24." match
    "24"; "1,000" matches "1000"), else 0.

    Raises:
      ValueError: the ground truth is not a decimal number (make the rows with `asyncrl data convert-gsm8k-calc`).
    """
    truth = _exact(ground_truth.strip().replace(",", ""))
    if truth is None:
        raise ValueError(f"gsm8k_calc_reward: ground truth {ground_truth[:40]!r} is not a decimal number; make the "
                         "rows with `asyncrl data convert-gsm8k-calc`")
    answer = extract_gsm8k_answer(response, "flexible")
    return 1.0 if answer is not None and _exact(answer) == truth else 0.0
