"""Reward functions of your own (`--reward.fn`): loading them, calling them, and checking what they return.

    table = RewardTable.from_specs(["my_reward.py:score", "openai/gsm8k=judge.py:compute_score"])
    fn = table.resolve("openai/gsm8k")                        # the judge: a data-source plug-in wins
    result = normalize_result(fn.call(response, prompt), fn_name=fn.name, data_source="openai/gsm8k", index=3)

A spec is `PATH.py:NAME` (a file, relative to the current directory or absolute), `package.module:NAME`,
or either of these behind `DATA_SOURCE=` to score only that data source. Two signatures are accepted:

* verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, so a verl reward file
  works unchanged (recognised by a first parameter named `data_source` or a parameter named
  `solution_str`; `extra_info` is passed only when the function accepts it);
* `(response, ground_truth, **row) -> float`: the row's fields come as keywords: `data_source`,
  `extra_info`, `prompt` (the prompt text), `index`, and the row's other top-level fields
  (`Prompt.fields`). Only the keywords the function names are passed, all of them when it has `**kwargs`.

Either may be `async def` (the scorer runs it on its event loop, see `asyncrl.data.scoring`). A reward
returns a number (int, float, bool, a numpy scalar, a 0-dim tensor) or a dict with a `score` and further
numeric entries (logged as extras; other entries are ignored): `asyncrl.rewards.result` checks that.

Which function scores a data source: its `DATA_SOURCE=` plug-in, else the one plug-in without a prefix
(it scores every data source, as verl's `custom_reward_function` does), else the built-in reward
(`asyncrl.rewards.registry.BUILTIN_REWARDS`).
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import types
from typing import Any, Callable, Iterable, Literal, Mapping

from asyncrl.rewards.registry import BUILTIN_REWARDS
from asyncrl.rewards.result import RewardResult, RewardValueError, normalize_result
from asyncrl.types import Prompt
from asyncrl.tools.user_code import load_object, short_repr

__all__ = [
    "RewardFunction", "RewardResult", "RewardValueError", "RewardTable", "load_reward", "wrap_reward",
    "builtin_reward", "normalize_result", "parse_reward_spec", "absolute_reward_spec", "row_keywords",
]

Style = Literal["verl", "asyncrl"]

FLAG = "--reward.fn"
SIGNATURES = ("verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) or "
              "(response, ground_truth, **row) -> float")


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A reward function with what is needed to call it for one completion (`call`)."""

    fn: Callable[..., Any]
    name: str
    """For messages and logs: `my_reward.py:score`, `pkg.mod:score`, or the function's module:qualname."""
    style: Style
    is_async: bool
    spec: str = ""
    """The `--reward.fn` spec it was loaded from ('' when it was not loaded from one)."""
    keywords: frozenset[str] | None = frozenset()
    """Row keywords it accepts (verl style: whether `extra_info` is among them); None: all (`**kwargs`)."""
    positional: tuple[str, ...] = ()
    """Names of its two positional parameters (asyncrl style), never passed again as row keywords."""

    def call(self, response: str, prompt: Prompt) -> Any:
        """The function's raw result for `response` to `prompt` (an awaitable when `is_async`)."""
        if self.style == "verl":
            kwargs = {"data_source": prompt.data_source, "solution_str": response, "ground_truth": prompt.ground_truth}
            if self.keywords is None or "extra_info" in self.keywords:
                kwargs["extra_info"] = prompt.extra_info
            return self.fn(**kwargs)
        row = row_keywords(prompt)
        if self.keywords is None:
            row = {k: v for k, v in row.items() if k not in self.positional}
        else:
            row = {k: v for k, v in row.items() if k in self.keywords}
        return self.fn(response, prompt.ground_truth, **row)


def row_keywords(prompt: Prompt) -> dict[str, Any]:
    """The keywords an asyncrl-style reward may take: the row's other top-level fields, then `data_source`,
    `extra_info`, `prompt` (the text) and `index` (these four win over a top-level field of the same name)."""
    return {**prompt.fields, "data_source": prompt.data_source, "extra_info": prompt.extra_info,
            "prompt": prompt.text, "index": prompt.index}


# ------------------------------------------------------------------------------------------- signatures


