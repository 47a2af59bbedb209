"""scripts/learning_grid.py: every cell is the run it claims (mode, lag, correction, equal samples), the summary
is mean ± std over seeds, and a tiny grid runs end to end (a run, its checkpoint evaluated, the table)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from asyncrl.algos.staleness import verl_max_required_samples
from asyncrl.config import AsyncConfig, OffPolicyConfig
from scripts import learning_grid
from scripts.learning_grid import CELLS, GridArgs, aggregate, cell_config, table
from tests.run_helpers import ROOT
from tests.timing import limit


def test_cells_train_equal_samples_with_their_mode_lag_and_correction():
    args = GridArgs(steps=96, lag=6.0, mini_batch_size=16, n=8)
    configs = {cell: cell_config(args, cell, seed=1) for cell in CELLS}
    for cell, cfg in configs.items():
        cfg.validate()
        a = cfg.async_training
        assert a.total_versions * a.trigger_parameter_sync_step == 96, cell  # the same learner steps
        assert cfg.seed == cfg.data.seed == 1 and cfg.data.digits == 2
    assert configs["sync"].async_training.colocated and configs["sync"].async_training.staleness_threshold == 0
    stale = configs["stale-partial"].async_training
    assert (stale.staleness_threshold, stale.trigger_parameter_sync_step, stale.partial_rollout) == (0.5, 4, True)
    for cell in ("lag-naive", "lag-corrected", "lag-rejected"):
        a = configs[cell].async_training
        assert (a.staleness_threshold, a.trigger_parameter_sync_step, a.partial_rollout) == (6.0, 1, False)
    naive, corrected, rejected = (configs[c].trainer.off_policy for c in ("lag-naive", "lag-corrected", "lag-rejected"))
    assert naive.use_rollout_log_probs and naive.is_level == "none" and naive.rs_stat == "none"
    assert not corrected.use_rollout_log_probs and corrected.is_level == "token" and corrected.rs_stat == "none"
    assert not rejected.use_rollout_log_probs and rejected.rs_stat == "k1" and rejected.rs_upper == 2.0
    m2po = configs["lag-m2po"].trainer.off_policy
    assert not m2po.use_rollout_log_probs and m2po.m2_threshold == 0.04


def test_cells_of_several_updates_split_the_same_prompts_per_step_into_mini_batches():
    # 16 prompts per learner step either way: M mini-batches of 16 / M groups, one optimizer step each, so the
    # versions (96), samples (96 × 16 × 8 = 12,288) and the rollout's admission per version are the same
    args = GridArgs(steps=96, lag=6.0, mini_batch_size=16, n=8)
    one = cell_config(args, "lag-corrected", seed=0)
    cells = (("lag-dec-m2", 2, "tis", 6.0), ("lag-dec-m4", 4, "tis", 6.0), ("lag-m2po-m4", 4, "m2po", 6.0),
             ("sync-dec-m2", 2, "tis", 0.0), ("sync-dec-m4", 4, "tis", 0.0))
    for cell, updates, correction, staleness in cells:
        cfg = cell_config(args, cell, seed=0)
        cfg.validate()
        a, t = cfg.async_training, cfg.trainer
        assert (a.require_batches, t.mini_batch_size) == (updates, 16 // updates), cell
        assert (a.staleness_threshold, a.trigger_parameter_sync_step, a.partial_rollout, a.total_versions) == \
            (staleness, 1, False, 96), cell
        assert a.colocated == (staleness == 0.0), cell
        # admitted per version: int(mini × require_batches × (1 + 6) × 1) = 112 prompts (16 at staleness 0), as
        # with one update
        assert verl_max_required_samples(t.mini_batch_size, a.require_batches, staleness, 1) == \
            verl_max_required_samples(16, 1, staleness, 1) == (112 if staleness else 16)
        assert not t.off_policy.use_rollout_log_probs, cell  # decoupled: π_prox recomputed before the updates
        if correction == "tis":
            assert t.off_policy == one.trainer.off_policy, cell
        else:
            assert t.off_policy.m2_threshold == 0.04 and t.off_policy.is_level == "none", cell
    assert cell_config(args, "lag-corrected", 0).async_training.require_batches == 1
    # the fp8 cells: the K/V in float8, with the correction fp8 needs (π_old recomputed), beside their bf16 twins
    for fp8, twin in (("sync-fp8", "sync-tis"), ("lag-corrected-fp8", "lag-corrected")):
        a, b = cell_config(args, fp8, 0), cell_config(args, twin, 0)
        a.validate()
        assert (a.rollout.kv_dtype, b.rollout.kv_dtype) == ("fp8", "auto"), fp8
        assert dataclasses.replace(a.rollout, kv_dtype="auto") == b.rollout and a.trainer == b.trainer, fp8
        assert a.async_training == b.async_training and not a.trainer.off_policy.use_rollout_log_probs, fp8
    with pytest.raises(ValueError, match="--mini-batch-size 6: must be a multiple of lag-dec-m4's updates"):
        cell_config(GridArgs(mini_batch_size=6), "lag-dec-m4", 0)
    with pytest.raises(ValueError, match="--steps 10"):
        cell_config(GridArgs(steps=10), "stale-partial", 0)
    with pytest.raises(ValueError, match="--cells async"):
        cell_config(args, "async", 0)


def _flat(config) -> dict:
    """A config's leaves by dotted path."""
    def leaves(d: dict, prefix: str) -> dict:
        out = {}
        for name, value in d.items():
            out.update(leaves(value, f"{prefix}{name}.") if isinstance(value, dict) else {prefix + name: value})
        return out
    return leaves(dataclasses.asdict(config), "")


