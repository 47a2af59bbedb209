"""Async against sync in wall-clock: the held-out accuracy of a run against the time its weights were published,
the time each run takes to reach a target, and the ratio of the two modes' medians with a bootstrap interval
(scripts/wallclock_race.py runs the races; these are the pure parts).

    curve = held_out_curve(read_metrics(run_dir))          # [(seconds from the first version, accuracy, version)]
    t = time_to_target(curve, 0.5)                         # seconds, or None if the run never reached it
    race = race_summary(sync_times, async_times)           # median ratio async / sync, 95 % bootstrap interval

A point's time is when its version was published (the `wall_s` of the metrics row of that version), from the
first version's: so process start-up and the evaluation's own time are left out, and both modes are timed alike.
The initial weights (version 0) are not a point: no version was trained.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["CurvePoint", "held_out_curve", "time_to_target", "RaceSummary", "race_summary"]

HELD_OUT = "val-core/"


class CurvePoint(NamedTuple):
    seconds: float  # when the version was published, from the first version's publication
    accuracy: float  # its held-out metric
    version: int


def held_out_curve(rows: Sequence[dict], key: str | None = None) -> list[CurvePoint]:
    """The held-out evaluations of a run's metrics rows (`metrics.jsonl`), in version order, each at the time its
    version was published. `key`: the `val-core/...` metric (None: the only one the run logged; several without
    `key` is an error naming them)."""
    keys = sorted({k for row in rows for k in row if k.startswith(HELD_OUT)})
    if key is None:
        if len(keys) > 1:
            raise ValueError(f"held_out_curve: the run logged {len(keys)} held-out metrics ({', '.join(keys)}); "
                             "name one")
        key = keys[0] if keys else None
    published: dict[int, float] = {}
    for row in rows:  # a version's first row is its own; an evaluation that ends later may log a row of its own
        if "step" in row and "wall_s" in row:
            published.setdefault(int(row["step"]), float(row["wall_s"]))
    if key is None or not published:
        return []
    first = published[min(published)]
    points = {}
    for row in rows:
        value, version = row.get(key), row.get("val/version")
        if value is None or version is None or not math.isfinite(float(value)):
            continue
        version = int(version)
        if version >= 1 and version in published:
            points[version] = CurvePoint(published[version] - first, float(value), version)
    return [points[v] for v in sorted(points)]


def time_to_target(curve: Sequence[CurvePoint], target: float) -> float | None:
    """Seconds from the first version to the publication of the first version whose held-out accuracy reached
    `target` (None: none did)."""
    return next((p.seconds for p in curve if p.accuracy >= target), None)


class RaceSummary(NamedTuple):
    ratio: float  # median async time / median sync time (< 1: async reached the target sooner)
    ci_low: float  # 95 % percentile-bootstrap interval of that ratio, resampling each mode's runs on its own
    ci_high: float
    sync_median: float
    async_median: float
    sync_reached: int  # runs that reached the target (those that did not count as never: +inf)
    async_reached: int


def race_summary(sync_times: Sequence[float | None], async_times: Sequence[float | None], *, resamples: int = 10_000,
                 seed: int = 0, level: float = 0.95) -> RaceSummary:
    """The ratio of the two modes' median times to a target, with a percentile-bootstrap interval. A run that
    never reached the target counts as +inf (so a median that is one gives an infinite ratio: say so, do not drop
    the run)."""
    if not sync_times or not async_times:
        raise ValueError("race_summary: need at least one run of each mode")
    if not 0 < level < 1:
        raise ValueError(f"race_summary: level must lie in (0, 1), got {level}")
    sync = np.array([math.inf if t is None else float(t) for t in sync_times])
    asyn = np.array([math.inf if t is None else float(t) for t in async_times])
    rng = np.random.default_rng(seed)
    s = np.median(rng.choice(np.sort(sync), size=(resamples, len(sync)), replace=True), axis=1)
    a = np.median(rng.choice(np.sort(asyn), size=(resamples, len(asyn)), replace=True), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = np.where(np.isinf(a) & np.isinf(s), np.nan, a / s)
    ratios = ratios[~np.isnan(ratios)]
    low, high = (np.quantile(ratios, [(1 - level) / 2, (1 + level) / 2]) if ratios.size else (math.nan, math.nan))
    sync_median, async_median = float(np.median(sync)), float(np.median(asyn))
    ratio = async_median / sync_median if not (math.isinf(sync_median) and math.isinf(async_median)) else math.nan
    return RaceSummary(float(ratio), float(low), float(high), sync_median, async_median,
                       int(np.isfinite(sync).sum()), int(np.isfinite(asyn).sum()))
