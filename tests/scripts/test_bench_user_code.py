"""scripts/bench_user_code.py: a tiny run scores every group in both places and reports their ratio."""

from __future__ import annotations

import sys

import pytest

from tests.run_helpers import ROOT
from tests.timing import limit

sys.path.insert(0, str(ROOT / "scripts"))
import bench_user_code  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(limit(240))
def test_a_tiny_bench_measures_both_ways_and_their_ratio(capsys):
    rows = bench_user_code.main(bench_user_code.Args(groups=6, n=2, workers=(1,)))
    [row] = rows
    assert row["workers"] == 1 and row["groups_per_s_workers"] > 0 and row["groups_per_s_thread"] > 0
    assert row["ratio"] == pytest.approx(row["groups_per_s_workers"] / row["groups_per_s_thread"])
    assert "groups/s in workers" in capsys.readouterr().out