def _differences(a, b) -> set[str]:
    flat_a, flat_b = _flat(a), _flat(b)
    return {k for k in flat_a.keys() | flat_b.keys() if flat_a.get(k) != flat_b.get(k)}


HAS_DRIFT_BUDGET = "drift_budget" in {f.name for f in dataclasses.fields(AsyncConfig)}


def test_the_staleness_cells_are_the_bypass_cell_with_one_control_changed():
    # lag-naive is the bypass cell (π_old = μ, no weights); each control cell differs from it in its knob alone
    args = GridArgs(steps=96, lag=8.0, mini_batch_size=16, n=8, opsm_threshold=0.05)
    bypass = cell_config(args, "lag-naive", seed=2)
    assert bypass.trainer.off_policy == OffPolicyConfig() and bypass.trainer.off_policy.use_rollout_log_probs
    a = bypass.async_training
    assert (a.staleness_threshold, a.trigger_parameter_sync_step, a.partial_rollout, a.colocated,
            a.require_batches) == (8.0, 1, False, False, 1)
    expected = {"lag-ignore-mu": {"trainer.off_policy.use_rollout_log_probs": False},
                "lag-opsm": {"trainer.off_policy.opsm_threshold": 0.05},
                "lag-ess": {"trainer.off_policy.ess_scaled_lr": True}}
    for cell, knobs in expected.items():
        cfg = cell_config(args, cell, seed=2)
        cfg.validate()
        assert _differences(bypass, cfg) == {"run_dir", *knobs}, cell
        assert {k: _flat(cfg)[k] for k in knobs} == knobs, cell
    ignore = cell_config(args, "lag-ignore-mu", seed=2).trainer.off_policy
    # μ is ignored entirely: no importance weights, rejection, M2PO, OPSM, ESS step or KL toward μ
    assert (ignore.is_level, ignore.rs_stat, ignore.m2_threshold, ignore.opsm_threshold, ignore.ess_scaled_lr,
            ignore.behaviour_kl_coef) == ("none", "none", None, None, False, 0.0)
    assert GridArgs().opsm_threshold == 0.1  # docs/staleness.md's pre-registered δ
    assert cell_config(GridArgs(), "lag-opsm", 0).trainer.off_policy.opsm_threshold == 0.1


