"""`asyncrl report`: a real run's metrics.jsonl renders into valid PNGs and a report.md listing them;
metrics a run did not log are skipped; a bad run directory errors naming the file."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from asyncrl.tracking.report import summarize, write_report
from tests.cli_forks import cli_forks
from tests.run_helpers import ROOT, tiny_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_FIGURES = {"reward.png", "throughput.png", "version_lag.png", "lag_by_length.png", "drift.png", "idle.png"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    return tiny_run(tmp_path_factory)


def assert_png(path: pathlib.Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > 5000, f"{path} is suspiciously small ({len(data)} bytes)"
    from PIL import Image
    with Image.open(path) as image:
        image.verify()
        assert image.size[0] >= 300 and image.size[1] >= 200


def synthetic_rows(versions: int = 4) -> list[dict]:
    """Rows with the controller's key names and hand-picked values."""
    rows = []
    for v in range(1, versions + 1):
        rows.append({"step": v, "wall_s": 10.0 * v, "critic/score/mean": [0.2, 0.6, 0.5, 0.9][v - 1],
                     "reward/accuracy": [0.1, 0.5, 0.4, 0.8][v - 1], "perf/throughput": 100.0 * v,
                     "trainer/idle_ratio": 0.1 * v, "rollouter/idle_ratio": 0.5, "timing_s/param_sync": 0.25 * v,
                     "training/version_lag/hist/0": 3, **({"training/version_lag/hist/2": 1} if v % 2 else {}),
                     "actor/behaviour_k1": [2e-4, -1e-5, 4e-4, 8e-4][v - 1], "actor/behaviour_kl": 1e-4 * v,
                     "actor/behaviour_ess": [1.0, 0.99, 0.95, 0.9][v - 1],
                     # 3 short samples at lag 0 a version; a long one at lag 2 every other version
                     "training/version_lag/by_length/8/count": 3, "training/version_lag/by_length/8/lag_sum": 0,
                     "training/version_lag/by_length/8/length_sum": 18,
                     "training/version_lag/by_length/8/group_length_sum": 24 + (500 if v % 2 else 0),
                     "rollouter/running_rows": 10.0 * v,
                     **({"training/version_lag/by_length/512/count": 1, "training/version_lag/by_length/512/lag_sum": 2,
                         "training/version_lag/by_length/512/length_sum": 500,
                         "training/version_lag/by_length/512/group_length_sum": 500} if v % 2 else {})})
    return rows


