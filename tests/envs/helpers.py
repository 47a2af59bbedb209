"""Shared pieces of the environment tests: token-level environments for the tiny random model (no
tokenizer), a runtime for them, and an engine wrapper that records every turn the engine generated.

Everything a RunSpec references lives at module level here, so it pickles into spawned processes."""

from __future__ import annotations

import asyncio
import time

from asyncrl.data.scoring import decode_ids
from asyncrl.envs import EnvRuntime, EpisodeRunner, StepResult, TokenRenderer, Turn
from asyncrl.policies import SamplingParams
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


def echo_runtime(*, workers=None) -> EnvRuntime:
    """The Echo environment's runtime (a picklable RunSpec.env_setup; Echo runs here, not in `workers`)."""
    return runtime(Echo)


def even_turns_runtime(*, workers=None) -> EnvRuntime:
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


def run_episodes(runner: EpisodeRunner, engine, prompts: list[Prompt], params: SamplingParams,
                 between_turns=None) -> dict:
    """Start every prompt, drive engine and runner until all groups are back; `between_turns(engine)` runs
    once, after the first turn finished and before its environment step is applied. The hang guard allows for
    an isolated environment's worker processes starting (each imports torch: ~3 s alone on 2 idle cores, a
    minute for several of them once the cores are shared with another test's processes)."""
    for p in prompts:
        runner.start(f"p{p.index}", p, params)
    groups, deadline, hooked = {}, time.monotonic() + limit(180), between_turns is None
    while len(groups) < len(prompts):
        assert time.monotonic() < deadline, "episodes did not end"
        for out in engine.step():
            assert runner.owns(out.request_id)
            runner.on_output(out)
            if not hooked:
                between_turns(engine)
                hooked = True
        for group in runner.poll():
            groups[group.key] = group
        time.sleep(0.001)
    assert not runner.busy
    return groups


def echo_episodes(engine, prompt_ids: list[int], n: int, seed: int) -> tuple[list, dict]:
    """Run one prompt's n Echo episodes on `engine` (in whatever process holds it); return the episodes'
    completions and every output the engine returned, by request id."""
    recording = Recording(engine)
    runner = EpisodeRunner(recording, runtime(Echo, max_turn_tokens=6))
    try:
        group = run_episodes(runner, recording, [Prompt(prompt_ids, index=0)],
                             SamplingParams(n=n, max_new_tokens=40, seed=seed, ignore_eos=True))["p0"]
    finally:
        runner.close()
    return group.completions, recording.outputs
