"""`asyncrl` commands as forks of one prepared process.

A fresh `python -m asyncrl.cli ARGS` spends seconds of CPU importing torch, transformers and the library before
the command does anything. The tests start a few hundred commands; each test process (pytest, or an xdist
worker) instead keeps one server process, started on first use, that imported the commands' modules once and
forks a child per command. A child is a process of its own, as `python -m asyncrl.cli ARGS` would be: its
working directory, environment, stdin (/dev/null), stdout, stderr, exit status and global state are its own,
and its pid takes signals. A real `asyncrl train` runs this way too: its launcher, the fork, starts the run's
processes as it always does (a fork server that is a fresh interpreter, or fresh interpreters with
`--placement.start-method spawn`). The server never runs torch's thread pools, so a fork starts them as a fresh
interpreter would (with the OMP_NUM_THREADS of its own environment). A child leaves as multiprocessing's children
do: the atexit handlers (logging's flush among them), then os._exit, without tearing the modules down (~1.5 s).

    proc = start(["train", "cpu-demo", ...], cwd=ROOT, env=env, stdout=log)   # Popen-like: pid, poll, wait, kill
    out = run(["eval", "--help"], cwd=tmp_path)                               # subprocess.run-like
    outs = cli_forks([["train", "cpu-demo", "--dry-run"], ["data", "--help"]], cwd=tmp_path)

The protocol is one JSON line each way on the server's stdin and stdout: {"start": {"args", "cwd", "env",
"stdout", "stderr"}} -> {"pid"}, {"poll": pid} -> {"code": exit status or null}. The server ends when its stdin
closes (the test process ended); the commands it started are the tests' to end.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from tests.timing import limit

ROOT = pathlib.Path(__file__).resolve().parents[1]

PRELOAD = ("asyncrl.launch.train",)
"""Imported by the server beside every built-in command's module: the launch path (preflight, launchers,
supervision), which a real `asyncrl train` imports when it starts its run."""


class _Server:
    """The test process's prepared process (see the module's docstring)."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_forks"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.lock = threading.Lock()

    def ask(self, request: dict) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the command server (tests/cli_forks.py) ended with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(limit(30))


@functools.cache
def _server() -> _Server:
    server = _Server()
    atexit.register(server.close)
    return server


class Command:
    """A started command, as much of `subprocess.Popen` as the tests use."""

    def __init__(self, args: list[str], pid: int):
        self.args, self.pid, self.returncode = ["asyncrl", *args], pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _server().ask({"poll": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(args: list[str], *, cwd: str | os.PathLike = ROOT, env: dict | None = None,
          stdout: str | os.PathLike, stderr: str | os.PathLike | None = None) -> Command:
    """`asyncrl ARGS` started in a fork (in `cwd`, with this environment and `env`'s variables), its output to
    the file `stdout` and its errors to `stderr` (None: the same file)."""
    args = list(map(str, args))
    request = {"args": args, "cwd": str(cwd), "env": {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)},
               "stdout": str(stdout), "stderr": str(stderr if stderr is not None else stdout)}
    for path in {request["stdout"], request["stderr"]}:
        open(path, "w").close()  # there, and empty, when this returns (the fork opens them when it runs)
    return Command(args, _server().ask({"start": request})["pid"])


def run(args: list[str], *, cwd: str | os.PathLike = ROOT, env: dict | None = None,
        timeout: float = limit(180)) -> subprocess.CompletedProcess:
    """`asyncrl ARGS` run to its end in a fork; what `subprocess.run(..., capture_output=True, text=True)`
    returns, and subprocess.TimeoutExpired after `timeout` seconds (the command killed)."""
    with tempfile.TemporaryDirectory(prefix="cli-fork-") as tmp:
        out, err = pathlib.Path(tmp) / "out", pathlib.Path(tmp) / "err"
        command = start(args, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            code = command.wait(timeout)
        except subprocess.TimeoutExpired:
            command.kill()
            command.wait()
            raise
        return subprocess.CompletedProcess(command.args, code, out.read_text(), err.read_text())


def cli_forks(commands: list[list[str]], *, cwd: str | os.PathLike, env: dict | None = None,
              timeout: float = limit(180)) -> list[subprocess.CompletedProcess]:
    """Run `asyncrl ARGS` for each ARGS in order, each in a fork; `timeout` applies to each command, after which
    it is killed and its status is -9."""
    outs = []
    for args in commands:
        try:
            outs.append(run(args, cwd=cwd, env=env, timeout=timeout))
        except subprocess.TimeoutExpired as expired:
            outs.append(subprocess.CompletedProcess(expired.cmd, -signal.SIGKILL, "", f"timed out after {timeout} s"))
    return outs


# ---------------------------------------------------------------------------------------------- the server
def _child(request: dict) -> int:
    """In the fork: the command as `python -m asyncrl.cli` runs it, in its directory and environment, with its
    output to its files; its exit status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    out = os.open(request["stdout"], os.O_WRONLY)
    err = out if request["stderr"] == request["stdout"] else os.open(request["stderr"], os.O_WRONLY)
    os.dup2(out, 1), os.dup2(err, 2)
    sys.argv = ["asyncrl", *request["args"]]
    from asyncrl.cli import main
    try:
        main(request["args"])
        return 0
    except SystemExit as exc:  # what the interpreter does with it at the top level
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _fork(request: dict) -> int:
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(request)
        finally:  # the atexit handlers (logging's flush among them), then out without tearing down the
            atexit._run_exitfuncs()  # modules the server imported (~1-2 s for torch and transformers)
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    return pid


def _preload() -> None:
    """Import, once and before the forks, every built-in command's module, the launch path, and transformers'
    tokenizers (which the commands that read a model or a tokenizer import when they run)."""
    import importlib

    from asyncrl.cli import COMMANDS
    for module in {target.split(":")[0] for target in COMMANDS.values()} | set(PRELOAD):
        importlib.import_module(module)
    from transformers import AutoTokenizer  # noqa: F401  (transformers loads its modules lazily)


def serve() -> int:
    _preload()
    codes: dict[int, int] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if "start" in request:
            reply = {"pid": _fork(request["start"])}
        else:
            pid = request["poll"]
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            reply = {"code": codes.get(pid)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(serve())
