"""examples/slurm/train.sbatch, run as Slurm would run it on two nodes: a stand-in `srun` starts its command once
per node (SLURM_NODEID 0 and 1) on this host and a stand-in `scontrol` names the first node, so the script's
torchrun launchers rendezvous over loopback and train one small job together; its refusals name the fix."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.rpc.jobs import TOY
from tests.run_helpers import ROOT, torchrun_port
from tests.timing import limit

pytestmark = pytest.mark.e2e

SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"

FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done  # srun's own options
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" & pids+=($!); done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] || exit 1
for ((node = 0; node < SLURM_NNODES; node++)); do echo 127.0.0.1; done
"""


def _slurm_env(tmp_path: pathlib.Path, **settings: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(pathlib.Path(sys.executable).parent), os.environ["PATH"]])
    return {**os.environ, "PATH": path, "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]",
            "SLURM_JOB_NAME": "asyncrl-test", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **settings}


@pytest.mark.slow
def test_the_sbatch_script_trains_one_job_on_two_nodes(tmp_path):
    run_dir = tmp_path / "run"
    env = _slurm_env(tmp_path, ASYNCRL_RUN_TOKEN="0123456789abcdef0123456789abcdef", PRESET="cpu-demo",
                     RUN_DIR=str(run_dir), GPUS_PER_NODE="2", TRAINERS_PER_NODE="1", DEVICE="cpu",
                     MASTER_PORT=str(torchrun_port()))
    out = subprocess.run(["bash", str(SCRIPT), *TOY, "--async-training.total-versions", "3"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=limit(300))
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 3 and summary["dead_agents"] == []
    assert sorted(summary["agents"]) == ["agent0", "agent1"]  # one agent on each node
    config = json.loads((run_dir / "config.json").read_text())
    assert config["placement"]["trainer_devices"] == ["cpu", "cpu"]  # one trainer on each node: one FSDP2 group
    assert config["placement"]["launcher"] == "torchrun"


def test_the_sbatch_script_refuses_what_cannot_run_and_says_why(tmp_path):
    env = _slurm_env(tmp_path)
    env.pop("ASYNCRL_RUN_TOKEN", None)
    out = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=limit(30))
    assert out.returncode != 0 and "export ASYNCRL_RUN_TOKEN (the same on every node)" in out.stderr
    env = _slurm_env(tmp_path, ASYNCRL_RUN_TOKEN="0123456789abcdef0123456789abcdef", GPUS_PER_NODE="4",
                     TRAINERS_PER_NODE="4")
    out = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=limit(30))
    assert out.returncode == 2 and "give 1 <= TRAINERS_PER_NODE < GPUS_PER_NODE" in out.stderr
