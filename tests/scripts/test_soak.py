"""scripts/soak.py: the RSS summary on known samples, and a smoke run on the toy task."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.run_helpers import ROOT
from tests.timing import limit

sys.path.insert(0, str(ROOT / "scripts"))
import soak  # noqa: E402


def test_summary_measures_growth_from_the_end_of_the_warmup_with_medians():
    # a process at 100 MB that jumps to 130 MB for single samples (transient buffers) and ends at 110 MB
    samples = [{"minute": m, "role": "agent0", "rss_kb": 1024 * (100 + (30 if m % 3 == 0 else 0) + (10 if m >= 50 else 0))}
               for m in range(0, 61)]
    r = soak.summarize(samples, warmup_min=10, window_min=5)["agent0"]
    assert r["rss_after_warmup_mb"] == 100 and r["rss_end_mb"] == 110 and r["growth_pct"] == 10.0
    assert r["slope_mb_per_hour"] > 0
    assert soak.slope_mb_per_hour([(0, 1.0), (60, 3.0)]) == pytest.approx(2.0)


@pytest.mark.e2e
@pytest.mark.slow
def test_soak_smoke_run_samples_every_process(tmp_path):
    out = tmp_path / "soak"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--minutes", "0.25", "--out", str(out),
                           "--every-s", "1", "--warmup-minutes", "0.05", "--window-minutes", "0.05", "--",
                           "--model.path", "random:tiny-qwen2", "--data.task", "toy"],
                          capture_output=True, text=True, timeout=limit(240), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "soak.json").read_text())
    assert result["returncode"] == 0
    assert set(result["processes"]) == {"trainer0", "agent0", "agent1"}
    assert all(r["rss_end_mb"] > 50 for r in result["processes"].values())
    assert (out / "rss.png").is_file() and "soak:" in done.stdout
