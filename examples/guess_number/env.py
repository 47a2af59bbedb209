"""Guess a number from 1 to 20 with higher/lower hints: an environment of your own for `--env.fn`.

    asyncrl train cpu-demo --data.path examples/guess_number/data.jsonl --env.fn examples/guess_number/env.py:Guess

One `Guess` lives for one episode. After each model turn `step` reads the last number in the turn and
answers "Higher." or "Lower." (appended as a user message, never trained), or ends the episode with reward
0.7 ** (turns before the right guess): a model that halves the interval scores more than one that counts.
"""

import re

from asyncrl.envs import StepResult, Turn
from asyncrl.types import Prompt

NUMBER = re.compile(r"-?\d+")


class Guess:
    def __init__(self, prompt: Prompt):
        self.target = int(prompt.ground_truth)

    def step(self, turn: Turn) -> StepResult:
        found = NUMBER.findall(turn.text)
        if not found:
            return StepResult(observation="Reply with one whole number from 1 to 20.", reward=0.0)
        guess = int(found[-1])
        if guess == self.target:
            return StepResult(reward=0.7 ** turn.index, done=True)
        return StepResult(observation="Higher." if guess < self.target else "Lower.", reward=0.0)
