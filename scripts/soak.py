"""Soak test: run a training job for hours and sample the resident memory (RSS) of every process of it.

    python scripts/soak.py --minutes 120 --out runs/soak                      # cpu-demo, SmolLM2, 2 agents
    python scripts/soak.py --minutes 3 --warmup-minutes 1 -- --model.path random:tiny-qwen2 --data.task toy

It starts `asyncrl train cpu-demo` (two rollout agents by default; options after `--` go to it; its run dir is
`OUT/run`) with a time budget, reads the run's processes.json every `--every-s` seconds and records each process's RSS from /proc. At the end it writes
`rss.csv`, `soak.json` (per process: RSS after the warm-up and at the end, as medians over
`--window-minutes`, their ratio, and a least-squares slope in MB per hour after the warm-up) and `rss.png`,
and prints the table. Linux only (/proc).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import tyro


@dataclasses.dataclass
class SoakArgs:
    minutes: float = 120.0
    """Length of the training (its --async-training.time-budget-s)."""
    out: str = "runs/soak"
    """Run directory of the job; the soak's files go there too."""
    every_s: float = 60.0
    """Seconds between RSS samples."""
    warmup_minutes: float = 10.0
    """Growth is measured from the end of the warm-up to the end of the run."""
    window_minutes: float = 5.0
    """RSS at a point = the median of the samples in this many minutes (a process's RSS swings with its
    transient buffers)."""
    agents: int = 2
    """Rollout agent processes."""


def rss_kb(pid: int) -> int | None:
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def processes(run_dir: pathlib.Path) -> dict[str, int]:
    path = run_dir / "processes.json"
    try:
        return {row["role"]: row["pid"] for row in json.loads(path.read_text())["processes"]}
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def slope_mb_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minutes, MB) points, in MB per hour."""
    if len(points) < 2:
        return 0.0
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return 60.0 * sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def summarize(samples: list[dict], warmup_min: float, window_min: float) -> dict[str, dict]:
    """Per role: median RSS (MB) in the window after the warm-up and in the last window, growth, slope. A role's
    warm-up starts when it was first sampled (the launcher lists a process once it has started it)."""
    out = {}
    end = max(s["minute"] for s in samples)
    for role in sorted({s["role"] for s in samples}):
        points = [(s["minute"], s["rss_kb"] / 1024) for s in samples if s["role"] == role]
        warm = min(m for m, _ in points) + warmup_min
        after = [mb for m, mb in points if warm <= m < warm + window_min]
        last = [mb for m, mb in points if m > end - window_min]
        if not after or not last:
            continue
        start_mb, end_mb = statistics.median(after), statistics.median(last)
        out[role] = {"rss_after_warmup_mb": round(start_mb, 1), "rss_end_mb": round(end_mb, 1),
                     "growth_pct": round(100 * (end_mb / start_mb - 1), 2),
                     "slope_mb_per_hour": round(slope_mb_per_hour([p for p in points if p[0] >= warm]), 1),
                     "samples": len(points)}
    return out


def plot(samples: list[dict], path: pathlib.Path, warmup_min: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    for role in sorted({s["role"] for s in samples}):
        pts = [(s["minute"], s["rss_kb"] / 2**20) for s in samples if s["role"] == role]
        ax.plot([m for m, _ in pts], [g for _, g in pts], label=role)
    ax.axvline(warmup_min, color="grey", linestyle=":", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS (GiB)")
    ax.set_title("RSS of every process of the run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: SoakArgs, train_args: list[str]) -> dict:
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"  # the run's own directory: a run is refused in one that holds other files
    devices = ["cpu"] * args.agents
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", "cpu-demo", "--run-dir", str(run_dir), "--wandb", "off",
           "--async-training.total-versions", "1000000", "--async-training.time-budget-s", str(args.minutes * 60),
           "--placement.agent-devices", *devices, *train_args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(out / "soak.log", "w") as log:
        job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    start, samples = time.monotonic(), []
    with open(out / "rss.csv", "w") as csv:
        csv.write("minute,role,pid,rss_kb\n")
        while job.poll() is None:
            minute = (time.monotonic() - start) / 60
            for role, pid in processes(run_dir).items():
                kb = rss_kb(pid)
                if kb is not None:
                    samples.append({"minute": minute, "role": role, "pid": pid, "rss_kb": kb})
                    csv.write(f"{minute:.2f},{role},{pid},{kb}\n")
            csv.flush()
            time.sleep(args.every_s)
    if not samples:
        tail = "".join((out / "soak.log").read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise SystemExit(f"soak: the run (exit {job.returncode}) listed no process to sample; its log ends:\n{tail}")
    result = {"returncode": job.returncode, "minutes": round((time.monotonic() - start) / 60, 1),
              "processes": summarize(samples, args.warmup_minutes, args.window_minutes), "command": cmd}
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    if samples:
        plot(samples, out / "rss.png", args.warmup_minutes)
    print(f"soak: {result['minutes']} min, exit {job.returncode}; RSS (MB) after {args.warmup_minutes:g} min -> end")
    for role, r in result["processes"].items():
        print(f"  {role:10s} {r['rss_after_warmup_mb']:9.1f} -> {r['rss_end_mb']:9.1f}  ({r['growth_pct']:+.2f} %, "
              f"slope {r['slope_mb_per_hour']:+.1f} MB/h, {r['samples']} samples)")
    return result


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    main(tyro.cli(SoakArgs, args=argv[:split]), argv[split + 1:])
