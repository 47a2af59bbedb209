"""The training CLI: `--help` reads, and a tiny fully-async run (2 processes over RPC) completes and
writes its config, metrics and summary."""

import json
import pathlib
import subprocess
import sys

import pytest

from tests.cli_forks import cli_forks
from tests.run_helpers import NO_EVAL, tiny_run, torchrun_port
from tests.timing import limit

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args, timeout=limit(240)):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """This file's commands that start no process, as forks of one prepared process (tests/cli_forks.py)."""
    named = {"help": ["train", "--help"], "invalid": ["train", "cpu-demo", "--rollout.n", "0", "--wandb", "off"]}
    return dict(zip(named, cli_forks(list(named.values()), cwd=tmp_path_factory.mktemp("commands"))))


def test_help_lists_presets_and_fields(commands):
    out = commands["help"]
    assert out.returncode == 0 and "cpu-demo" in out.stdout
    out = _run("scripts/train.py", "cpu-demo", "--help")
    assert out.returncode == 0
    for field in ("--async-training.staleness-threshold", "--rollout.n", "--trainer.optim.lr", "algorithm:grpo"):
        assert field in out.stdout, f"{field} missing from --help"


def test_tiny_fully_async_run_writes_metrics(tmp_path_factory):
    run_dir = tiny_run(tmp_path_factory)  # `asyncrl train cpu-demo` on the toy task, 3 versions (shared, read only)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("critic/score/mean", "fully_async/count/staleness_samples", "trainer/idle_ratio",
                "rollouter/idle_ratio", "timing_s/param_sync", "perf/throughput", "training/version_lag/max"):
        assert key in rows[-1], key
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 3
    ledger = summary["ledger"]
    # its last version is checkpointed: the prompts still open are carried to the checkpoint
    assert ledger["admitted"] == ledger["trained"] + ledger["dropped"] + ledger["carried"]
    assert json.loads((run_dir / "config.json").read_text())["model"]["path"] == "random:tiny-qwen2"


def test_invalid_config_names_the_field(commands):
    out = commands["invalid"]
    assert out.returncode != 0
    assert "--rollout.n 0 is invalid: must be >= 1" in out.stderr and "Traceback" not in out.stderr


def test_torchrun_launch_runs_the_same_roles(tmp_path):
    # the multi-node path on one machine: torchrun starts 3 processes, roles come from RANK
    run_dir = tmp_path / "torchrun"
    out = _run("-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(torchrun_port()),
               "-m", "asyncrl.cli", "train", "cpu-demo", "--model.path", "random:tiny-qwen2", "--data.task", "toy",
               "--async-training.total-versions", "2", "--wandb", "off", *NO_EVAL, "--run-dir", str(run_dir),
               "--placement.launcher", "torchrun", "--placement.agent-devices", "cpu", "cpu")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 2 and summary["dead_agents"] == []


def test_torchrun_with_the_wrong_process_count_names_the_fix(tmp_path):
    out = _run("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(torchrun_port()),
               "-m", "asyncrl.cli", "train", "cpu-demo", "--model.path", "random:tiny-qwen2", "--data.task", "toy",
               "--wandb", "off", "--run-dir", str(tmp_path / "bad"), "--placement.launcher", "torchrun",
               "--placement.agent-devices", "cpu", "cpu")
    assert out.returncode != 0
    assert "placement needs 3" in out.stderr + out.stdout
