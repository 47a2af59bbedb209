"""Which length a sample's version lag follows (asyncrl_bench/lag_relation.py, scripts/lag_relation.py): golden values
of the two relations, the sums read off metrics rows, and a real fully-async run (in this process) whose lags follow
each group's longest response, not each sample's own length."""

from __future__ import annotations

import json
import math

import pytest

from asyncrl.algos.staleness import LengthBucket
from asyncrl.tracking.report import BY_LENGTH_PREFIX as BY_LENGTH, length_bucket_sums
from asyncrl_bench.lag_relation import lag_relation
from scripts import lag_relation as script
from tests.run_helpers import NO_EVAL, train_here

BUCKETS = {4: LengthBucket(2, 2, 7, 8), 128: LengthBucket(1, 5, 100, 120)}


def test_lag_relation_golden_values():
    rel = lag_relation(BUCKETS, rows_generating=32.0, samples_per_version=16)
    assert (rel.level, rel.mean_lag) == (2.0, pytest.approx(7 / 3))
    assert (rel.mean_length, rel.mean_group_length) == (pytest.approx(107 / 3), pytest.approx(128 / 3))
    small, large = rel.buckets
    assert small[:5] == (4, 2, 3.5, 4.0, 1.0) and large[:5] == (128, 1, 100.0, 120.0, 5.0)
    g = [2 * 4 * 3 / 107, 2 * 120 * 3 / 107]  # (mean group longest / E[L]) · R / S
    assert (small.group_prediction, large.group_prediction) == (pytest.approx(g[0]), pytest.approx(g[1]))
    assert small.row_prediction == pytest.approx(2 * 3.5 * 3 / 107) and large.row_prediction == pytest.approx(600 / 107)
    assert rel.group_rms == pytest.approx(math.sqrt((2 * (1 - g[0]) ** 2 + (5 - g[1]) ** 2) / 3))
    k = (2 * 1 * g[0] + 5 * g[1]) / (2 * g[0] ** 2 + g[1] ** 2)  # scaled to fit: Σ w·lag·p / Σ w·p²
    assert rel.group_shape_rms == pytest.approx(math.sqrt((2 * (1 - k * g[0]) ** 2 + (5 - k * g[1]) ** 2) / 3))
    assert rel.group_shape_rms <= rel.group_rms


def test_lag_relation_refuses_what_it_cannot_relate():
    with pytest.raises(ValueError, match="rows_generating 0"):
        lag_relation(BUCKETS, rows_generating=0, samples_per_version=16)
    with pytest.raises(ValueError, match="no trained samples"):
        lag_relation({}, rows_generating=8, samples_per_version=4)
    with pytest.raises(ValueError, match="no response length"):
        lag_relation({1: LengthBucket(3, 1, 0, 0)}, rows_generating=8, samples_per_version=4)


def test_the_bucket_sums_add_every_window_and_field():
    def row(bucket, count, lag, length, group):
        return {f"{BY_LENGTH}{bucket}/count": count, f"{BY_LENGTH}{bucket}/lag_sum": lag,
                f"{BY_LENGTH}{bucket}/length_sum": length, f"{BY_LENGTH}{bucket}/group_length_sum": group,
                "training/version_lag/mean": 9.0}
    rows = [row(4, 9, 9, 9, 9), row(4, 2, 2, 7, 8), {**row(4, 1, 0, 3, 3), **row(128, 1, 5, 100, 120)}]
    assert length_bucket_sums(rows[1:]) == {4: (3, 2, 10, 11), 128: (1, 5, 100, 120)}
    assert length_bucket_sums(rows[:1]) == {4: (9, 9, 9, 9)}
    assert length_bucket_sums([{f"{BY_LENGTH}8/count": 2, f"{BY_LENGTH}8/lag_sum": 3}]) == {8: (2, 3, 0, 0)}


def test_a_fully_async_run_lags_by_its_groups_longest_response(tmp_path, capsys):
    """Groups of 4 with geometric lengths (random weights, a 256-token vocabulary: the end token 1 in ~256, up to 512
    tokens): a sample's lag follows the longest response of its group, which the agent waits for to deliver it, and
    the slots its finished samples free are taken by waiting groups."""
    run = tmp_path / "run"
    train_here("cpu-demo", "--model.path", "random:tiny-qwen2", "--data.task", "toy", "--rollout.n", "4",
               "--rollout.max-new-tokens", "512", "--rollout.max-slots", "32", "--rollout.max-concurrent-prompts", "16",
               "--trainer.mini-batch-size", "4",
               "--trainer.max-response-length", "512", "--async-training.staleness-threshold", "4",
               "--async-training.total-versions", "20", "--checkpoint-every", "0", "--wandb", "off", *NO_EVAL,
               "--run-dir", str(run))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    running = [r["rollouter/running_rows"] for r in rows[5:]]
    assert all(0 <= x <= 32 for x in running)  # 0: a window without an engine step
    # 2 × slots / n prompts in flight: waiting groups take the slots finished samples free, so most slots generate
    # (0.92-0.95 measured; with slots / n prompts, the default, about E[L] / E[Lmax], 0.49)
    assert sum(running) / len(running) > 0.6 * 32, running
    rel = lag_relation(length_bucket_sums(rows[5:]), rows_generating=sum(running) / len(running), samples_per_version=16)
    assert len(rel.buckets) >= 5 and rel.mean_group_length > 1.3 * rel.mean_length, rel  # lengths spread
    assert rel.group_shape_rms < rel.row_shape_rms / 3, rel
    assert rel.group_rms < rel.row_rms, rel
    script.main([str(run)])
    out = capsys.readouterr().out
    assert f"rows generating of 32 slots, S 16 samples a version: R / S = {rel.level:.2f}" in out
    assert out.count("\n| ≤ ") == len(rel.buckets)
    with pytest.raises(SystemExit, match="metrics.jsonl is missing"):
        script.main([str(tmp_path)])
