"""How the one-machine launcher starts its role processes (`--placement.start-method`): as forks of one server
that imported the role modules once (forkserver, the default), or as fresh interpreters (spawn).

A fresh interpreter spends seconds of CPU importing torch and asyncrl before its role does anything (~3 s on a
2-core machine); a launch starts several at once, and a restarted agent pays it again while the run waits for
it. `ForkServer` spawns one server process per launch, which imports the role modules, then forks one process
per request: a role starts from there in a fraction of a second.

    starter = ForkServer(preload=("asyncrl.rpc.supervise",), inherited=(results,))  # or SpawnStarter()
    child = starter.start(target, args, name="asyncrl-agent0")  # .pid, .exitcode, is_alive(), join(), kill()
    starter.parent_pid    # each started process's parent: the server (a fork dies with it), or this process
    starter.close()       # once every started process has ended

* Environment and working directory: a process gets the launcher's as of its own start (an agent restarted
  mid-run sees what the launcher has then; torch reads OMP_NUM_THREADS when a process first uses threads, so
  that one counts too). The few variables read when torch is loaded (TORCH_CPP_LOG_LEVEL) take the values
  the launcher had when the server started, at the launch.
* Lifetime: the server runs in a process group of its own and ignores SIGINT, SIGTERM and SIGHUP — a signal to
  the launcher's group, or to every process of the job (systemd, Slurm), must not take the ranks down with it:
  they stop through the launcher, rank 0 writing its checkpoint. It dies with the launcher (die_with_parent)
  and every process it forked dies with it (the kernel's parent-death signal, which a stopped process gets
  too), so kill -9 of the launcher still ends them all.
* Objects that cross to a process only by inheritance (a multiprocessing Queue) are handed to the server when
  it starts (`inherited`); an argument of `start` that is one of them reaches the process as that object.
* Exit codes are multiprocessing's (negative: killed by that signal); the server reaps its processes and reports
  each one's. Should the server itself die, its processes died with it: their code is -SIGKILL.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from typing import Callable, Protocol

from asyncrl.runtime.lifecycle import STOP_SIGNALS, die_with_parent, name_process

__all__ = ["RoleProcess", "ProcessStarter", "SpawnStarter", "ForkServer", "ForkedProcess", "START_METHODS",
           "process_starter"]

log = logging.getLogger(__name__)

START_METHODS = ("forkserver", "spawn")


class RoleProcess(Protocol):
    """What the launcher needs of a started process (a `multiprocessing.Process` is one)."""

    pid: int | None

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


class ProcessStarter(Protocol):
    parent_pid: int
    """The parent of every process this starts (what their `die_with_parent` watches)."""
    server_pid: int | None
    """The fork server's pid (None: there is none)."""

    def start(self, target: Callable, args: tuple, *, name: str) -> RoleProcess: ...

    def close(self) -> None: ...


class SpawnStarter:
    """Every process a fresh interpreter (multiprocessing's spawn), a child of this process."""

    def __init__(self):
        self.ctx = multiprocessing.get_context("spawn")
        self.parent_pid = os.getpid()
        self.server_pid = None

    def start(self, target: Callable, args: tuple, *, name: str) -> multiprocessing.Process:
        process = self.ctx.Process(target=target, name=name, args=args, daemon=False)
        process.start()
        return process

    def close(self) -> None:
        """Nothing to release: no server; each process is this one's child, which the launcher joins."""


@dataclasses.dataclass(frozen=True)
class _Held:
    """Stands, in a request, for the server's inherited object number `index`."""

    index: int


@dataclasses.dataclass(frozen=True)
class _Request:
    """One process to fork: `target(*args)` with the launcher's environment and working directory."""

    target: Callable
    args: tuple
    name: str
    env: dict[str, str]
    cwd: str


class ForkedProcess:
    """A process the fork server started (see `RoleProcess`); its exit code comes from the server."""

    def __init__(self, server: ForkServer, pid: int, name: str):
        self.server, self.pid, self.name = server, pid, name

    @property
    def exitcode(self) -> int | None:
        return self.server.exits.get(self.pid)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        with self.server.changed:
            self.server.changed.wait_for(lambda: self.pid in self.server.exits, timeout)

    def kill(self) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __repr__(self) -> str:
        return f"<ForkedProcess {self.name} pid={self.pid} exitcode={self.exitcode}>"


