"""Worker processes for user code that may hang: synchronous reward functions and environment steps.

    pool = WorkerPool(2, name="agent0-user-code", preload=("asyncrl.data.scoring",))
    future = pool.submit(call_reward, (spec, text, prompt), timeout_s=60)          # any idle worker
    future = pool.submit(step_env, (key, turn), timeout_s=30, pin="p17.e0")        # the worker holding p17.e0
    pool.release("p17.e0")                                                         # its state is gone: forget it
    pool.close()

A call is a module-level function `fn(state, *args)`, run in a spawned worker process; `state` is a dict the
worker keeps between calls (loaded reward functions, live environment objects). A thread cannot be stopped
in Python, and a call stuck in C code (a tower of powers, a regex) holds the GIL so that no other thread of
its process runs either: only a process can be cut off. So each call has a deadline, counted from the
moment a ready worker takes it; a worker whose call passes it is killed (SIGKILL) and a fresh one started on
demand, and the call's future raises `CallTimedOut`. A call pinned to a key (`pin`) runs on the worker that
holds that key's state (a new key goes to the worker holding the fewest, so that one worker's death costs as
few keys as can be); when that worker dies, the pinned calls still queued and every later call on the key
raise `WorkerLost` until the key is released.

Workers start when first needed (a run without synchronous user code starts none), import `preload` before
they take calls (so start-up never counts against a deadline), ignore SIGINT (the launcher stops the run) and
die with this process, even on kill -9. One dispatcher thread assigns calls, reads results and enforces the
deadlines; futures complete on it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from typing import Any, Callable

from asyncrl.runtime.lifecycle import die_with_parent

__all__ = ["WorkerPool", "CallTimedOut", "WorkerLost", "CallFailed"]

log = logging.getLogger(__name__)


class CallTimedOut(TimeoutError):
    """The call did not return within its deadline; its worker was killed."""


class WorkerLost(RuntimeError):
    """The worker holding the call's pinned state died (killed for another call's deadline, or crashed)."""


class CallFailed(RuntimeError):
    """The call raised in its worker: `type_name` and the message of what it raised."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


def _worker_main(conn, parent_pid: int, preload: tuple[str, ...]) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in preload:
        importlib.import_module(module)
    state: dict[str, Any] = {}
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        call_id, fn, args = message
        try:
            reply = (call_id, True, fn(state, *args))
        except BaseException as err:  # noqa: BLE001 - the caller gets it
            reply = (call_id, False, (type(err).__name__, str(err)))
        try:
            conn.send(reply)
        except Exception as err:  # noqa: BLE001 - e.g. a result that does not pickle
            conn.send((call_id, False, (type(err).__name__, f"its result could not be sent back: {err}")))


@dataclasses.dataclass(eq=False)
class _Call:
    fn: Callable
    args: tuple
    timeout_s: float
    pin: str | None
    future: concurrent.futures.Future
    deadline: float | None = None


@dataclasses.dataclass(eq=False)
class _Worker:
    process: Any
    conn: Any
    ready: bool = False
    call: _Call | None = None


