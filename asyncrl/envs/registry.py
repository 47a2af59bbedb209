"""`--env.fn`: a built-in environment's name, or `PATH.py:NAME` / `package.module:NAME` of your own."""

from __future__ import annotations

from typing import Any

from asyncrl.envs.builtin import BUILTIN_ENVS
from asyncrl.envs.protocol import EnvFactory
from asyncrl.envs.tools import tool_schemas
from asyncrl.tools.user_code import load_object

__all__ = ["FLAG", "load_env", "env_tool_schemas"]

FLAG = "--env.fn"


def load_env(spec: str) -> EnvFactory:
    """The environment class (or factory) `spec` names.

    Raises:
      ValueError: naming --env.fn, the spec, what is wrong and the fix (see `asyncrl.tools.user_code.load_object`).
    """
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    if ":" not in spec:
        raise ValueError(f"{FLAG} {spec!r}: not a built-in environment ({', '.join(sorted(BUILTIN_ENVS))}) and no "
                         "':NAME' part; write PATH.py:NAME or package.module:NAME (e.g. my_env.py:Guess)")
    factory, _ = load_object(spec, flag=FLAG, kind="environment class", example="my_env.py:Guess")
    if isinstance(factory, type) and not callable(getattr(factory, "step", None)):
        raise ValueError(f"{FLAG} {spec!r}: {factory.__name__} has no step method; define "
                         "`def step(self, turn)` (or `async def step`) returning an asyncrl.envs.StepResult")
    return factory


def env_tool_schemas(factory: Any) -> list[dict] | None:
    """JSON schemas of the tools an environment class declares (`tools = (fn, ...)`), for rendering prompts."""
    tools = getattr(factory, "tools", None)
    if not tools:
        return None
    return tool_schemas(tools)
