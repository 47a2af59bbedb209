"""`asyncrl.tools.user_code.load_object` with a plug-in folder: the plug-in imports its siblings, and the folder never
shadows the standard library (its `queue.py`, `types.py` or `colorsys.py` stay the plug-in's own business)."""

from __future__ import annotations

import importlib.machinery
import sys
import textwrap

from asyncrl.tools.user_code import load_object

SHADOWS = ("queue", "types", "colorsys")  # colorsys: a standard module this process has not imported yet


def _plugin_folder(tmp_path):
    folder = tmp_path / "plugin"
    folder.mkdir()
    for name in SHADOWS:
        (folder / f"{name}.py").write_text(f"raise ImportError('the plug-in folder shadowed the standard {name}')\n")
    (folder / "helpers.py").write_text("BONUS = 0.5\n")
    (folder / "reward.py").write_text(textwrap.dedent("""
        import colorsys  # the standard library's, not the folder's colorsys.py
        import queue

        from helpers import BONUS  # a sibling module

        def score(response, ground_truth, **row):
            assert hasattr(queue, "SimpleQueue") and hasattr(colorsys, "rgb_to_hsv")
            return BONUS + (response == ground_truth)
    """))
    return folder


def test_a_plugin_imports_its_siblings_and_does_not_shadow_the_standard_library(tmp_path, monkeypatch):
    folder = _plugin_folder(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # undone after the test, like the modules below
    for name in ("colorsys", "helpers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    score, shown = load_object(f"{folder / 'reward.py'}:score", flag="--reward.fn", kind="reward function")
    assert shown == "reward.py:score" and score("4", "4") == 1.5
    assert sys.modules["helpers"].__file__ == str(folder / "helpers.py")
    # every later import in this process still finds the standard library first
    for name in SHADOWS:
        origin = importlib.machinery.PathFinder.find_spec(name).origin
        assert not origin.startswith(str(folder)), (name, origin)
    assert sys.path[-1] == str(folder)
