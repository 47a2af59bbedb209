"""Rewards of the procedural tasks in `asyncrl.data.tasks`."""

from __future__ import annotations

import re

__all__ = ["arithmetic_reward", "countdown_reward", "even_token_reward"]

_NUMBER = re.compile(r"-?\d+")


def arithmetic_reward(response: str, ground_truth: str) -> float:
    """1 if the last integer in the response equals the ground truth, else 0."""
    found = _NUMBER.findall(response.replace(",", ""))
    return 1.0 if found and int(found[-1]) == int(ground_truth) else 0.0


def countdown_reward(response: str, ground_truth: str) -> float:
    """1 if the response's last line is an expression over exactly the given numbers that equals the target.

    ground_truth: "target|n1 n2 n3". Only digits, spaces and + - * ( ) are evaluated.
    """
    target, numbers = ground_truth.split("|")
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    if not lines:
        return 0.0
    expression = lines[-1].split("=")[0].strip()
    if not re.fullmatch(r"[\d\s+\-*()]+", expression):
        return 0.0
    used = sorted(int(n) for n in re.findall(r"\d+", expression))
    if used != sorted(int(n) for n in numbers.split()):
        return 0.0
    try:
        return 1.0 if eval(expression) == int(target) else 0.0  # noqa: S307 - validated above
    except SyntaxError:
        return 0.0


def even_token_reward(response: str, ground_truth: str = "") -> float:
    """Fraction of even token ids in a response given as space-separated ids (the toy task)."""
    ids = [int(t) for t in response.split()]
    return sum(t % 2 == 0 for t in ids) / len(ids) if ids else 0.0
