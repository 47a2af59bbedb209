"""Fault drill: measure how fast a running job notices a failed rollout agent and how long the trainer stalls.

    python scripts/fault_drill.py --repeats 3 --agent-timeout-s 10 --out runs/drill
    python scripts/fault_drill.py --repeats 1 -- --model.path random:tiny-qwen2 --data.task toy   # a quick one

Each repeat starts `asyncrl train cpu-demo` with two rollout agents (options after `--` go to it), waits until
it trains, then hurts agent1 — `kill`: SIGKILL; `stop`: SIGSTOP (a hang) — and reads the job's log for the
line that names it dead. It reports, per fault: seconds from the signal to that line, the silence the run
measured (for a hang), and the longest gap between two logged versions around the fault (the trainer's
stall). Then it stops the job with SIGTERM and checks that it exits 143 with a checkpoint and no process
left. Writes `drill.json`. Linux only (/proc).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time

import tyro

from asyncrl.tracking import read_metrics


@dataclasses.dataclass
class DrillArgs:
    repeats: int = 3
    """Runs per fault."""
    faults: tuple[str, ...] = ("kill", "stop")
    """Faults to inject into agent1: kill (SIGKILL) and stop (SIGSTOP, a hang)."""
    agent_timeout_s: float = 10.0
    """The runs' --async-training.agent-timeout-s."""
    out: str = "runs/drill"
    """Where the runs and drill.json go."""
    warmup_versions: int = 5
    """Versions trained before the fault."""


def _alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"no {what} within {timeout:.0f} s")


def _rows(run_dir: pathlib.Path) -> list[dict]:
    return read_metrics(run_dir, live=True)


def drill_once(fault: str, run_dir: pathlib.Path, args: DrillArgs, train_args: list[str]) -> dict:
    log_path = run_dir.with_suffix(".log")
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "cpu-demo", "--run-dir", str(run_dir), "--wandb", "off",
           "--placement.agent-devices", "cpu", "cpu", "--async-training.total-versions", "1000000",
           "--async-training.agent-timeout-s", str(args.agent_timeout_s), *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait(lambda: len(_rows(run_dir)) >= args.warmup_versions, 600, "training")
        pids = {r["role"]: r["pid"] for r in json.loads((run_dir / "processes.json").read_text())["processes"]}
        before = len(_rows(run_dir))
        os.kill(pids["agent1"], signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        hurt = time.monotonic()
        pattern = r"rollout agent agent1 is dead \(([^\n]*)\); re-admitting"
        found = _wait(lambda: re.search(pattern, log_path.read_text()), args.agent_timeout_s + 120, "death line")
        named_s = time.monotonic() - hurt
        _wait(lambda: len(_rows(run_dir)) >= before + 10, 600, "training after the fault")
        walls = [r["wall_s"] for r in _rows(run_dir)]
        stall = max(b - a for a, b in zip(walls[before - 1:], walls[before:]))
        silent = re.search(r"silent for ([0-9.]+) s", found.group(1))
        job.send_signal(signal.SIGTERM)
        code = job.wait(300)
        all_pids = [r["pid"] for r in json.loads((run_dir / "processes.json").read_text())["processes"]]
        time.sleep(2)
        return {"fault": fault, "named_after_s": round(named_s, 2), "why": found.group(1),
                "silence_measured_s": float(silent.group(1)) if silent else None, "max_version_gap_s": round(stall, 2),
                "sigterm_exit": code, "checkpoint": "checkpoint step_" in log_path.read_text(),
                "processes_left": [p for p in all_pids if _alive(p)]}
    finally:
        if job.poll() is None:
            job.kill()


def main(args: DrillArgs, train_args: list[str]) -> dict:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [drill_once(fault, out / f"{fault}{i}", args, train_args)
               for fault in args.faults for i in range(args.repeats)]
    summary = {}
    for fault in args.faults:
        rows = [r for r in results if r["fault"] == fault]
        named = [r["named_after_s"] for r in rows]
        gaps = [r["max_version_gap_s"] for r in rows]
        summary[fault] = {"named_after_s": [min(named), statistics.median(named), max(named)],
                          "max_version_gap_s": [min(gaps), statistics.median(gaps), max(gaps)],
                          "clean_sigterm": all(r["sigterm_exit"] == 143 and r["checkpoint"] and not r["processes_left"]
                                               for r in rows)}
        print(f"{fault:5s}: named dead after {min(named):.1f}-{max(named):.1f} s (median {statistics.median(named):.1f}); "
              f"longest gap between versions {min(gaps):.1f}-{max(gaps):.1f} s; agent_timeout_s={args.agent_timeout_s:g}; "
              f"SIGTERM clean: {summary[fault]['clean_sigterm']}")
    report = {"agent_timeout_s": args.agent_timeout_s, "runs": results, "summary": summary, "train_args": train_args}
    (out / "drill.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    main(tyro.cli(DrillArgs, args=argv[:split]), argv[split + 1:])
