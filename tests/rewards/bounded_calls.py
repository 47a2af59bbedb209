"""Calls that must return quickly, run in a forked child: a call that hangs fails its test instead of the suite.

    def test_it(bounded_worker):                       # the fixture: one child per test module
        outcome = bounded_worker.call(calculator, "9**9**9")
        assert outcome.seconds < limit(1.0)            # timed in the child, around the call alone

A hung call of the kind these tests look for holds the GIL inside one C function (a huge `**`, `int()` of a
long string, a backtracking regex), where neither signals nor pytest-timeout reach it. So each call runs in a
child process; the parent waits at most `limit(HANG_S)` for its answer, then kills the child (a fresh one
serves the next call) and fails the test, naming the call.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from typing import Any, Callable

import pytest

from tests.timing import limit

__all__ = ["Outcome", "BoundedWorker", "bounded_worker", "HANG_S"]

HANG_S = 10.0
"""How long (before the suite's time scale) the parent waits for one call before calling it hung."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one call did in the child."""

    seconds: float
    """time.monotonic() around the call, in the child."""
    value: Any = None
    """What it returned (None when it raised)."""
    error: str | None = None
    """"TypeName: message" when it raised."""


def _serve(conn) -> None:
    """The child's loop: run each (function, args) received and send back its Outcome; None ends it."""
    while (job := conn.recv()) is not None:
        function, args = job
        start = time.monotonic()
        try:
            value, error = function(*args), None
        except Exception as err:  # noqa: BLE001 - reported to the test, which decides
            value, error = None, f"{type(err).__name__}: {str(err)[:300]}"
        seconds = time.monotonic() - start
        try:
            conn.send(Outcome(seconds, value, error))
        except RecursionError:  # a value nested too deeply to pickle (pickling fails before anything is sent)
            conn.send(Outcome(seconds, f"<a {type(value).__name__} nested too deeply to send>", error))


def _shown(args: tuple) -> str:
    return ", ".join(repr(a) if len(repr(a)) <= 80 else repr(a)[:77] + "..." for a in args)


class BoundedWorker:
    """A forked child that runs calls one at a time; `call` fails the test when one does not come back."""

    def __init__(self, hang_s: float):
        self.hang_s = hang_s
        self.context = multiprocessing.get_context("fork")  # the child has every module the parent imported
        self.process, self.conn = None, None

    def _start(self) -> None:
        self.conn, child_conn = self.context.Pipe()
        self.process = self.context.Process(target=_serve, args=(child_conn,), daemon=True)
        self.process.start()
        child_conn.close()

    def call(self, function: Callable, *args) -> Outcome:
        if self.process is None:
            self._start()
        self.conn.send((function, args))
        if not self.conn.poll(self.hang_s):
            self.close(kill=True)
            pytest.fail(f"{function.__name__}({_shown(args)}) did not return within {self.hang_s:.0f} s: it hangs",
                        pytrace=False)
        return self.conn.recv()

    def close(self, kill: bool = False) -> None:
        if self.process is None:
            return
        if not kill:
            self.conn.send(None)
            self.process.join(timeout=limit(5.0))
        self.process.kill()  # no-op when it has ended
        self.process.join()
        self.conn.close()
        self.process, self.conn = None, None


@pytest.fixture(scope="module")
def bounded_worker():
    worker = BoundedWorker(limit(HANG_S))
    yield worker
    worker.close()
