"""Figures of the benchmark scripts, drawn where matplotlib is installed (a GPU image may lack it: the numbers
matter more than the figure)."""

from __future__ import annotations

import pathlib

__all__ = ["pyplot_or_none"]


def pyplot_or_none(path: pathlib.Path, tag: str, hint: str = ""):
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed (saying, prefixed
    `[tag]`, that `path` is not drawn, and `hint`)."""
    try:
        import matplotlib
    except ImportError:
        print(f"[{tag}] no matplotlib here: {path.name} not drawn{hint}", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
