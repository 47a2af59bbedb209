"""Environments that live in a worker process: an episode's environment object is made, stepped and closed
there, so that a synchronous `step` that hangs can be cut off (its worker is killed) while the rollout process
goes on. These are the calls a worker runs (`fn(state, *args)`, see `asyncrl.rpc.worker_pool`); the worker's
`state` holds the loaded environment classes and the live environment of each episode, by episode key.

Which environments go there (`runs_isolated`): your own (`--env.fn PATH.py:NAME`) unless its `step` is
`async def` (those run on the episode loop, which names a step that blocks it). The built-in ones are bounded
and eval-free and run in the rollout process.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from asyncrl.envs.builtin import BUILTIN_ENVS
from asyncrl.envs.protocol import EnvFactory, StepResult, Turn
from asyncrl.envs.registry import load_env
from asyncrl.types import Prompt

__all__ = ["runs_isolated", "open_env", "step_env", "close_env"]


def runs_isolated(spec: str, factory: EnvFactory) -> bool:
    """Whether episodes of `--env.fn spec` run in worker processes (see the module docstring)."""
    if spec in BUILTIN_ENVS:
        return False
    step = getattr(factory, "step", None) if isinstance(factory, type) else None
    return not inspect.iscoroutinefunction(step)


def open_env(state: dict, spec: str, key: str, prompt: Prompt) -> None:
    """Make episode `key`'s environment from its prompt row."""
    factories = state.setdefault("env_factories", {})
    if spec not in factories:
        factories[spec] = load_env(spec)
    state.setdefault("envs", {})[key] = factories[spec](prompt)


def step_env(state: dict, key: str, turn: Turn) -> StepResult | Any:
    """Episode `key`'s step after `turn` (an awaitable step runs on the worker's own event loop)."""
    result = state["envs"][key].step(turn)
    if inspect.isawaitable(result):
        loop = state.get("loop")
        if loop is None:
            loop = state["loop"] = asyncio.new_event_loop()
        result = loop.run_until_complete(result)
    return result


def close_env(state: dict, key: str) -> None:
    """Episode `key` ended: its environment's `close()`, when it has one; the object is dropped either way."""
    env = state.get("envs", {}).pop(key, None)
    close = getattr(env, "close", None)
    if callable(close):
        close()
