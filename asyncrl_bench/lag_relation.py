"""Which response length a sample's version lag follows, read off a finished async run's metrics.

In a rollout-bound run every generating row gains one token a decode step, so with R rows generating (on average)
samples finish at R / E[L] a step, and with S samples trained a learner step the version advances every
E[L] · S / R steps. A response of L tokens therefore spans about (L / E[L]) · (R / S) versions: the *row* relation.
But an agent delivers a GRPO group only when its last sibling ends, so every sample of a group is trained about
(Lmax / E[L]) · (R / S) versions after its group started, Lmax being the group's longest response, whatever the
sample's own length: the *group* relation. The run logs, per response-length bucket, each sample's length, its
group's longest length and its lag (`training/version_lag/by_length/<bucket>/...`), and the rows generating
(`rollouter/running_rows`); `lag_relation` sets both predictions beside the measured lag.

    buckets = length_bucket_sums(rows[5:])           # {bucket: LengthBucket}, asyncrl.tracking.report
    rel = lag_relation(buckets, rows_generating=28.0, samples_per_version=16)
    rel.group_rms, rel.row_rms                       # how far each prediction is from the measured lags
    rel.group_shape_rms, rel.row_shape_rms           # ... each scaled to fit best: which length the lag follows
"""

from __future__ import annotations

import math
from typing import NamedTuple

from asyncrl.algos.staleness import LengthBucket

__all__ = ["BucketLag", "LagRelation", "lag_relation"]

class BucketLag(NamedTuple):
    bucket: int  # the bucket's upper length (a power of two)
    samples: int
    mean_length: float
    mean_group_length: float  # the mean of its samples' groups' longest response
    lag: float  # measured: the mean version lag of its samples
    group_prediction: float  # (mean_group_length / E[L]) · R / S
    row_prediction: float  # (mean_length / E[L]) · R / S


class LagRelation(NamedTuple):
    buckets: list[BucketLag]
    mean_length: float  # E[L] over every sample
    mean_group_length: float  # E[Lmax] over every sample
    mean_lag: float
    level: float  # R / S: the mean lag the row relation predicts (the group relation: E[Lmax] / E[L] times it)
    group_rms: float  # sample-weighted RMS of measured − group prediction over the buckets
    row_rms: float  # ... − row prediction
    group_shape_rms: float  # the same with each prediction scaled to fit best (least squares): which length the lag
    row_shape_rms: float  # follows, whatever its level (a slow trainer or a binding window shifts the level)


def lag_relation(buckets: dict[int, LengthBucket], *, rows_generating: float, samples_per_version: int) -> LagRelation:
    """Measured mean lag per length bucket beside the group and row relations' predictions (module docstring), with
    R = `rows_generating` (the mean over the run) and S = `samples_per_version`."""
    if not rows_generating > 0 or samples_per_version < 1:
        raise ValueError(f"lag_relation: rows_generating {rows_generating} must be > 0 and samples_per_version "
                         f"{samples_per_version} >= 1")
    total = sum(b.count for b in buckets.values())
    if not total:
        raise ValueError("lag_relation: no trained samples in the buckets")
    mean_length = sum(b.length_sum for b in buckets.values()) / total
    mean_group = sum(b.group_length_sum for b in buckets.values()) / total
    if not mean_length:
        raise ValueError("lag_relation: no response length in the buckets (runs before 2026-11-29 did not log "
                         "length_sum), or every response is empty")
    level = rows_generating / samples_per_version
    out = []
    for bucket, b in buckets.items():
        length, group = b.length_sum / b.count, b.group_length_sum / b.count
        out.append(BucketLag(bucket, b.count, length, group, b.lag_sum / b.count, level * group / mean_length,
                             level * length / mean_length))

    def rms(predicted: str, fit: bool = False) -> float:
        pred = [getattr(r, predicted) for r in out]
        scale = 1.0
        if fit and any(pred):  # argmin_k Σ w (lag − k·pred)²
            scale = sum(r.samples * r.lag * x for r, x in zip(out, pred)) / sum(r.samples * x * x for r, x in zip(out, pred))
        return math.sqrt(sum(r.samples * (r.lag - scale * x) ** 2 for r, x in zip(out, pred)) / total)

    return LagRelation(out, mean_length, mean_group, sum(b.lag_sum for b in buckets.values()) / total, level,
                       rms("group_prediction"), rms("row_prediction"), rms("group_prediction", fit=True),
                       rms("row_prediction", fit=True))
