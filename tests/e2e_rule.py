"""The rule that splits the suite in two tiers: a test that starts another interpreter is marked `e2e`.

`make test-fast` runs the tests that stay in the test process (`-m "not e2e"`), `make test-e2e` the rest.
No hand-kept list decides which is which: while a test session runs, this plugin (registered by
tests/conftest.py) watches every process the test process starts, and a test that started an interpreter
during its setup, call or teardown without being marked `e2e` fails, naming what it started. A module or
session fixture's interpreter is started by the setup of the first test that uses the fixture, so that test is
the one that needs the mark (in a run of the fast tier, whichever test comes first there).

What counts as starting an interpreter, watched where every way of doing it passes:
* `multiprocessing.process.BaseProcess.start`: every multiprocessing or torch.multiprocessing process, whatever
  its start method (spawn, fork, forkserver): the rpc launchers' ranks, mp.spawn's process groups, worker
  pools, vLLM engine hosts;
* `_posixsubprocess.fork_exec` (and subprocess's `_fork_exec`, the same function), `os.posix_spawn` and
  `os.posix_spawnp`: subprocess.Popen and everything built on it (subprocess.run, the CLI in a subprocess,
  torchrun, tests.cli_forks) and multiprocessing's own helper processes (its forkserver, its resource tracker),
  when the program is an interpreter: Python, a shell, or a script with a `#!` line (console scripts such as
  `asyncrl` and `torchrun`). Other programs (a C compiler, ldconfig) are not interpreters and do not count;
* `os.fork`/`os.forkpty` (a fork of the test process is another interpreter) and `os.system` (a shell);
* a command started by the test process's command server (tests/cli_forks.py: a fork of a prepared process,
  started once for the whole session, so the first start is not what makes each command an interpreter).

Helpers that a library starts once per process, for whichever test first needs them, are no test's (which
test starts them depends only on which ran before it in the same process): multiprocessing's resource tracker
(a test that starts a worker process is still caught by that start), inductor's probe of the CPU's vector
instruction sets (a bare Python per instruction set that loads a test library, run by the first compilation) and
inductor's pool of compile workers (started by the first compilation where the machine has the cores for it, as
on a GPU host).

The wrapping exists only inside the test session: installed when the session is configured, removed when it
ends; the library is never changed.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import functools
import multiprocessing.process
import os
import pathlib
import re
import subprocess
import sys
import threading

import pytest

MARKER = "e2e: starts another interpreter (training runs, launchers, torchrun, worker pools, vLLM hosts, CLI " \
         "subprocesses); enforced by tests/e2e_rule.py; `make test-e2e` runs these, `make test-fast` the rest"

_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})
_ONCE_PER_PROCESS = ("multiprocessing.resource_tracker", "torch._inductor.cpu_vec_isa",
                     "torch._inductor.compile_worker.subproc_pool")
_TOOLCHAINS = ("triton.",)  # packages whose own build steps start programs (a compiler wrapper, ldconfig)


def _started_by_a_once_per_process_helper() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        if name in _ONCE_PER_PROCESS or name.startswith(_TOOLCHAINS):
            return True
        frame = frame.f_back
    return False


def is_interpreter(program: str | os.PathLike | None) -> bool:
    """Python, a shell, or a script run by the interpreter its `#!` line names."""
    if not program:
        return False
    path = pathlib.Path(os.fsdecode(program))
    if re.fullmatch(r"(python|pypy)[0-9.]*", path.name) or path.name in _SHELLS:
        return True
    try:
        if path.resolve() == pathlib.Path(sys.executable).resolve():
            return True
        with open(path, "rb") as file:
            return file.read(2) == b"#!"
    except OSError:
        return False


def _command(args) -> str:
    shown = " ".join(os.fsdecode(a) for a in args or ())
    return shown if len(shown) <= 300 else shown[:297] + "..."


def _target(process) -> str:
    target = getattr(process, "_target", None)
    if target is None:
        return f"{type(process).__qualname__}.run"
    return getattr(target, "__qualname__", None) or repr(target)


class StartWatch:
    """Records each interpreter this process starts, from any thread, while installed."""

    def __init__(self):
        self.started: list[str] = []
        self._nested = threading.local()  # a multiprocessing start's own fork/exec is not recorded twice
        self._restore: list[tuple[object, str, object]] = []

    def take(self) -> list[str]:
        """What was started since the last take (appends from other threads are kept for the next one)."""
        taken = self.started[:]
        del self.started[:len(taken)]
        return taken

    def install(self) -> None:
        self._wrap(multiprocessing.process.BaseProcess, "start", self._process_start)
        self._wrap(_posixsubprocess, "fork_exec", self._fork_exec)
        if hasattr(subprocess, "_fork_exec"):  # subprocess's own name for it (Python 3.11+)
            self._wrap(subprocess, "_fork_exec", self._fork_exec)
        for name in ("posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                self._wrap(os, name, self._posix_spawn)
        for name in ("fork", "forkpty"):
            if hasattr(os, name):
                self._wrap(os, name, self._fork)
        self._wrap(os, "system", self._system)
        from tests import cli_forks
        self._wrap(cli_forks._Server, "ask", self._server_ask)

    def uninstall(self) -> None:
        while self._restore:
            owner, name, original = self._restore.pop()
            setattr(owner, name, original)

    def _wrap(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        self._restore.append((owner, name, original))
        setattr(owner, name, functools.wraps(original)(make(original)))

    def _record(self, what: str) -> None:
        if getattr(self._nested, "depth", 0) or _started_by_a_once_per_process_helper():
            return
        thread = threading.current_thread()
        self.started.append(what if thread is threading.main_thread() else f"{what} (from thread {thread.name!r})")

    @contextlib.contextmanager
    def _inside(self):
        self._nested.depth = getattr(self._nested, "depth", 0) + 1
        try:
            yield
        finally:
            self._nested.depth -= 1

    def _process_start(self, original):
        def start(process):
            self._record(f"a {type(process).__name__} (multiprocessing) named {process.name!r} running "
                         f"{_target(process)}")
            with self._inside():
                return original(process)
        return start

    def _fork_exec(self, original):
        def fork_exec(args, executable_list, *rest, **kwargs):
            program = next((p for p in executable_list or () if os.path.isfile(os.fsdecode(p))), None)
            if is_interpreter(program):
                self._record(f"`{_command(args)}`")
            return original(args, executable_list, *rest, **kwargs)
        return fork_exec

    def _posix_spawn(self, original):
        def posix_spawn(path, argv, *rest, **kwargs):
            if is_interpreter(path):
                self._record(f"`{_command(argv)}`")
            return original(path, argv, *rest, **kwargs)
        return posix_spawn

    def _fork(self, original):
        def fork(*args, **kwargs):
            self._record(f"a fork of the test process (os.{original.__name__})")
            return original(*args, **kwargs)
        return fork

    def _system(self, original):
        def system(command):
            self._record(f"a shell: os.system({command!r})")
            return original(command)
        return system


    def _server_ask(self, original):
        def ask(server, request):
            if "start" in request:
                self._record(f"`asyncrl {_command(request['start']['args'])}` (a fork of tests/cli_forks.py's "
                             "command server)")
            return original(server, request)
        return ask


def unmarked_start_message(item: pytest.Item, phase: str, started: list[str]) -> str:
    return (f"{item.nodeid} started another interpreter during its {phase} but is not marked e2e:\n"
            + "".join(f"  {what}\n" for what in started)
            + "A test that starts an interpreter belongs to the e2e tier (`make test-e2e`). Mark it with "
              "`@pytest.mark.e2e` on the test, or `pytestmark = pytest.mark.e2e` at the top of its module "
              "(a module or session fixture's interpreter counts for the first test that uses the fixture).")


class E2ERule:
    """The pytest plugin: fails an unmarked test in whose setup, call or teardown an interpreter started."""

    def __init__(self):
        self.watch = StartWatch()

    def pytest_unconfigure(self, config):
        self.watch.uninstall()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        return (yield from self._phase(item, "setup"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        return (yield from self._phase(item, "call"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item, nextitem):
        return (yield from self._phase(item, "teardown"))

    def _phase(self, item: pytest.Item, phase: str):
        self.watch.take()  # what started between tests (another test's leftover thread) is no test's
        try:
            return (yield)
        finally:
            started = self.watch.take()
            if started and item.get_closest_marker("e2e") is None:
                pytest.fail(unmarked_start_message(item, phase, started), pytrace=False)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    rule = E2ERule()
    rule.watch.install()
    config.pluginmanager.register(rule, "asyncrl-e2e-rule")
