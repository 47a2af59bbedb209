"""Built-in environments, named on the command line like files are (`--env.fn retry`).

  retry        arithmetic with feedback: a wrong answer hears "Too high. Try again." (or too low, or no
               number) and answers again; the reward halves with each extra turn (1, 0.5, 0.25, ...). Rows
               need an integer ground truth (`--data.task arithmetic`). The answer is the last integer in
               ASCII digits, compared without building it (a 100,000-digit answer is just "too high").
  calculator   one tool, `calculator(expression)`; the final answer (a turn without a call) is scored by
               the data source's reward function (GSM8K with a calculator).
"""

from __future__ import annotations

import re

from asyncrl.envs.protocol import StepResult, Turn
from asyncrl.envs.tools import ToolEnv, calculator
from asyncrl.rewards.bounded_arithmetic import compare_integer_text
from asyncrl.types import Prompt

__all__ = ["RetryArithmetic", "Calculator", "BUILTIN_ENVS"]

_INTEGER = re.compile(r"-?[0-9]+")


class RetryArithmetic:
    """Answer, hear "too high" or "too low", answer again (reward 0.5 ** extra turns when right, else 0)."""

    def __init__(self, prompt: Prompt):
        try:
            self.answer = int(prompt.ground_truth)
        except ValueError:
            raise ValueError(f"the retry environment needs an integer ground truth, row {prompt.index} has "
                             f"{prompt.ground_truth!r}; use --data.task arithmetic") from None

    def step(self, turn: Turn) -> StepResult:
        found = _INTEGER.findall(turn.text.replace(",", ""))
        if not found:
            return StepResult(observation="No number. Try again.", reward=0.0)
        order = compare_integer_text(found[-1], self.answer)
        if order == 0:
            return StepResult(reward=0.5 ** turn.index, done=True)
        return StepResult(observation=f"Too {'high' if order > 0 else 'low'}. Try again.", reward=0.0)


class Calculator(ToolEnv):
    """A calculator tool; the answer is scored by the task's reward function."""

    tools = (calculator,)


BUILTIN_ENVS = {"retry": RetryArithmetic, "calculator": Calculator}
"""--env.fn names of the built-in environments."""
