"""What an environment is: the model's turn goes in, an observation, a reward and `done` come out.

    class Guess:                                  # any class (or function) called with each episode's Prompt
        def __init__(self, prompt: Prompt):
            self.target = int(prompt.ground_truth)

        def step(self, turn: Turn) -> StepResult:  # or `async def step`
            if turn.text.strip() == str(self.target):
                return StepResult(reward=1.0, done=True)
            return StepResult(observation="No. Try again.")

One environment object lives for one episode (one of a prompt's n samples). After every model turn the
runtime calls `step` — in a background event loop, never in the decode loop, cut off after
`--env.step-timeout-s` — and appends the observation's tokens (rendered once through the chat template,
never trained) before the next turn. `close()`, when the environment has one, is called when its episode ends.

Reward: the episode's reward is the sum of the rewards the environment returned. When every step returned
`reward=None`, the data source's reward function scores the decoded response instead (a tool environment
leaves the answer's scoring to the task: GSM8K with a calculator is scored by the GSM8K reward).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence, Union, runtime_checkable

from asyncrl.types import FinishReason, Prompt

__all__ = ["Turn", "StepResult", "Environment", "EnvFactory", "Observation"]

Observation = Union[str, Sequence[Mapping[str, Any]], Sequence[int], None]
"""What an environment answers with: a user message's text, chat messages (`{"role": "tool", "content": ...}`,
rendered through the chat template), raw token ids (appended as they are), or None (nothing)."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """The model's turn, as generated."""

    text: str
    """Decoded without special tokens (the stop token is not part of it)."""
    token_ids: tuple[int, ...]
    """Exactly the tokens the engine sampled, stop token included."""
    index: int
    """0 for the first turn of the episode."""
    finish_reason: FinishReason | None
    """'stop' (a stop token), 'length' (the turn's token budget ran out)."""


@dataclasses.dataclass
class StepResult:
    """What the environment says after a model turn."""

    observation: Observation = None
    """Appended before the next model turn (ignored when `done`)."""
    reward: float | None = None
    """Reward of this step; None: none (see the module docstring for how an episode is scored)."""
    done: bool = False
    """The episode is over (the runtime also ends it at `--env.max-turns` or the token budget)."""
    tool_calls: int = 0
    """Tool calls the model made in this turn (for the metrics)."""
    tool_errors: int = 0
    """Of those, the malformed ones, unknown tools and tools that raised."""


@runtime_checkable
class Environment(Protocol):
    def step(self, turn: Turn) -> StepResult | Awaitable[StepResult]: ...


EnvFactory = Callable[[Prompt], Environment]
"""Makes one episode's environment from its prompt row (an environment class is one)."""
