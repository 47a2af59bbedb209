"""The package's public API (`asyncrl/__init__.py`): every name of `__all__` resolves to the object of its home
module, and importing the package imports nothing at all of the library or of torch (each name is imported
when first used)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import asyncrl
import asyncrl.config
import asyncrl.launch.train
import asyncrl.runtime.controller
import asyncrl.types
from tests.test_import_graph import runtime_imports


def test_every_public_name_is_its_home_modules_object():
    for name in asyncrl.__all__:
        assert getattr(asyncrl, name) is not None, name
    assert asyncrl.train is asyncrl.launch.train.train
    assert asyncrl.RunSummary is asyncrl.runtime.controller.RunSummary
    assert asyncrl.PRESETS is asyncrl.config.PRESETS and asyncrl.GRPO is asyncrl.config.GRPO
    assert asyncrl.Group is asyncrl.types.Group
    for package in ("algos", "checkpoint", "config", "data", "envs", "learner", "policies", "rewards", "types"):
        assert getattr(asyncrl, package).__name__ == f"asyncrl.{package}"
    assert set(asyncrl.__all__) <= set(dir(asyncrl))
    assert len(asyncrl.__all__) == len(set(asyncrl.__all__))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'asyncrl' has no attribute 'Trainer'"):
        asyncrl.Trainer  # noqa: B018


def test_importing_the_package_runs_only_standard_library_imports():
    source = pathlib.Path(asyncrl.__file__).read_text()
    imported = set()
    for node, _ in runtime_imports(ast.parse(source)):  # TYPE_CHECKING imports never run
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
        imported |= {name.split(".")[0] for name in names}
    assert imported == {"__future__", "importlib", "typing"}, imported
