"""How a process of the run starts and ends: it dies with its parent, carries a readable name, and turns
signals into a stop request.

    stop = StopRequest()
    on_signals(lambda name: stop.set(name))     # main thread: first SIGTERM/SIGINT/SIGHUP -> a stop request;
                                                 # a second one exits at once
    die_with_parent()                           # spawned ranks: never outlive the launcher, even after kill -9
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

__all__ = ["StopRequest", "RunFailed", "on_signals", "die_with_parent", "name_process", "STOP_SIGNALS", "exit_code",
           "is_stopped"]

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


class RunFailed(RuntimeError):
    """A run that cannot go on for a reason its message states in full (every rollout agent is dead, a strict
    reward failed): reported as one line, without a traceback."""


class StopRequest:
    """A request to stop the run at the next safe point, and why (a signal's name, or a limit)."""

    def __init__(self):
        self._event = threading.Event()
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


def exit_code(reason: str | None) -> int:
    """The exit status of a run stopped for `reason`: 128 + the signal's number (as a shell reports a process
    killed by it), 124 for the wall-clock cap (as `timeout` does), 0 when it was not stopped."""
    if reason is None:
        return 0
    if reason in signal.Signals.__members__:
        return 128 + signal.Signals[reason].value
    return 124


def on_signals(first: Callable[[str], None], *, second_exit: bool = True) -> bool:
    """Install handlers for SIGTERM, SIGINT and SIGHUP: the first calls `first(name)`; a second one (any of
    them) exits the process at once. Only the main thread can install handlers: returns False elsewhere."""
    if threading.current_thread() is not threading.main_thread():
        return False
    seen: list[int] = []

    def handle(signum, frame):
        name = signal.Signals(signum).name
        if seen and second_exit:
            log.error("second signal (%s): exiting now", name)
            sys.stderr.flush()
            os._exit(128 + signum)
        seen.append(signum)
        first(name)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)
    return True


def name_process(name: str) -> None:
    """Show `name` as the process name in ps / top (Linux: the first 15 characters)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
        except OSError:
            pass


def die_with_parent(parent_pid: int, *, poll_s: float = 1.0) -> None:
    """End this process when its parent does, even on kill -9 of the parent: the kernel's parent-death signal
    on Linux, and a watchdog thread that checks the parent's pid (other systems, and a parent that died
    before the signal was armed)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch():
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, or a debugger): Linux's /proc state T or t."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False
