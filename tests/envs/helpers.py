"""Shared pieces of the environment tests: token-level environments for the tiny random model (no
tokenizer), a runtime for them, and an engine wrapper that records every turn the engine generated.

Everything a RunSpec references lives at module level here, so it pickles into spawned processes."""

from __future__ import annotations

import asyncio
import time

from asyncrl.data.scoring import decode_ids
from asyncrl.envs import EnvRuntime, StepResult, TokenRenderer, Turn
from asyncrl.types import GenerationOutput, Prompt
from tests.timing import limit

ENV_TOKENS = (60, 61)
"""What the token environments answer after turn t: (60 + t, 61)."""


class Echo:
    """Answers every turn with two tokens; done after the third turn; no reward (the reward function scores)."""

    def __init__(self, prompt: Prompt):
        self.prompt = prompt

    def step(self, turn: Turn) -> StepResult:
        if turn.index == 2:
            return StepResult(done=True)
        return StepResult(observation=[ENV_TOKENS[0] + turn.index, ENV_TOKENS[1]])


class AsyncEcho(Echo):
    """The same, as an `async def step` that waits a little (a remote tool)."""

    async def step(self, turn: Turn) -> StepResult:
        await asyncio.sleep(0.01)
        return Echo.step(self, turn)


class EvenTurns:
    """Rewards each turn by the share of even tokens the model sampled in it (the toy task, per turn)."""

    def __init__(self, prompt: Prompt):
        pass

    def step(self, turn: Turn) -> StepResult:
        ids = turn.token_ids
        reward = sum(t % 2 == 0 for t in ids) / max(len(ids), 1) / 2
        return StepResult(observation=[ENV_TOKENS[0] + turn.index, ENV_TOKENS[1]], reward=reward,
                          done=turn.index == 1)


class Raises(Echo):
    def step(self, turn: Turn) -> StepResult:
        if self.prompt.index % 2 == 1 and turn.index == 1:
            raise RuntimeError("the sandbox crashed")
        return super().step(turn)


class Garbage(Echo):
    def step(self, turn: Turn):
        if self.prompt.index % 2 == 1:
            return {"observation": "not a StepResult"}
        return super().step(turn)


class NaNReward(Echo):
    def step(self, turn: Turn) -> StepResult:
        if self.prompt.index % 2 == 1:
            return StepResult(reward=float("nan"), done=True)
        return super().step(turn)


class Hangs(Echo):
    def step(self, turn: Turn) -> StepResult:
        if self.prompt.index % 2 == 1:
            time.sleep(3.0)  # past the runtime's step timeout in these tests (a sync step cannot be cut off)
        return super().step(turn)


def runtime(factory=Echo, *, max_turns: int = 3, max_turn_tokens: int | None = 4,
            step_timeout_s: float | None = None) -> EnvRuntime:
    return EnvRuntime(factory, TokenRenderer(), decode_ids, max_turns=max_turns, max_turn_tokens=max_turn_tokens,
                      step_timeout_s=step_timeout_s if step_timeout_s is not None else limit(30))


def echo_runtime() -> EnvRuntime:
    """The Echo environment's runtime (a picklable RunSpec.env_setup)."""
    return runtime(Echo)


def even_turns_runtime() -> EnvRuntime:
    return runtime(EvenTurns, max_turns=2, max_turn_tokens=4)


class Recording:
    """Wraps an engine; keeps every output it returned (the turns as the engine generated them)."""

    def __init__(self, engine):
        self.inner = engine
        self.outputs: dict[str, GenerationOutput] = {}

    def step(self):
        outs = self.inner.step()
        for out in outs:
            self.outputs[out.request_id] = out
        return outs

    def __getattr__(self, name):
        return getattr(self.inner, name)
