"""Tool calling: parse the calls a model wrote in its chat template's format, run the tools, answer with
tool messages.

    class MyTools(ToolEnv):
        tools = (calculator, search)         # plain functions with type hints and a Google-style docstring

Prompts are rendered with the tools' JSON schemas (`apply_chat_template(tools=...)`, from
`transformers.utils.get_json_schema`), so a model whose template knows tools (Qwen2.5, Llama 3.1+) is told
about them the way it was trained. Two call formats are read:

  Qwen / Hermes:   <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>
                   (any number of them in one turn)
  Llama 3.x JSON:  the whole turn is {"name": "calculator", "parameters": {"expression": "2 + 3"}}
                   (optionally after <|python_tag|>)

A malformed call (bad JSON, no name, arguments that are not an object, an unknown tool, wrong arguments, a
tool that raises) becomes an error message the model reads as the tool's answer and is counted in
`tool_errors`; it never ends the run. A turn without calls ends the episode: it is the final answer, scored
by the data source's reward function. Hostile text is answered too, never raised: JSON nested past Python's
recursion limit or holding a 5000-digit number is a malformed call, and an error message quotes at most 200
characters of what the model wrote.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, ClassVar, Sequence

from asyncrl.envs.protocol import StepResult, Turn
from asyncrl.rewards.bounded_arithmetic import evaluate_arithmetic
from asyncrl.types import Prompt

__all__ = ["ToolCall", "parse_tool_calls", "tool_schemas", "ToolEnv", "calculator"]

_TAGGED = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
_QUOTE_CHARS = 200


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def _short(text: str) -> str:
    """`text` cut to _QUOTE_CHARS characters, for an error message the model reads."""
    return text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS - 3] + "..."


def _json(text: str, what: str) -> Any:
    """json.loads, with every failure (bad syntax, nesting past the recursion limit, a number of more digits
    than int() takes) as one ValueError naming `what`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} is not valid JSON ({err.msg} at character {err.pos})") from None
    except RecursionError:
        raise ValueError(f"{what} nests too deeply to be read") from None
    except ValueError as err:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise ValueError(f"{what} cannot be read: {_short(str(err))}") from None


def _call_from_json(text: str) -> ToolCall:
    """One call from its JSON text; ValueError saying what is wrong."""
    raw = _json(text, "the tool call")
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ValueError('a tool call must be a JSON object with a "name" string')
    name = _short(raw["name"])
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if isinstance(arguments, str):  # some templates carry the arguments as a JSON string
        try:
            arguments = _json(arguments, "the arguments")
        except ValueError:
            raise ValueError(f'the "arguments" of {name!r} are not a JSON object') from None
    if not isinstance(arguments, dict):
        raise ValueError(f'the "arguments" of {name!r} must be a JSON object')
    return ToolCall(raw["name"], arguments)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The tool calls in a model turn and the problems of the malformed ones: (calls, errors)."""
    calls, errors = [], []
    tagged = list(_TAGGED.finditer(text))
    for match in tagged:
        if not match.group(2):
            errors.append("a <tool_call> was opened but not closed with </tool_call>")
            continue
        try:
            calls.append(_call_from_json(match.group(1).strip()))
        except ValueError as err:
            errors.append(str(err))
    if tagged:
        return calls, errors
    bare = text.strip().removeprefix("<|python_tag|>").strip()
    if bare.startswith("{") and '"name"' in bare:
        try:
            calls.append(_call_from_json(bare))
        except ValueError as err:
            errors.append(str(err))
    return calls, errors


def tool_schemas(tools: Sequence[Callable]) -> list[dict]:
    """JSON schemas of the tools, as chat templates take them (from type hints and docstrings)."""
    from transformers.utils import get_json_schema
    return [get_json_schema(tool) for tool in tools]


class ToolEnv:
    """An environment of tools: each turn's calls are run and answered; a turn without calls ends the episode.

    Subclass it and set `tools`; `__init__` receives the episode's Prompt (kept as `self.prompt`)."""

    tools: ClassVar[Sequence[Callable]] = ()

    def __init__(self, prompt: Prompt):
        self.prompt = prompt
        self._by_name = {tool.__name__: tool for tool in self.tools}

    def step(self, turn: Turn) -> StepResult:
        calls, errors = parse_tool_calls(turn.text)
        if not calls and not errors:
            return StepResult(done=True)
        messages = [{"role": "tool", "content": f"error: {problem}"} for problem in errors]
        failed = len(errors)
        for call in calls:
            content, ok = self.run(call)
            failed += not ok
            messages.append({"role": "tool", "name": call.name, "content": content})
        return StepResult(observation=messages, tool_calls=len(calls) + len(errors), tool_errors=failed)

    def run(self, call: ToolCall) -> tuple[str, bool]:
        """(what the tool answered or why it failed, whether it succeeded)."""
        tool = self._by_name.get(call.name)
        if tool is None:
            return f"error: no tool named {_short(call.name)!r}; the tools are {sorted(self._by_name)}", False
        try:
            return str(tool(**call.arguments)), True
        except TypeError as err:  # the message may quote an argument name the model made up: shortened
            return f"error: wrong arguments for {call.name}: {_short(str(err))}", False
        except Exception as err:  # noqa: BLE001 - a tool's failure is the model's observation, not a crash
            return f"error: {call.name} raised {type(err).__name__}: {_short(str(err))}", False


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 4".
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, not {type(expression).__name__}")
    # bounded and eval-free (asyncrl.rewards.bounded_arithmetic): at most 1000 characters, 50 levels of nesting,
    # results below 2**1024; what it refuses raises ValueError, which ToolEnv.run answers as an error message
    value = evaluate_arithmetic(expression.replace(",", ""))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)
