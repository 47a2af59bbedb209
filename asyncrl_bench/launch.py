"""What starting a run's processes costs, with each start method in the same run: `asyncrl bench launch`.

    asyncrl bench launch --repeats 3

The same tiny job — `asyncrl train cpu-demo --model.path random:tiny-qwen2 --data.task toy
--async-training.total-versions 1 --wandb off` without evaluations: one trainer and one agent process — runs
`--repeats` times with each `--placement.start-method` (spawn: a fresh interpreter per process; forkserver:
forks of one server that imported torch and asyncrl once), alternating, each as a command of its own with one
intra-op thread per process. Per method: the median seconds from the command's start to its first version in
metrics.jsonl and to its exit, the CPU seconds the job's processes used (user + system, all of them), and the
ratios spawn / forkserver. `--agents 2` starts more processes than a 2-core machine has cores.

With `--restart` (the default), one more job per method trains until version 3, then its agent is killed
(SIGKILL) and restarted at once (`--placement.restart-agents 1 --placement.restart-backoff-s 0`): the seconds
from the kill to the launcher starting the new agent (once rank 0 has declared the old one dead), to its
admission and to its being live (holding the current weights), and the new agent's own start-to-admission.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["LaunchBenchArgs", "bench_launch", "JOB"]

JOB = ("train", "cpu-demo", "--model.path", "random:tiny-qwen2", "--data.task", "toy", "--wandb", "off",
       "--eval.every-versions", "0", "--eval.no-at-start", "--eval.no-at-end")
"""The job every measurement runs (`asyncrl JOB ...`)."""

METHODS = ("spawn", "forkserver")


@dataclasses.dataclass
class LaunchBenchArgs:
    """Launch-to-first-version and launch-to-exit times of the same tiny job with each start method."""

    repeats: int = 3
    """Jobs per start method (alternating between methods)."""
    versions: int = 1
    """--async-training.total-versions of each timed job."""
    agents: int = 1
    """Rollout agent processes of each timed job (--placement.agent-devices cpu, N times)."""
    restart: bool = True
    """Also time one agent restart per method (kill, then admission and first weights of its replacement)."""
    timeout_s: float = 600.0
    """A job that takes longer fails the benchmark."""
    out: str | None = None
    """Also write the rows and medians as JSON here."""


def _command(run_dir: pathlib.Path, method: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", *JOB, "--placement.start-method", method, "--run-dir", str(run_dir),
            *flags]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _rows(run_dir: pathlib.Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def _tail(log: pathlib.Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process's children and their descendants that have ended."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def time_job(run_dir: pathlib.Path, method: str, versions: int, agents: int, timeout_s: float) -> dict:
    """One job: seconds from the command's start to its first logged version and to its exit; CPU seconds."""
    log = run_dir.with_suffix(".log")
    cpu = _cpu_s()
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(run_dir, method, "--async-training.total-versions", str(versions),
                                         "--placement.agent-devices", *["cpu"] * agents),
                                stdout=out, stderr=subprocess.STDOUT, env=_env())
    first = None
    while proc.poll() is None:
        if first is None and _rows(run_dir):
            first = time.perf_counter() - start
        if time.perf_counter() - start > timeout_s:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the {method} job took more than {timeout_s:g} s (--timeout-s):\n{_tail(log)}")
        time.sleep(0.01)
    done = time.perf_counter() - start
    if proc.returncode != 0 or not _rows(run_dir):
        raise RuntimeError(f"the {method} job failed (exit code {proc.returncode}):\n{_tail(log)}")
    return {"method": method, "first_version_s": first if first is not None else done, "exit_s": done,
            "cpu_s": _cpu_s() - cpu}


def _agent_pid(run_dir: pathlib.Path) -> int | None:
    """agent0's pid in processes.json (the launcher rewrites it when it starts one); None when there is none."""
    try:
        rows = json.loads((run_dir / "processes.json").read_text())["processes"]
    except (OSError, ValueError, KeyError):
        return None  # not written yet, or caught mid-write
    return next((row["pid"] for row in rows if row["role"] == "agent0"), None)


def _logged(log: pathlib.Path, pattern: str) -> bool:
    return re.search(pattern, log.read_text(errors="replace")) is not None


def _wait_for(predicate, proc: subprocess.Popen, log: pathlib.Path, deadline: float, what: str):
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the job exited ({proc.returncode}) before {what}:\n{_tail(log)}")
        found = predicate()
        if found:
            return time.perf_counter()
        time.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}:\n{_tail(log)}")


