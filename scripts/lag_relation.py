"""Does a sample's version lag follow its own length or its group's longest? Read finished async runs.

    python scripts/lag_relation.py runs/a runs/b [--skip 5]

For each run directory (metrics.jsonl and config.json of `asyncrl train`), prints the measured mean lag per
response-length bucket beside the group and row relations' predictions (`asyncrl_bench.lag_relation`), with R = the
rows the agents keep generating (`run_shape`) and S = the samples a learner step trains (--trainer.mini-batch-size ×
--rollout.n × --async-training.require-batches). Where the staleness window (--async-training.staleness-threshold)
bounds R it also holds finished groups not yet trained, so fewer rows generate: the measured level falls below
R / S, while the shape (lag ∝ the group's longest response) remains.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from asyncrl.algos.staleness import verl_max_required_samples
from asyncrl_bench.lag_relation import bucket_sums, lag_relation


def run_shape(config: dict) -> tuple[int, int, str]:
    """(R, S, what bounds R) of a run from its config.json: R is the least of the agents' slots, the prompts they keep
    in flight × n, and verl's staleness window (`verl_max_required_samples` prompts × n, which also counts groups
    finished but not yet trained, so where it binds R is an upper bound)."""
    rollout, trainer, asyn = config["rollout"], config["trainer"], config["async_training"]
    n, agents = rollout["n"], max(len(config["placement"].get("agent_devices") or ["one"]), 1)
    prompts = rollout.get("max_concurrent_prompts") or max(rollout["max_slots"] // n, 1)
    window = verl_max_required_samples(trainer["mini_batch_size"], asyn.get("require_batches", 1),
                                       asyn["staleness_threshold"], asyn.get("trigger_parameter_sync_step", 1))
    bounds = {"--rollout.max-slots": rollout["max_slots"] * agents, "prompts in flight × n": prompts * n * agents,
              "the staleness window": window * n}
    bound = min(bounds, key=bounds.get)
    return bounds[bound], trainer["mini_batch_size"] * n * asyn.get("require_batches", 1), bound


def report(run_dir: pathlib.Path, skip: int) -> str:
    for name in ("metrics.jsonl", "config.json"):
        if not (run_dir / name).is_file():
            raise SystemExit(f"lag_relation: {run_dir / name} is missing: give the directory of a run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    r, s, bound = run_shape(json.loads((run_dir / "config.json").read_text()))
    try:
        rel = lag_relation(bucket_sums(rows, skip=skip), rows_in_flight=r, samples_per_version=s)
    except ValueError as err:
        raise SystemExit(f"lag_relation: {run_dir}: {err}") from None
    lines = [f"## {run_dir}", "",
             f"R {r} rows (bound by {bound}), S {s} samples a version: R / S = {rel.level:.2f}; measured mean lag {rel.mean_lag:.2f}; "
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
