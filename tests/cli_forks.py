"""`asyncrl` commands run in order by one Python process that imported the library and the commands' modules once
and forks a child per command. Each child is a process of its own, as `python -m asyncrl.cli ARGS` would be
(its exit status, stdout, stderr and global state are its own), without the seconds of imports a fresh
interpreter pays per command. A child leaves as multiprocessing's children do: the atexit handlers (logging's
flush among them), then os._exit, without tearing the parent's modules down again (~1.5 s). A real `asyncrl
train` runs this way too: its launcher, the fork, starts the run's processes as it always does (a fork server
that is a fresh interpreter, or fresh interpreters with `--placement.start-method spawn`). The prepared process
never runs torch's thread pools, so a fork starts them as a fresh interpreter would.

    outs = cli_forks([["train", "cpu-demo", "--dry-run"], ["data", "--help"]], cwd=tmp_path)
    assert outs[0].returncode == 0 and "checks:" in outs[0].stdout

`python -m tests.cli_forks REQUESTS` runs them: REQUESTS is a JSON file of {"args", "stdout", "stderr"} (the
two files a command's output goes to) and "timeout" (seconds per command, after which the command's process
group is killed and its status is -9).
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from tests.timing import limit

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cli_forks(commands: list[list[str]], *, cwd: str | os.PathLike, env: dict | None = None,
              timeout: float = limit(180)) -> list[subprocess.CompletedProcess]:
    """Run `asyncrl ARGS` for each ARGS in order (in `cwd`, in this environment with `env`'s variables set),
    each in a fork of one prepared process; `timeout` applies to each command. Returns what subprocess.run
    would."""
    with tempfile.TemporaryDirectory(prefix="cli-forks-") as tmp:
        tmp = pathlib.Path(tmp)
        requests = [{"args": list(map(str, args)), "stdout": str(tmp / f"{i}.out"), "stderr": str(tmp / f"{i}.err"),
                     "timeout": timeout} for i, args in enumerate(commands)]
        (tmp / "requests.json").write_text(json.dumps(requests))
        env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-m", "tests.cli_forks", str(tmp / "requests.json")], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=limit(60) + timeout * len(commands))
        codes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
        assert done.returncode == 0 and codes, f"tests.cli_forks failed:\n{done.stdout}\n{done.stderr[-3000:]}"
        return [subprocess.CompletedProcess(["asyncrl", *r["args"]], code, pathlib.Path(r["stdout"]).read_text(),
                                            pathlib.Path(r["stderr"]).read_text())
                for r, code in zip(requests, codes[0])]


def _child(args: list[str], stdout: str, stderr: str) -> int:
    """In the fork: output to the two files, the command as `python -m asyncrl.cli` runs it; its exit status."""
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["asyncrl", *args]
    from asyncrl.cli import main
    try:
        main(args)
        return 0
    except SystemExit as exc:  # what the interpreter does with it at the top level
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.05)


def _preload(requests: list[dict]) -> None:
    """Import, once and before the forks, the modules of the commands asked for (and transformers, which the
    commands that read a model or a tokenizer import when they run)."""
    import importlib

    from asyncrl.cli import COMMANDS
    names = {r["args"][0] for r in requests if r["args"] and r["args"][0] in COMMANDS}
    for name in names:
        importlib.import_module(COMMANDS[name].split(":")[0])
    if names & {"train", "eval", "data", "export"}:
        from transformers import AutoTokenizer  # noqa: F401  (transformers loads its modules lazily)
    if "train" in names:
        importlib.import_module("asyncrl.launch.train")  # the launch path: preflight, launchers, supervision


def main(path: str) -> int:
    requests = json.loads(pathlib.Path(path).read_text())
    _preload(requests)
    codes = []
    for request in requests:
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # a group of its own: a timeout kills whatever it started
            code = 1
            try:
                code = _child(request["args"], request["stdout"], request["stderr"])
            finally:  # the atexit handlers (logging's flush among them), then out without tearing down the
                atexit._run_exitfuncs()  # modules the parent imported (~1-2 s for torch and transformers)
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)
        try:
            os.setpgid(pid, pid)  # here too, so that a kill never races the child's own call
        except OSError:
            pass
        codes.append(_wait(pid, request["timeout"]))
    print(json.dumps(codes), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