@pytest.mark.skipif(not HAS_DRIFT_BUDGET, reason="this checkout's AsyncConfig has no drift_budget "
                                                 "(--async-training.drift-budget) yet")
def test_the_drift_budget_cell_is_the_bypass_cell_with_a_budget():
    args = GridArgs(lag=8.0, drift_budget=0.03)
    cfg = cell_config(args, "lag-drift-budget", seed=0)
    cfg.validate()
    assert _differences(cell_config(args, "lag-naive", seed=0), cfg) == {"run_dir", "async_training.drift_budget"}
    assert cfg.async_training.drift_budget == 0.03 and cfg.async_training.staleness_threshold == 8.0
    assert GridArgs().drift_budget == 0.02
    assert all(cell_config(args, c, 0).async_training.drift_budget is None for c in CELLS if c != "lag-drift-budget")


def test_a_prompt_file_trains_and_evaluates_from_files(monkeypatch):
    args = GridArgs(data_path="data/gsm8k-calc/train.parquet", eval_data_path="data/gsm8k-calc/test.parquet",
                    eval_prompts=1024, eval_n=8, eval_seed=7)
    cfg = cell_config(args, "lag-naive", seed=3)
    cfg.validate()
    assert (cfg.data.path, cfg.data.seed, cfg.data.shuffle) == ("data/gsm8k-calc/train.parquet", 3, True)
    seen = {}
    monkeypatch.setattr(learning_grid, "evaluate", lambda model, data, **kw: seen.update(data=data, **kw) or {})
    learning_grid._eval(args, "ckpt", "cpu")
    data = seen["data"]
    assert (data.path, data.shuffle, data.seed) == ("data/gsm8k-calc/test.parquet", False, 7)  # its first rows
    assert (seen["num_prompts"], seen["n"]) == (1024, 8)
    learning_grid._eval(GridArgs(eval_seed=7), "ckpt", "cpu")  # the built-in sums by default
    assert seen["data"].path is None and seen["data"].digits == 2 and seen["data"].seed == 7
    assert cell_config(GridArgs(), "sync", 0).data.path is None
    with pytest.raises(ValueError, match="--data-path data/x.jsonl: also pass --eval-data-path"):
        cell_config(GridArgs(data_path="data/x.jsonl"), "sync", 0)
    with pytest.raises(ValueError, match="--eval-data-path data/y.jsonl: .* pass it too"):
        cell_config(GridArgs(eval_data_path="data/y.jsonl"), "sync", 0)


