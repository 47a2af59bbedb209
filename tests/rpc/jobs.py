"""A training job run the way an operator runs it: `asyncrl train` as a process of its own (a fork of the tests'
command server, tests/cli_forks.py), its log in a file, its processes listed in run_dir/processes.json, signals
sent to real pids. Used by the supervision tests."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

from asyncrl.tracking import read_metrics
from tests.cli_forks import start
from tests.run_helpers import VLLM_ONE_THREAD
from tests.run_helpers import NO_EVAL, ROOT
from tests.timing import limit

# the toy task on a tiny random model: a version takes a fraction of a second, so runs are about time, not work
TOY = ("--model.path", "random:tiny-qwen2", "--data.task", "toy", "--wandb", "off", *NO_EVAL)


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def wait_until(predicate, timeout: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Job:
    def __init__(self, tmp_path: pathlib.Path, *args: str, name: str = "job", command: str = "train",
                 preset: str | None = "cpu-demo", env: dict | None = None):
        self.run_dir = tmp_path / name
        self.log_path = tmp_path / f"{name}.log"
        cmd = [command, *([preset] if preset else []), *args]
        if command == "train":
            cmd += ["--run-dir", str(self.run_dir)]
        if command == "agent":
            # a fresh interpreter, as an operator starts one on another machine: a joining agent forked from the
            # command server, on a network address, was admitted and then hung in its first submission (two runs
            # of three; tests/rpc/test_exposure.py), which no agent of a run's own fork server has shown
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", *cmd], stdout=log,
                                             stderr=subprocess.STDOUT, cwd=ROOT,
                                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        else:
            # one OpenMP thread, vLLM agents' unbound too (`VLLM_ONE_THREAD`)
            self.proc = start(cmd, cwd=ROOT, env={**VLLM_ONE_THREAD, **(env or {})}, stdout=self.log_path)
        self.started = time.monotonic()

    # ------------------------------------------------------------------------------------------ reading
    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = limit(120)) -> re.Match:
        def found():
            if self.proc.poll() is not None and not re.search(pattern, self.text()):
                raise AssertionError(f"the job exited ({self.proc.returncode}) before /{pattern}/:\n{self.tail()}")
            return re.search(pattern, self.text())
        return wait_until(found, timeout, f"/{pattern}/ in the job's log")

    def tail(self, n: int = 60) -> str:
        return "\n".join(line for line in self.text().splitlines() if not line.startswith("frame #"))[-8000:]

    def processes(self) -> dict[str, int]:
        """role -> pid of the run's live processes (the newest process of each role)."""
        path = self.run_dir / "processes.json"
        rows = json.loads(path.read_text())["processes"] if path.is_file() else []
        return {row["role"]: row["pid"] for row in rows}

    def launcher_pid(self) -> int:
        return json.loads((self.run_dir / "processes.json").read_text())["launcher"]

    def all_pids(self) -> set[int]:
        path = self.run_dir / "processes.json"
        return {row["pid"] for row in json.loads(path.read_text())["processes"]} if path.is_file() else set()

    def metrics(self) -> list[dict]:
        return read_metrics(self.run_dir, live=True)

    def wait_versions(self, n: int, timeout: float = limit(120)) -> list[dict]:
        return wait_until(lambda: len(self.metrics()) >= n and self.metrics(), timeout, f"{n} versions logged")

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    # ------------------------------------------------------------------------------------------ acting
    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def finish(self, timeout: float = limit(120)) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not return within {timeout:.0f} s:\n{self.tail()}") from None

    def kill(self) -> None:
        """Test cleanup: end the job and every process of it, whatever state they are in."""
        pids = self.all_pids()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(limit(10))
        for pid in pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
