"""One real tiny training run shared by the report / eval tests, and a subprocess helper for CLI tests."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

from tests.timing import limit

ROOT = pathlib.Path(__file__).resolve().parents[1]

NO_EVAL = ("--eval.every-versions", "0", "--eval.no-at-start", "--eval.no-at-end")
"""cpu-demo evaluates held-out prompts by default; runs that test something else turn it off (their metrics rows
are then training rows only)."""


def cli(*args: str, timeout: float = limit(180), env: dict | None = None) -> subprocess.CompletedProcess:
    """`asyncrl ARGS...` in a subprocess (through `python -m asyncrl.cli`, so PATH does not matter), with one
    intra-op thread like the rest of the suite (two OpenMP threads on a 2-core box make the tiny models'
    matmuls ~30x slower)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def train_here(*args: str) -> None:
    """`asyncrl train ARGS --placement.launcher local` in this process: the command as it runs (its checks, its
    stdout and stderr lines, its exit as SystemExit), the trainer and the agents as threads of this process,
    for tests whose subject is not processes. The run's signal handlers are taken down afterwards."""
    import signal
    from asyncrl.launch.train_command import train_main
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        train_main([*args, "--placement.launcher", "local"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def torchrun_port() -> int:
    """A loopback port p with p + 1 and p + 2 free too, for a torchrun job: its rendezvous, the run's store and
    RPC."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for p in (port + 1, port + 2):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no three consecutive free ports on loopback")


def tiny_run(tmp_path_factory) -> pathlib.Path:
    """A finished 3-version fully-async run of random:tiny-qwen2 on the toy task, with a checkpoint at
    version 3 (~10 s on 2 cores). Made once per test session: later callers find it on disk."""
    run_dir = tmp_path_factory.getbasetemp() / "shared-tiny-run"
    if not (run_dir / "summary.json").is_file():
        out = cli("train", "cpu-demo", "--model.path", "random:tiny-qwen2", "--data.task", "toy",
                  "--async-training.total-versions", "3", "--checkpoint-every", "3", "--wandb", "off", *NO_EVAL,
                  "--run-dir", str(run_dir), timeout=limit(240))
        assert out.returncode == 0, out.stderr[-3000:]
    return run_dir
