"""scripts/fault_drill.py: a smoke run (one SIGKILL of an agent on the toy task) that reports the detection
and a clean SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.run_helpers import ROOT
from tests.timing import limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_fault_drill_smoke_run(tmp_path):
    out = tmp_path / "drill"
    try:
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / "fault_drill.py"), "--repeats", "1", "--faults",
                               "kill", "--out", str(out), "--", "--model.path", "random:tiny-qwen2", "--data.task",
                               "toy"], capture_output=True, text=True, timeout=limit(300), cwd=ROOT)
    except subprocess.TimeoutExpired as err:  # say where it stood: the run's own log and the drill's output
        logs = "".join(f"\n--- {p.name} ---\n{p.read_text()[-4000:]}" for p in sorted(out.glob("*.log")))
        pytest.fail(f"the drill ran past {err.timeout:.0f} s; its output: {err.stdout!r}{logs}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "drill.json").read_text())
    (run,) = report["runs"]
    assert run["fault"] == "kill" and run["sigterm_exit"] == 143 and run["checkpoint"] and not run["processes_left"]
    assert run["named_after_s"] < report["agent_timeout_s"] + limit(30)
    assert "kill : named dead after" in done.stdout