def _callable_name(fn) -> str:
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or '?'}:{qualname}"


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _analyse(fn) -> tuple[Style, frozenset[str] | None, tuple[str, ...]]:
    """(style, keywords, positional names) of `fn`; raises ValueError saying why the signature is not supported."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise ValueError(f"its signature cannot be read ({err})") from None
    params = list(signature.parameters.values())
    names = [p.name for p in params]
    has_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if (names and names[0] == "data_source") or "solution_str" in names:
        keywords = None if has_kwargs else frozenset({"extra_info"} & set(names))
        extra = ("extra_info",) if keywords is None or "extra_info" in keywords else ()
        probe = dict.fromkeys(("data_source", "solution_str", "ground_truth", *extra))
        try:
            signature.bind(**probe)
        except TypeError as err:
            raise ValueError(f"it looks like verl's compute_score but cannot be called with keywords data_source, "
                             f"solution_str, ground_truth ({err})") from None
        return "verl", keywords, ()
    try:
        bound = signature.bind_partial(None, None)
    except TypeError:
        raise ValueError("it does not take two positional arguments (response, ground_truth)") from None
    rest = [p for p in params if p.name not in bound.arguments and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    stuck = [p.name for p in rest if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty]
    if stuck:
        raise ValueError(f"its positional-only parameter(s) {', '.join(stuck)} cannot be given")
    by_name = [p.name for p in rest if p.kind is not inspect.Parameter.POSITIONAL_ONLY]
    keywords = None if has_kwargs else frozenset(by_name)
    return "asyncrl", keywords, tuple(bound.arguments)


def wrap_reward(fn: Callable[..., Any], *, name: str | None = None, spec: str = "") -> RewardFunction:
    """`fn` as a RewardFunction, its style (verl or asyncrl) read from its signature.

    Raises:
      ValueError: `fn` is not callable, or its signature is neither of the two accepted (says why).
    """
    if not callable(fn):
        raise ValueError(f"{name or short_repr(fn)} is not callable (it is {type(fn).__name__})")
    style, keywords, positional = _analyse(fn)
    return RewardFunction(fn=fn, name=name or _callable_name(fn), style=style, is_async=_is_async(fn), spec=spec,
                          keywords=keywords, positional=positional)


def builtin_reward(fn: Callable[[str, str], Any]) -> RewardFunction:
    """A `(response, ground_truth)` reward (a built-in, or a value of a plain mapping given to the scorer):
    called with those two arguments and no row keywords."""
    return RewardFunction(fn=fn, name=_callable_name(fn), style="asyncrl", is_async=_is_async(fn))


# ------------------------------------------------------------------------------------------------ loading


def _problem(spec: str, what: str) -> ValueError:
    return ValueError(f"{FLAG} {spec!r}: {what}")


def _signature(fn, name: str) -> str:
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return f"{name}(?)"


def load_reward(spec: str) -> RewardFunction:
    """The reward function named by `PATH.py:NAME` or `package.module:NAME` (no `DATA_SOURCE=` prefix).

    Raises:
      ValueError: one message naming `--reward.fn`, the spec, what is wrong and the fix: no `:NAME`, no such
        file or module, the import raises (type, message and file:line), no such name (the callables the
        module defines are listed), not callable, or an unsupported signature.
    """
    fn, shown = load_object(spec, flag=FLAG, kind="reward function", example="my_reward.py:compute_score",
                            preferred="compute_score")
    name = spec.rpartition(":")[2]
    shown = shown.rpartition(":")[0]
    try:
        style, keywords, positional = _analyse(fn)
    except ValueError as err:
        raise _problem(spec, f"{shown}:{name} has an unsupported signature {_signature(fn, name)}: {err}; "
                             f"accepted: {SIGNATURES}") from None
    return RewardFunction(fn=fn, name=f"{shown}:{name}", style=style, is_async=_is_async(fn), spec=spec,
                          keywords=keywords, positional=positional)


# ---------------------------------------------------------------------------------------------- the table


def parse_reward_spec(text: str) -> tuple[str | None, str]:
    """(data_source or None, `PATH.py:NAME` / `module:NAME`) of one `--reward.fn` item.

    `DATA_SOURCE=` is read as a prefix when the text before the first '=' holds no ':' and no '/', or holds a
    '/' (as in `openai/gsm8k=`) while the whole text, up to its last ':', is not an existing file.
    """
    head, sep, tail = text.partition("=")
    if not sep or ":" in head:
        return None, text
    if "/" in head and pathlib.Path(text.rpartition(":")[0]).expanduser().is_file():
        return None, text
    return head, tail


def absolute_reward_spec(text: str) -> str:
    """The `--reward.fn` item with its file made absolute (processes started elsewhere find it too)."""
    source, target = parse_reward_spec(text)
    path, sep, name = target.rpartition(":")
    if sep and path.endswith(".py") and pathlib.Path(path).expanduser().is_file():
        target = f"{pathlib.Path(path).expanduser().resolve()}:{name}"
    return target if source is None else f"{source}={target}"


@dataclasses.dataclass(frozen=True)
class RewardTable:
    """Which reward function scores each data source: plug-ins over the built-ins."""

    plugins: Mapping[str, RewardFunction] = dataclasses.field(default_factory=dict)
    """data_source -> the plug-in given for it (`DATA_SOURCE=PATH.py:NAME`)."""
    default_plugin: RewardFunction | None = None
    """The plug-in without a prefix: scores every data source without a plug-in of its own."""
    builtins: Mapping[str, RewardFunction] = dataclasses.field(default_factory=dict)
    """data_source -> reward used when no plug-in applies."""

    @classmethod
    def from_specs(cls, specs: Iterable[str] = (), *,
                   builtins: Mapping[str, Callable | RewardFunction] = BUILTIN_REWARDS) -> RewardTable:
        """Load the `--reward.fn` items (`PATH.py:NAME`, `module:NAME`, `DATA_SOURCE=PATH.py:NAME`) over `builtins`
        (`(response, ground_truth)` functions, or RewardFunctions used as they are).

        Raises:
          ValueError: a spec fails to load (`load_reward`), two specs lack a prefix, or two name one data source.
        """
        plugins, default, default_spec = {}, None, None
        for text in specs:
            data_source, target = parse_reward_spec(text)
            if data_source == "":
                raise _problem(text, "nothing before '='; write DATA_SOURCE=PATH.py:NAME or just PATH.py:NAME")
            if data_source is None and default is not None:
                raise ValueError(f"{FLAG}: two reward functions for every data source ({default_spec!r} and "
                                 f"{text!r}); keep one, or prefix the others with their data source "
                                 "(DATA_SOURCE=PATH.py:NAME)")
            if data_source is not None and data_source in plugins:
                raise ValueError(f"{FLAG}: two reward functions for data_source {data_source!r} "
                                 f"({plugins[data_source].spec!r} and {text!r}); keep one")
            fn = dataclasses.replace(load_reward(target), spec=text)
            if data_source is None:
                default, default_spec = fn, text
            else:
                plugins[data_source] = fn
        wrapped = {source: fn if isinstance(fn, RewardFunction) else builtin_reward(fn)
                   for source, fn in builtins.items()}
        return cls(types.MappingProxyType(plugins), default, types.MappingProxyType(wrapped))

    @property
    def known(self) -> list[str]:
        """The data sources with a reward of their own (sorted)."""
        return sorted({*self.plugins, *self.builtins})

    def get(self, data_source: str) -> RewardFunction | None:
        """The reward for `data_source`, or None when nothing scores it."""
        return self.plugins.get(data_source) or self.default_plugin or self.builtins.get(data_source)

    def resolve(self, data_source: str, *, row: int | None = None, file: str | None = None) -> RewardFunction:
        """The reward for `data_source`; raises ValueError (naming the row and file when given) when there is none."""
        fn = self.get(data_source)
        if fn is not None:
            return fn
        where = [f"row {row}"] if row is not None else []
        where += [f"of {file}" if row is not None else file] if file else []
        place = f" ({' '.join(where)})" if where else ""
        raise ValueError(f"no reward for data_source {data_source!r}{place}: known data sources: "
                         f"{', '.join(self.known) or 'none'}; pass {FLAG} PATH.py:NAME (every data source) or "
                         f"{FLAG} '{data_source}=PATH.py:NAME' (this one only)")

    def missing(self, data_sources: Iterable[str]) -> list[str]:
        """The distinct data sources among `data_sources` that nothing scores (sorted), for up-front checks."""
        return sorted({source for source in data_sources if self.get(source) is None})