class WorkerPool:
    """`workers` processes running calls under deadlines (see the module docstring)."""

    def __init__(self, workers: int, *, name: str, preload: tuple[str, ...] = (), poll_s: float = 0.5):
        if workers < 1:
            raise ValueError(f"WorkerPool: workers={workers} must be >= 1")
        self.size, self.name, self.preload, self.poll_s = workers, name, preload, poll_s
        self.ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._pending: collections.deque[_Call] = collections.deque()
        self._workers: list[_Worker | None] = [None] * workers
        self._pinned: dict[str, int] = {}  # key -> index of the worker that holds its state
        self._held: list[set[str]] = [set() for _ in range(workers)]  # per worker index: the keys it holds
        self._lost: set[str] = set()  # keys whose worker died; released by their owner
        self._wake_r, self._wake_w = self.ctx.Pipe(duplex=False)
        self._closed = False
        self._thread: threading.Thread | None = None
        self.killed = 0
        """Workers killed for passing a deadline, so far."""

    # ------------------------------------------------------------------------------------------ API
    def submit(self, fn: Callable, args: tuple, *, timeout_s: float, pin: str | None = None
               ) -> concurrent.futures.Future:
        """Run `fn(state, *args)` in a worker; a future of its result. It raises `CallTimedOut` after
        `timeout_s` seconds of running, `CallFailed` when `fn` raised, `WorkerLost` when `pin`'s worker died."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the worker pool is closed")
            if pin is not None and pin in self._lost:
                future.set_exception(WorkerLost(f"the worker process holding {pin!r} was restarted"))
                return future
            if pin is not None and pin not in self._pinned:
                index = min(range(self.size), key=lambda i: (len(self._held[i]), i))
                self._pinned[pin] = index
                self._held[index].add(pin)
            self._pending.append(_Call(fn, args, timeout_s, pin, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._dispatch, name=self.name, daemon=True)
                self._thread.start()
        self._wake()
        return future

    def release(self, pin: str) -> None:
        """`pin`'s state is no longer needed (its calls are done): forget where it lived."""
        with self._lock:
            index = self._pinned.pop(pin, None)
            self._lost.discard(pin)
            if index is not None:
                self._held[index].discard(pin)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers (a call still running is killed) and fail what is still queued."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
        for call in pending:
            call.future.set_exception(RuntimeError(f"{self.name}: the worker pool was closed"))
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ----------------------------------------------------------------------------------- dispatcher
    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"1")
        except OSError:
            pass

    def _dispatch(self) -> None:
        while not self._closed:
            self._assign()
            waits = [self._wake_r] + [w.conn for w in self._workers if w is not None] + \
                    [w.process.sentinel for w in self._workers if w is not None]
            for ready in multiprocessing.connection.wait(waits, timeout=self._next_wait()):
                if ready is self._wake_r:
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                else:
                    self._read(ready)
            self._enforce_deadlines()
        self._stop_workers()

    def _next_wait(self) -> float:
        deadlines = [w.call.deadline for w in self._workers if w is not None and w.call is not None]
        if not deadlines:
            return self.poll_s
        return max(0.0, min(min(deadlines) - time.monotonic(), self.poll_s))

    def _assign(self) -> None:
        with self._lock:
            for index in range(self.size):
                if self._workers[index] is None and self._pending:
                    self._workers[index] = self._start_worker()
            idle = {i for i in range(self.size) if self._idle(i)}
            kept: collections.deque[_Call] = collections.deque()
            while self._pending and idle:  # in order; a pinned call waits for its own worker
                call = self._pending.popleft()
                index = self._pinned.get(call.pin) if call.pin is not None else None
                worker_index = (index if index in idle else None) if index is not None else min(idle)
                if worker_index is None:
                    kept.append(call)
                elif call.future.set_running_or_notify_cancel():
                    idle.discard(worker_index)
                    self._send(worker_index, call)
            kept.extend(self._pending)
            self._pending = kept

    def _idle(self, index: int) -> bool:
        worker = self._workers[index]
        return worker is not None and worker.ready and worker.call is None

    def _send(self, index: int, call: _Call) -> None:
        worker = self._workers[index]
        call.deadline = time.monotonic() + call.timeout_s
        worker.call = call
        try:
            worker.conn.send((id(call), call.fn, call.args))
        except Exception as err:  # noqa: BLE001 - arguments that do not pickle, or a worker that just died
            worker.call = None
            call.future.set_exception(CallFailed(type(err).__name__, f"the call could not be sent: {err}"))

    def _start_worker(self) -> _Worker:
        ours, theirs = self.ctx.Pipe(duplex=True)
        process = self.ctx.Process(target=_worker_main, args=(theirs, os.getpid(), self.preload),
                                   name=f"{self.name}-worker", daemon=True)
        process.start()
        theirs.close()
        return _Worker(process, ours)

    def _read(self, ready) -> None:
        worker = next((w for w in self._workers if w is not None and ready in (w.conn, w.process.sentinel)), None)
        if worker is None:
            return
        try:
            message = worker.conn.recv() if worker.conn.poll() else None
        except (EOFError, OSError):
            message = None
        if message is None:
            if not worker.process.is_alive():
                self._lose(worker, f"its worker process ended (exit code {worker.process.exitcode})")
            return
        if message == ("ready",):
            worker.ready = True
            return
        call, worker.call = worker.call, None
        if call is None:
            return
        _, ok, payload = message
        if ok:
            call.future.set_result(payload)
        else:
            call.future.set_exception(CallFailed(*payload))

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            call = worker.call if worker is not None else None
            if call is not None and now > call.deadline:
                worker.process.kill()
                self.killed += 1
                self._lose(worker, f"it did not return within {call.timeout_s:g} s", timed_out=True)

    def _lose(self, worker: _Worker, why: str, *, timed_out: bool = False) -> None:
        """A worker is gone (killed or crashed): fail its call and everything pinned to it."""
        worker.process.join(1.0)
        worker.conn.close()
        with self._lock:
            index = self._workers.index(worker)
            self._workers[index] = None
            held, self._held[index] = self._held[index], set()
            for pin in held:
                self._pinned.pop(pin, None)
                self._lost.add(pin)
            # a worker that died before it was ready cannot start: fail what waits rather than start it forever
            orphans = [c for c in self._pending if (c.pin is None and not worker.ready) or c.pin in held]
            for call in orphans:
                self._pending.remove(call)
        call = worker.call
        if call is not None:
            error = CallTimedOut(f"{why}; its worker was killed") if timed_out else WorkerLost(why)
            call.future.set_exception(error)
        for orphan in orphans:
            what = f"the worker process holding {orphan.pin!r} was lost" if worker.ready else \
                "a worker process could not start"
            orphan.future.set_exception(WorkerLost(f"{what} ({why})"))

    def _stop_workers(self) -> None:
        for worker in self._workers:
            if worker is None:
                continue
            try:
                worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            if worker is not None:
                worker.process.join(max(0.0, deadline - time.monotonic()))
                if worker.process.is_alive():
                    worker.process.kill()
                    worker.process.join(1.0)
                if worker.call is not None:
                    worker.call.future.set_exception(RuntimeError(f"{self.name}: the worker pool was closed"))
                worker.conn.close()
