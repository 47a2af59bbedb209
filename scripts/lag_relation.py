"""Does a sample's version lag follow its own length or its group's longest? Read finished async runs.

    python scripts/lag_relation.py runs/a runs/b [--skip 5]

For each run directory (metrics.jsonl and config.json of `asyncrl train`), prints the measured mean lag per
response-length bucket beside the group and row relations' predictions (`asyncrl_bench.lag_relation`), with R = the
rows generating (the run's `rollouter/running_rows`, a mean per agent, times the agents) and S = the samples a learner
step trains (--trainer.mini-batch-size × --rollout.n × --async-training.require-batches).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

from asyncrl.tracking.report import length_bucket_sums
from asyncrl_bench.lag_relation import lag_relation


def run_shape(config: dict, rows: list[dict]) -> tuple[float, int]:
    """(R, S) of a run: its rows generating, measured, and its samples a learner step, from its config.json."""
    rollout, trainer, asyn = config["rollout"], config["trainer"], config["async_training"]
    agents = len(config["placement"]["agent_devices"])
    running = [r["rollouter/running_rows"] for r in rows if "rollouter/running_rows" in r]
    if not running:
        raise ValueError("no rollouter/running_rows in its metrics (runs before it was logged lack it)")
    return statistics.fmean(running) * agents, trainer["mini_batch_size"] * rollout["n"] * asyn.get("require_batches", 1)


def report(run_dir: pathlib.Path, skip: int) -> str:
    for name in ("metrics.jsonl", "config.json"):
        if not (run_dir / name).is_file():
            raise SystemExit(f"lag_relation: {run_dir / name} is missing: give the directory of a run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    config = json.loads((run_dir / "config.json").read_text())
    try:
        r, s = run_shape(config, rows[skip:])
        rel = lag_relation(length_bucket_sums(rows[skip:]), rows_generating=r, samples_per_version=s)
    except ValueError as err:
        raise SystemExit(f"lag_relation: {run_dir}: {err}") from None
    lines = [f"## {run_dir}", "",
             f"R {r:.1f} rows generating of {config['rollout']['max_slots']} slots, S {s} samples a version: "
             f"R / S = {rel.level:.2f}; measured mean lag {rel.mean_lag:.2f}; "
             f"E[L] {rel.mean_length:.1f}, E[Lmax] {rel.mean_group_length:.1f}; RMS error: group relation "
             f"{rel.group_rms:.2f}, row relation {rel.row_rms:.2f} versions (each scaled to fit best: "
             f"{rel.group_shape_rms:.2f}, {rel.row_shape_rms:.2f})", "",
             "| length bucket | samples | mean length | mean group longest | lag | group relation | row relation |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| ≤ {b.bucket} | {b.samples} | {b.mean_length:.1f} | {b.mean_group_length:.1f} | {b.lag:.2f} | "
              f"{b.group_prediction:.2f} | {b.row_prediction:.2f} |" for b in rel.buckets]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="run directories of asyncrl train")
    parser.add_argument("--skip", type=int, default=5, help="metrics rows left out at the start (pipeline fill)")
    args = parser.parse_args(argv)
    if args.skip < 0:
        parser.error(f"--skip {args.skip}: must be >= 0")
    sys.stdout.write("\n".join(report(d, args.skip) for d in args.runs))


if __name__ == "__main__":
    main()
