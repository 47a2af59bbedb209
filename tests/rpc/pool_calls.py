"""Calls that the worker pool tests run in worker processes (module level: a worker imports them by name)."""

from __future__ import annotations

import os
import threading


def add(state: dict, a: int, b: int) -> int:
    return a + b


def remember(state: dict, key: str, value: int) -> None:
    state[key] = value


def recall(state: dict, key: str) -> int:
    return state[key]


def tower(state: dict) -> int:
    """A power tower: one C call that holds the GIL for hours (nothing in its process can interrupt it)."""
    return 12 ** 11 ** 10


def raises(state: dict) -> None:
    raise ValueError("the judge is down")


def crashes(state: dict) -> None:
    os._exit(3)


def unpicklable(state: dict) -> threading.Lock:
    return threading.Lock()


def pid(state: dict) -> int:
    return os.getpid()
