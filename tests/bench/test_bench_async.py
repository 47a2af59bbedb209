"""`asyncrl bench async` on CPU: real (tiny) runs of two modes produce the table, results.json and the plot;
variant strings parse or fail naming the key; rates are computed from metrics.jsonl after the warm-up."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import AsyncConfig

from asyncrl_bench.async_runs import AsyncBenchArgs, _table, bench_async, parse_variant, summarize, variant_config

pytestmark = pytest.mark.slow

TINY = dict(devices=("cpu", "cpu"), model="random:tiny-qwen2", n=2, mini_batch_size=4, max_new_tokens=8,
            max_prompt_length=32, slots=16, steps=4, threads_per_process=1)


@pytest.mark.e2e
def test_sync_and_stale_partial_runs_write_table_results_and_plot(tmp_path):
    args = AsyncBenchArgs(variants=("sync", "stale-partial:trigger=2"), out=str(tmp_path), **TINY)
    results = bench_async(args)
    assert [r["variant"] for r in results] == ["sync", "stale-partial:trigger=2"]
    sync, stale = results
    assert "error" not in sync and "error" not in stale, results
    assert sync["trainer_devices"] == sync["agent_devices"] == ["cpu", "cpu"]  # colocated on both devices
    assert stale["trainer_devices"] == ["cpu"] and stale["agent_devices"] == ["cpu"]
    assert sync["version_lag_max"] == 0  # on-policy
    assert sync["steps_measured"] == 4 and stale["steps_measured"] == 4  # warm-up version left out
    for r in results:
        assert r["tokens_per_s"] > 0 and r["time_per_step_s"] > 0 and 0 <= r["rollouter_idle_ratio"] <= 1
        books = r["ledger"]  # a run that ends on a checkpoint carries what it had not finished to it
        assert books["admitted"] == books["trained"] + books["dropped"] + books.get("carried", 0), books
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["reference_broadcast"]["bytes"] > 0 and saved["reference_broadcast"]["seconds"] > 0
    table = (tmp_path / "bench_async.md").read_text()
    assert "| sync | 2+2 (colocated) |" in table and "1.00×" in table
    assert (tmp_path / "bench_async.png").stat().st_size > 10_000
    assert "by response length" in table and all(r["lag_by_length"] for r in results)


def test_variants_parse_and_bad_ones_name_the_key():
    mode, knobs = parse_variant("stale-partial:staleness=0.1,trigger=1,partial=0,split=2+2,slots=64")
    assert mode == "stale-partial"
    assert knobs == dict(staleness=0.1, trigger=1, partial=False, split=(2, 2), slots=64)
    with pytest.raises(ValueError, match="unknown mode 'async'"):
        parse_variant("async")
    with pytest.raises(ValueError, match="unknown key 'stalness'"):
        parse_variant("stream:stalness=1")
    args = AsyncBenchArgs(**{**TINY, "devices": ("cpu", "cpu", "cpu")})
    cfg = variant_config(args, "stale-partial:split=2+1")
    assert cfg.placement.trainer_devices == ("cpu", "cpu") and cfg.placement.agent_devices == ("cpu",)
    assert cfg.async_training.total_versions == 1 + 1  # 4 steps at trigger 4, plus the warm-up version
    with pytest.raises(ValueError, match="split 3\\+1 needs 4"):
        variant_config(args, "stream:split=3+1")
    twice = AsyncBenchArgs(**{**TINY, "devices": ("cuda:0", "cuda:0")})
    with pytest.raises(ValueError, match="--devices cuda:0 cuda:0 lists cuda:0 twice"):
        variant_config(twice, "sync")  # colocated: a trainer rank on each device
    assert variant_config(twice, "stale-partial").placement.agent_devices == ("cuda:0",)  # 1+1 may share a GPU
    sync = variant_config(args, "sync").async_training  # a run's default: colocated engines sleep while training
    assert sync.colocated and sync.colocated_sleep is AsyncConfig.colocated_sleep is True
    assert variant_config(args, "sync:sleep=0").async_training.colocated_sleep is False
    assert variant_config(args, "stale-partial:split=2+1").rollout.max_concurrent_prompts is None  # a run's default
    assert variant_config(args, "stale-partial:split=2+1,prompts=3").rollout.concurrent_prompts == 3


def test_summarize_counts_only_versions_after_the_warm_up(tmp_path):
    rows = [
        {"step": 1, "wall_s": 10.0, "training/global_step": 2, "training/num_groups": 4, "perf/total_num_tokens": 999},
        {"step": 2, "wall_s": 12.0, "training/global_step": 4, "training/num_groups": 4, "perf/total_num_tokens": 100,
         "trainer/idle_ratio": 0.5, "training/version_lag/mean": 1.0, "training/version_lag/max": 2,
         "fully_async/count/staleness_samples": 3, "fully_async/static/max_required_samples": 6,
         "training/version_lag/by_length/16/count": 6, "training/version_lag/by_length/16/lag_sum": 3,
         "training/version_lag/by_length/256/count": 2, "training/version_lag/by_length/256/lag_sum": 4},
        {"step": 3, "wall_s": 14.0, "training/global_step": 6, "training/num_groups": 4, "perf/total_num_tokens": 300,
         "trainer/idle_ratio": 0.1, "training/version_lag/mean": 0.0, "training/version_lag/max": 1,
         "fully_async/count/staleness_samples": 6, "fully_async/static/max_required_samples": 6},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    s = summarize(tmp_path, n=2)
    assert s["wall_s"] == 4.0 and s["steps_measured"] == 4
    assert s["tokens_per_s"] == 100.0  # (100 + 300) / 4 s; the warm-up's 999 left out
    assert s["samples_per_s"] == 4 * 4 * 2 / 4.0
    assert s["trainer_idle_ratio"] == pytest.approx(0.3) and s["version_lag_max"] == 2
    assert s["queue_utilisation"] == pytest.approx(0.75)
    assert s["lag_by_length"] == {"16": [6, 0.5], "256": [2, 2.0]}
    table = _table([{**s, "variant": "stale", "trainer_devices": ["cpu"], "agent_devices": ["cpu"],
                     "roofline_tok_s": None, "roofline_fraction": None}], None)
    assert "| variant | ≤ 16 | ≤ 256 |" in table and "| stale | 0.50 (6) | 2.00 (2) |" in table
    with pytest.raises(ValueError, match="raise --steps"):
        (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]))
        summarize(tmp_path, n=2)
