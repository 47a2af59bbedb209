"""scripts/bench_channel.py: a tiny run on CPU publishes over each backend (CUDA IPC, unavailable there, falls
back to gloo and says so in its row), the agent's weights match rank 0's after every publication, and the table
names both."""

from __future__ import annotations

import json
import sys

import pytest

from tests.run_helpers import ROOT
from tests.timing import limit

sys.path.insert(0, str(ROOT / "scripts"))
import bench_channel  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(limit(240))
def test_a_tiny_bench_publishes_over_each_backend(capsys, tmp_path):
    out = tmp_path / "channel.json"
    rows = bench_channel.main(bench_channel.Args(model="tiny-qwen2", device="cpu", reps=2, out=str(out)))
    assert [(r["backend"], r["used"], r["reps"]) for r in rows] == [("cuda_ipc", "gloo", 2), ("gloo", "gloo", 2)]
    for row in rows:
        assert row["bytes"] > 0 and row["buckets"] == 1
        assert 0 <= row["transfer_ms"]["min"] <= row["transfer_ms"]["median"] <= row["transfer_ms"]["max"]
    assert json.loads(out.read_text())["rows"] == rows
    assert "transfer" in capsys.readouterr().out