def time_restart(run_dir: pathlib.Path, method: str, timeout_s: float) -> dict:
    """One endless job: after version 3 its agent is killed; seconds from the kill to the launcher starting its
    replacement (once rank 0 has declared it dead), to the replacement's admission and to its being live, and
    from its start to its admission (`join_s`)."""
    log = run_dir.with_suffix(".log")
    deadline = time.perf_counter() + timeout_s
    with open(log, "w") as out:
        proc = subprocess.Popen(_command(run_dir, method, "--async-training.total-versions", "1000000",
                                         "--placement.restart-agents", "1", "--placement.restart-backoff-s", "0"),
                                stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        _wait_for(lambda: _rows(run_dir) >= 3, proc, log, deadline, "version 3")
        agent = _agent_pid(run_dir)
        killed = time.perf_counter()
        os.kill(agent, signal.SIGKILL)
        started = _wait_for(lambda: _agent_pid(run_dir) not in (None, agent), proc, log, deadline,
                            "the launcher to start a new agent")
        admitted = _wait_for(lambda: _logged(log, r"agent agent0_r1 \(pid \d+, .*\) admitted"), proc, log, deadline,
                             "the restarted agent's admission")
        live = _wait_for(lambda: _logged(log, r"agent agent0_r1 is live"), proc, log, deadline,
                         "the restarted agent to be live")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"method": method, "started_s": started - killed, "admitted_s": admitted - killed,
            "live_s": live - killed, "join_s": admitted - started}


def summarize(rows: list[dict], keys: tuple[str, ...]) -> dict:
    """Per method, the median of each key; and spawn / forkserver per key."""
    medians = {m: {k: statistics.median(r[k] for r in rows if r["method"] == m) for k in keys}
               for m in METHODS if any(r["method"] == m for r in rows)}
    ratio = {k: medians["spawn"][k] / medians["forkserver"][k] for k in keys} if len(medians) == 2 else {}
    return {"median_s": medians, "spawn_over_forkserver": ratio}


def bench_launch(a: LaunchBenchArgs) -> dict:
    if a.repeats < 1:
        raise ValueError(f"--repeats {a.repeats} is invalid: must be >= 1")
    for name, value in (("versions", a.versions), ("agents", a.agents)):
        if value < 1:
            raise ValueError(f"--{name} {value} is invalid: must be >= 1")
    print(f"[bench launch] {a.repeats} job(s) per start method of: asyncrl {' '.join(JOB)} --async-training."
          f"total-versions {a.versions} --placement.agent-devices {' '.join(['cpu'] * a.agents)}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    jobs, restarts = [], []
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        for i in range(a.repeats):
            for method in (METHODS if i % 2 == 0 else METHODS[::-1]):
                row = time_job(pathlib.Path(tmp) / f"{method}-{i}", method, a.versions, a.agents, a.timeout_s)
                print(f"  {method:10s} first version {row['first_version_s']:6.2f} s   exit {row['exit_s']:6.2f} s   "
                      f"CPU {row['cpu_s']:6.2f} s", flush=True)
                jobs.append(row)
        for method in METHODS if a.restart else ():
            row = time_restart(pathlib.Path(tmp) / f"{method}-restart", method, a.timeout_s)
            print(f"  {method:10s} agent restart: started {row['started_s']:5.2f} s, admitted "
                  f"{row['admitted_s']:5.2f} s, live {row['live_s']:5.2f} s after the kill; joined "
                  f"{row['join_s']:5.2f} s after its start", flush=True)
            restarts.append(row)
    result = {"jobs": jobs, "restarts": restarts, **summarize(jobs, ("first_version_s", "exit_s", "cpu_s"))}
    if restarts:
        result["restart"] = summarize(restarts, ("started_s", "join_s", "admitted_s", "live_s"))
    _print(result)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print(result: dict) -> None:
    medians, ratio = result["median_s"], result["spawn_over_forkserver"]
    print("\nstart method   first version (median)   exit (median)   CPU (median)")
    for method, m in medians.items():
        print(f"  {method:12s} {m['first_version_s']:10.2f} s {m['exit_s']:18.2f} s {m['cpu_s']:12.2f} s")
    if ratio:
        print(f"  spawn / forkserver: {ratio['first_version_s']:.2f}x to the first version, "
              f"{ratio['exit_s']:.2f}x to the exit, {ratio['cpu_s']:.2f}x the CPU")
    for method, m in result.get("restart", {}).get("median_s", {}).items():
        print(f"  agent restart ({method}): joined {m['join_s']:.2f} s after its start; live {m['live_s']:.2f} s "
              "after the kill")
