"""Rewards of the procedural tasks in `asyncrl.data.tasks`.

Model output is read with bounded, eval-free code (`asyncrl.rewards.bounded_arithmetic`): digits are ASCII
only ('٤٢' is not 42), and no response, however long or hostile, takes more than a few milliseconds to score.
"""

from __future__ import annotations

import re

from asyncrl.rewards.bounded_arithmetic import (COUNTDOWN_OPERATORS, MAX_CHARS, compare_integer_text,
                                                evaluate_arithmetic)

__all__ = ["arithmetic_reward", "countdown_reward", "even_token_reward"]

_INTEGER = re.compile(r"-?[0-9]+")
_COUNTDOWN_CHARS = re.compile(r"[0-9\s+\-*()]+")


def arithmetic_reward(response: str, ground_truth: str) -> float:
    """1 if the last integer in the response (ASCII digits, commas ignored) equals the ground truth, else 0."""
    found = _INTEGER.findall(response.replace(",", ""))
    return 1.0 if found and compare_integer_text(found[-1], int(ground_truth)) == 0 else 0.0


def countdown_reward(response: str, ground_truth: str) -> float:
    """1 if the response's last line is an expression over exactly the given numbers that equals the target.

    ground_truth: "target|n1 n2 n3". The expression (before any "=") may hold ASCII digits, spaces, + - * and
    parentheses; it is evaluated by `evaluate_arithmetic` (no `**`, at most MAX_CHARS characters), so an
    expression it refuses scores 0.
    """
    target, numbers = ground_truth.split("|")
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    if not lines:
        return 0.0
    expression = lines[-1].split("=")[0].strip()
    if len(expression) > MAX_CHARS or not _COUNTDOWN_CHARS.fullmatch(expression):
        return 0.0
    used = sorted(int(n) for n in re.findall(r"[0-9]+", expression))  # at most MAX_CHARS digits each
    if used != sorted(int(n) for n in numbers.split()):
        return 0.0
    try:
        return 1.0 if evaluate_arithmetic(expression, operators=COUNTDOWN_OPERATORS) == int(target) else 0.0
    except ValueError:
        return 0.0


def even_token_reward(response: str, ground_truth: str = "") -> float:
    """Fraction of even token ids in a response given as space-separated ids (the toy task)."""
    ids = [int(t) for t in response.split()]
    return sum(t % 2 == 0 for t in ids) / len(ids) if ids else 0.0