def test_the_curve_keeps_the_drift_metrics_and_the_summary_their_run_means(tmp_path):
    rows = [{"training/global_step": 1, "critic/score/mean": 0.5, "actor/behaviour_kl": 0.01,
             "actor/behaviour_k1": 0.02, "actor/behaviour_ess": 0.9, "actor/opsm_masked_fraction": 0.1},
            {"training/global_step": 2, "critic/score/mean": 0.6, "actor/behaviour_kl": 0.03,
             "actor/behaviour_k1": -0.01, "actor/behaviour_ess": 0.8, "actor/lr_scale": 0.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = learning_grid._curve(tmp_path, samples_per_step=4)
    assert [(c["samples"], c["behaviour_kl"], c["behaviour_k1"], c["behaviour_ess"]) for c in curve] == \
        [(4, 0.01, 0.02, 0.9), (8, 0.03, -0.01, 0.8)]
    assert [c["opsm_masked_fraction"] for c in curve] == [0.1, None] and curve[1]["lr_scale"] == 0.8
    # run means: k3 (0.01 + 0.03) / 2 = 0.02, k1 (0.02 − 0.01) / 2 = 0.005; a second seed with k3 0.04, k1 0.015:
    # the cell 0.03 and 0.01
    other = [{"behaviour_kl": 0.04, "behaviour_k1": 0.015}]
    rows = aggregate([_result("lag-opsm", 0, 0.5, 0.5, 7.5, curve), _result("lag-opsm", 1, 0.5, 0.5, 7.5, other)])
    assert rows[0]["drift_kl"] == pytest.approx(0.03) and rows[0]["drift_k1"] == pytest.approx(0.01)
    assert "| 7.50 / 8 | 3.00e-02 / 1.00e-02 | 10 |" in table(rows, None)


def _result(cell: str, seed: int, accuracy: float, reward: float, lag: float, curve=()) -> dict:
    return {"cell": cell, "seed": seed, "samples": 128, "train_s": 10.0, "train_reward_last_quarter": reward,
            "lag_mean": lag, "lag_max": int(lag) + 1, "eval": {"accuracy": accuracy}, "curve": list(curve)}


def test_summary_is_mean_and_std_over_seeds_in_cell_order():
    results = [_result("lag-naive", 1, 0.5, 0.4, 5.5), _result("sync", 0, 0.7, 0.6, 0.0),
               _result("lag-naive", 0, 0.3, 0.2, 6.0), _result("sync", 1, 0.9, 0.8, 0.0)]
    rows = aggregate(results)
    assert [r["cell"] for r in rows] == ["sync", "lag-naive"]
    sync, naive = rows
    assert sync["eval_accuracy"] == pytest.approx((0.8, 0.1414213), rel=1e-5)
    assert naive["train_reward"] == pytest.approx((0.3, 0.1414213), rel=1e-5)
    assert naive["per_seed"] == [0.3, 0.5] and naive["lag_mean"] == pytest.approx(5.75) and naive["lag_max"] == 7
    assert sync["clipfrac"] is None and sync["mismatch_kl"] is None  # no curve recorded them
    text = table(rows, {"accuracy": 0.05})
    assert "| initial model | – | 0 | 0.050 |" in text and "| sync | 2 | 128 | 0.800 ± 0.141 | 0.700 / 0.900 |" in text
    assert text.splitlines()[3].endswith("| 10 | – | – |")


def test_clip_fraction_and_mismatch_kl_are_means_over_steps_then_seeds():
    # seed 0 steps clip 0.01, 0.03 -> 0.02; seed 1 -> 0.04: cell 0.03. KL is recorded by seed 0's second step
    # only (a step without it is skipped, not counted as 0): 0.2
    curves = [[{"clipfrac": 0.01, "mismatch_kl": None}, {"clipfrac": 0.03, "mismatch_kl": 0.2}],
              [{"clipfrac": 0.04}, {"clipfrac": 0.04}]]
    rows = aggregate([_result("lag-dec-m4", s, 0.5, 0.5, 5.8, curve) for s, curve in enumerate(curves)])
    assert rows[0]["clipfrac"] == pytest.approx(0.03) and rows[0]["mismatch_kl"] == pytest.approx(0.2)
    assert table(rows, None).splitlines()[2].endswith("| 0.0300 | 0.2000 |")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_tiny_grid_runs_end_to_end(tmp_path):
    out = tmp_path / "grid"
    cmd = [sys.executable, "-m", "scripts.learning_grid", "--model", "random:tiny-smollm2", "--tokenizer", "smollm2",
           "--cells", "lag-dec-m2", "--seeds", "0", "--steps", "2", "--lag", "1", "--n", "2",
           "--mini-batch-size", "2", "--max-new-tokens", "4", "--slots", "8", "--eval-prompts", "2", "--eval-n", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit(300),
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "lag-dec-m2" / "seed0" / "result.json").read_text())
    assert result["steps"] == 2 and result["samples"] == 8 and result["eval"]["samples"] == 4
    assert [c["step"] for c in result["curve"]] == [1, 2] and result["curve"][-1]["mismatch_kl"] is not None
    assert not (out / "lag-dec-m2" / "seed0" / "checkpoints").exists()  # evaluated, then removed
    assert "| lag-dec-m2 | 1 | 8 |" in (out / "learning_grid.md").read_text()
    assert (out / "initial.json").is_file() and (out / "learning_grid.png").stat().st_size > 10_000
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit(120),
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert again.returncode == 0 and "started" not in again.stdout  # finished runs are not run again
