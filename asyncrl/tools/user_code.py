"""Importing the user's code named on the command line: `PATH.py:NAME` or `package.module:NAME`.

    fn, shown = load_object("my_reward.py:score", flag="--reward.fn", kind="reward function")

Every failure is one ValueError naming the flag, the spec, what is wrong and the fix: no `:NAME`, no such file
or module, the import raises (type, message and file:line), no such name (the module's callables are listed,
with the closest as a suggestion), or not callable. A file is imported under a name unique to its path, with
its directory appended to sys.path so that it may import its siblings (`import helpers` beside `reward.py`).
Appended, not prepended: a plug-in folder holding a `types.py` or `queue.py` must not shadow the standard
library or an installed package for the whole process; a sibling named like one of those is found after them.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import pathlib
import re
import sys
import traceback
import types
from typing import Any

__all__ = ["load_object", "is_file_spec", "short_repr"]

_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_file_spec(location: str) -> bool:
    """Whether the part before ':NAME' names a file (else a module)."""
    return location.endswith(".py") or "/" in location


def short_repr(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _raised_at(err: BaseException) -> str:
    """`file:line` where `err` was raised: the innermost frame outside the import machinery."""
    if isinstance(err, SyntaxError) and err.filename:
        return f"{err.filename}:{err.lineno}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<frozen")]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "an unknown place"


class _Loader:
    def __init__(self, spec: str, flag: str, kind: str):
        self.spec, self.flag, self.kind = spec, flag, kind

    def problem(self, what: str) -> ValueError:
        return ValueError(f"{self.flag} {self.spec!r}: {what}")

    def import_failed(self, what: str, err: BaseException) -> ValueError:
        message = err.msg if isinstance(err, SyntaxError) else str(err)
        message = " ".join(str(message).split()) or "(no message)"
        if isinstance(err, ModuleNotFoundError) and err.name:
            fix = f"install {err.name!r} into this environment ({sys.executable})"
        else:
            fix = "fix it so that the import succeeds"
        return self.problem(f"importing {what} raised {type(err).__name__}: {message} (at {_raised_at(err)}); {fix}")

    def load_file(self, location: str) -> tuple[types.ModuleType, str]:
        given = pathlib.Path(location).expanduser()
        path = given if given.is_absolute() else pathlib.Path.cwd() / given
        if not path.is_file():
            state = "is a directory" if path.is_dir() else "does not exist"
            raise self.problem(f"{path} {state}; give the {self.kind}'s file path, relative to the current "
                               f"directory ({pathlib.Path.cwd()}) or absolute")
        path = path.resolve()
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
        module_name = f"asyncrl_user_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"
        if module_name in sys.modules:  # the same file named twice (a reward and an environment): import it once
            return sys.modules[module_name], path.name
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise self.problem(f"{path} cannot be imported as Python; give a .py file")
        module = importlib.util.module_from_spec(module_spec)
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))  # last: never ahead of the standard library (see the docstring)
        sys.modules[module_name] = module  # before running it: dataclasses and pickle look the module up
        try:
            module_spec.loader.exec_module(module)
        except (Exception, SystemExit) as err:
            sys.modules.pop(module_name, None)
            raise self.import_failed(str(path), err) from None
        return module, path.name

    def load_module(self, location: str) -> types.ModuleType:
        if not _MODULE_NAME.fullmatch(location):
            raise self.problem(f"{location!r} is neither an existing .py file nor a module name; give "
                               "PATH.py:NAME or package.module:NAME")
        try:
            return importlib.import_module(location)
        except ModuleNotFoundError as err:
            if err.name and (location == err.name or location.startswith(err.name + ".")):
                missing = "" if err.name == location else f" (Python cannot find {err.name!r})"
                raise self.problem(f"no module named {location!r}{missing}; install it, add its directory to "
                                   "PYTHONPATH, or give the file instead (PATH.py:NAME)") from None
            raise self.import_failed(f"module {location!r}", err) from None
        except (Exception, SystemExit) as err:
            raise self.import_failed(f"module {location!r}", err) from None


def _defined_callables(module: types.ModuleType) -> list[str]:
    return sorted(name for name, value in vars(module).items() if not name.startswith("_") and callable(value)
                  and getattr(value, "__module__", None) == module.__name__)


def load_object(spec: str, *, flag: str, kind: str, example: str = "my_file.py:NAME",
                preferred: str | None = None) -> tuple[Any, str]:
    """(the callable `spec` names, how to show it: 'file.py:NAME' or 'module:NAME'). `preferred` is the name
    suggested when the one given is missing and nothing is close to it."""
    loader = _Loader(spec, flag, kind)
    location, sep, name = spec.rpartition(":")
    if not sep or not location or not name:
        raise loader.problem(f"no ':NAME' part; write PATH.py:NAME or package.module:NAME (e.g. {example})")
    if not name.isidentifier():
        raise loader.problem(f"{name!r} is not a Python name; after the last ':' give the {kind}'s name")
    if is_file_spec(location):
        module, shown = loader.load_file(location)
    else:
        module, shown = loader.load_module(location), location
    if not hasattr(module, name):
        found = _defined_callables(module)
        listing = f"it defines {', '.join(found)}" if found else "it defines no functions or classes"
        close = difflib.get_close_matches(name, found, n=1)
        guess = close[0] if close else preferred if preferred in found else found[0] if found else None
        fix = f"; did you mean {flag} {location}:{guess}?" if guess else ""
        raise loader.problem(f"{shown} has no {name!r}; {listing}{fix}")
    obj = getattr(module, name)
    if not callable(obj):
        raise loader.problem(f"{shown}:{name} is not callable (it is {type(obj).__name__} {short_repr(obj)}); "
                             f"point {flag} at {'an' if kind[0] in 'aeiou' else 'a'} {kind}")
    return obj, f"{shown}:{name}"