class ForkServer:
    """A server process, spawned now, that imports `preload` and forks the processes `start` asks for (see the
    module docstring). `start` waits up to `start_timeout_s` for the server (its imports come first)."""

    def __init__(self, *, preload: tuple[str, ...], inherited: tuple = (), start_timeout_s: float = 600.0):
        ctx = multiprocessing.get_context("spawn")
        self.inherited, self.start_timeout_s = inherited, start_timeout_s
        self.exits: dict[int, int] = {}  # pid -> exit code, as the server reports them
        self.changed = threading.Condition()
        self._started: list[int] = []  # pids the server reported started, not yet handed out
        self._pids: set[int] = set()
        self._gone = self._closing = False
        self._conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_serve, name="asyncrl-forkserver", daemon=False,
                                   args=(theirs, inherited, os.getpid(), preload))
        self.process.start()
        theirs.close()
        self.parent_pid = self.server_pid = self.process.pid
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def start(self, target: Callable, args: tuple, *, name: str) -> ForkedProcess:
        held = tuple(next((_Held(i) for i, obj in enumerate(self.inherited) if a is obj), a) for a in args)
        try:
            self._conn.send(_Request(target, held, name, dict(os.environ), os.getcwd()))
        except OSError:
            pass  # the server is gone: said below
        with self.changed:
            self.changed.wait_for(lambda: self._started or self._gone, self.start_timeout_s)
            pid = self._started.pop(0) if self._started else None
            if pid is not None:
                self._pids.add(pid)
        if pid is None:
            self.process.join(1.0)
            raise RuntimeError(
                f"the fork server (pid {self.server_pid}) exited with code {self.process.exitcode} before starting "
                f"{name}; see its log above" if self._gone else
                f"the fork server (pid {self.server_pid}) did not start {name} within {self.start_timeout_s:.0f} s")
        return ForkedProcess(self, pid, name)

    def _read(self) -> None:
        """The reader thread: what the server reports (a process started, one exited), until it is gone."""
        try:
            while True:
                kind, pid, code = self._conn.recv()
                with self.changed:
                    if kind == "started":
                        self._started.append(pid)
                    else:
                        self.exits[pid] = code
                    self.changed.notify_all()
        except (EOFError, OSError):
            pass
        with self.changed:
            self._gone = True
            orphans = sorted((self._pids | set(self._started)) - self.exits.keys())
            for pid in orphans:
                self.exits[pid] = -signal.SIGKILL
            self.changed.notify_all()
        if orphans and not self._closing:
            log.error("the fork server (pid %d) ended: the processes it started (%s) ended with it", self.server_pid,
                      ", ".join(map(str, orphans)))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the server (it kills what it started and still runs) and wait for it."""
        self._closing = True
        try:
            self._conn.send(None)
        except OSError:
            pass
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self._reader.join(timeout_s)
        self._conn.close()


# ---------------------------------------------------------------------------------------------- the server
def process_starter(method: str, *, preload: tuple[str, ...], inherited: tuple, start_timeout_s: float) -> ProcessStarter:
    """How a launcher starts its processes (--placement.start-method): forks of a server that imports `preload`
    once and holds `inherited`, or fresh interpreters (off Linux always: forking a process that loaded torch is
    not safe there)."""
    if method == "spawn" or not sys.platform.startswith("linux"):
        return SpawnStarter()
    return ForkServer(preload=preload, inherited=inherited, start_timeout_s=start_timeout_s)


def _serve(conn, inherited: tuple, launcher_pid: int, preload: tuple[str, ...]) -> None:
    """The server process: import `preload`, then fork one process per request and report when each started
    and ended, until the launcher says stop (None) or is gone."""
    os.setpgid(0, 0)
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    die_with_parent(launcher_pid)
    name_process("asyncrl-forksrv")
    for module in preload:
        importlib.import_module(module)
    fork = multiprocessing.get_context("fork")
    children: dict[int, multiprocessing.Process] = {}  # sentinel -> process
    try:
        while True:
            for ready in multiprocessing.connection.wait([conn, *children]):
                if ready is conn:
                    request = conn.recv()
                    if request is None:
                        return
                    child = fork.Process(target=_forked, name=request.name, daemon=False,
                                         args=(conn, handlers, request, inherited, os.getpid()))
                    child.start()
                    children[child.sentinel] = child
                    conn.send(("started", child.pid, None))
                else:
                    child = children.pop(ready)
                    child.join()
                    conn.send(("exited", child.pid, child.exitcode))
    except (EOFError, OSError):
        return  # the launcher is gone
    finally:
        for child in children.values():
            child.kill()
        for child in children.values():
            child.join()


def _forked(conn, handlers: dict, request: _Request, inherited: tuple, server_pid: int) -> None:
    """A forked process: it dies with the server; the launcher's signal dispositions, environment and working
    directory; then the target."""
    conn.close()
    die_with_parent(server_pid)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    request.target(*(inherited[a.index] if isinstance(a, _Held) else a for a in request.args))