def write_rows(run_dir: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


@pytest.mark.e2e
def test_real_run_renders_every_figure(run_dir, tmp_path):
    out = tmp_path / "figures"
    paths = write_report(run_dir, out)
    pngs = [p for p in paths if p.suffix == ".png"]
    assert {p.name for p in pngs} == ALL_FIGURES  # the real run logs every plotted metric
    assert all(p.parent == out for p in pngs)
    for png in pngs:
        assert_png(png)
    report = run_dir / "report.md"
    assert paths[-1] == report
    text = report.read_text()
    for png in pngs:
        assert f"]({pathlib.Path(os.path.relpath(png, run_dir)).as_posix()})" in text
    assert "critic/score/mean first" in text and "mean trainer/idle_ratio" in text
    assert "mean timing_s/param_sync" in text and "total wall time" in text


@pytest.mark.e2e
def test_default_out_dir_is_the_run_dir_report_folder(run_dir):
    paths = write_report(run_dir)
    assert {p.name for p in paths[:-1]} == ALL_FIGURES
    text = (run_dir / "report.md").read_text()
    for name in ALL_FIGURES:
        assert f"](report/{name})" in text


def test_synthetic_summary_numbers(tmp_path):
    rows = synthetic_rows()
    s = summarize(rows)
    assert s["critic/score/mean"] == {"first": 0.2, "last": 0.9, "best": 0.9, "best_version": 4}
    assert s["reward/accuracy"]["first"] == 0.1 and s["reward/accuracy"]["best"] == 0.8
    assert s["wall_s"] == 40.0
    assert s["mean_trainer_idle_ratio"] == pytest.approx(0.25)
    assert s["mean_rollouter_idle_ratio"] == pytest.approx(0.5)
    assert s["mean_param_sync_s"] == pytest.approx(0.625)
    assert s["trained_groups"] == 14  # 4 × 3 at lag 0 + 2 × 1 at lag 2
    assert s["mean_version_lag"] == pytest.approx(4 / 14)
    assert s["mean_behaviour_k1"] == pytest.approx(1.39e-3 / 4) and s["mean_behaviour_ess"] == pytest.approx(0.96)
    assert s["mean_running_rows"] == pytest.approx(25.0)
    assert s["lag_by_length"] == {  # the long sample's group lends its length to two short ones' (lag 0 here)
        "8": {"samples": 12, "mean_lag": 0.0, "mean_length": 6.0, "mean_group_length": (4 * 24 + 2 * 500) / 12},
        "512": {"samples": 2, "mean_lag": 2.0, "mean_length": 500.0, "mean_group_length": 500.0}}
    paths = write_report(write_rows(tmp_path / "run", rows))
    assert {p.name for p in paths[:-1]} == ALL_FIGURES
    text = paths[-1].read_text()
    assert "| critic/score/mean best | 0.9 (version 4) |" in text
    assert "| trained groups (lag histogram) | 14 |" in text
    assert "| mean actor/behaviour_ess | 0.96 |" in text
    assert "| ≤ 8 | 12 | 0.00 | 6 | 91.33 |" in text and "| ≤ 512 | 2 | 2.00 | 500 | 500 |" in text
    assert "| mean rollouter/running_rows (rows generating a decode step, per agent) | 25 |" in text


def test_missing_metrics_are_skipped(tmp_path):
    # only a reward: one figure; an idle ratio logged as null (non-finite) is ignored
    rows = [{"step": v, "wall_s": float(v), "critic/score/mean": 0.1 * v, "trainer/idle_ratio": None}
            for v in range(1, 4)]
    paths = write_report(write_rows(tmp_path / "reward-only", rows))
    assert [p.name for p in paths] == ["reward.png", "report.md"]
    assert_png(paths[0])
    text = paths[-1].read_text()
    assert "reward/accuracy | — (not logged)" in text and "mean trainer/idle_ratio | — |" in text

    # nothing plottable at all (and no wall_s): a report.md that says so, no PNG, no error
    paths = write_report(write_rows(tmp_path / "bare", [{"step": 1, "actor/pg_loss": 0.1}]))
    assert [p.name for p in paths] == ["report.md"]
    assert "No figure" in paths[0].read_text()


def test_bad_run_dir_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"nowhere/metrics\.jsonl: no metrics file"):
        write_report(tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2,\n')
    with pytest.raises(ValueError, match=r"broken/metrics\.jsonl:2: not a JSON line"):
        write_report(tmp_path / "broken")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty/metrics\.jsonl: no rows"):
        write_report(tmp_path / "empty")


@pytest.mark.e2e
def test_cli_help_run_and_bad_dir(run_dir, tmp_path):
    helped, out, missing = cli_forks([["report", "--help"], ["report", str(run_dir), "--out", str(tmp_path / "cli")],
                                      ["report", str(tmp_path / "missing-run")]], cwd=ROOT)
    assert helped.returncode == 0 and "RUN_DIR" in helped.stdout and "--out" in helped.stdout
    assert out.returncode == 0, out.stderr[-2000:]
    printed = [pathlib.Path(line) for line in out.stdout.split()]
    assert {p.name for p in printed} == ALL_FIGURES | {"report.md"}
    assert all(p.is_file() for p in printed)
    assert missing.returncode != 0
    assert f"{tmp_path / 'missing-run' / 'metrics.jsonl'}" in missing.stderr


def test_held_out_evaluations_are_summarized_by_their_version_and_plotted(tmp_path):
    """Evaluation rows (`--eval.*`): their own rows at the step they ended in, x = the version they evaluated;
    the summary tabulates first / last / best held-out accuracy and counts versions, not rows."""
    rows = synthetic_rows()
    rows.insert(1, {"step": 1, "wall_s": 12.0, "val/version": 0, "val-core/sums/reward/mean@1": 0.25})
    rows.append({"step": 4, "wall_s": 44.0, "val/version": 4, "val-core/sums/reward/mean@1": 0.75})
    rows[3].update({"val/version": 2, "val-core/sums/reward/mean@1": 0.5})
    s = summarize(rows)
    assert s["versions"] == 4
    assert s["val-core/sums/reward/mean@1"] == {"first": 0.25, "last": 0.75, "best": 0.75, "best_version": 4}
    assert s["critic/score/mean"]["best_version"] == 4
    paths = write_report(write_rows(tmp_path / "run", rows))
    assert "reward.png" in {p.name for p in paths}
    assert "| val-core/sums/reward/mean@1 best | 0.75 (version 4) |" in paths[-1].read_text()
    reward_only = [{"step": 1, "wall_s": 3.0, "val/version": 0, "val-core/sums/reward/mean@1": 0.1}]
    assert [p.name for p in write_report(write_rows(tmp_path / "eval-only", reward_only))] == ["reward.png", "report.md"]
