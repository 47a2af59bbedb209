"""Reward plug-ins through `asyncrl train` in a multi-process run: verl's and asyncrl's signatures, sync and
async, a reward that raises, one that returns NaN, one that times out; the console warns, the summary says
so, and `--strict-rewards` stops the run naming the reward."""

from __future__ import annotations

import json
import pathlib
import subprocess
import textwrap

import pytest

from tests.cli_forks import Command, start
from tests.run_helpers import NO_EVAL
from tests.timing import limit

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT = ["--model.path", "random:tiny-smollm2", "--model.tokenizer", "smollm2", "--wandb", "off",
        "--rollout.n", "2", "--rollout.max-new-tokens", "4", "--trainer.mini-batch-size", "6",
        "--async-training.total-versions", "2", *NO_EVAL]
SOURCES = ("verl", "ours", "judge", "raises", "nan", "slow")

PLUGINS = {
    "verl_style.py": """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            assert data_source == "verl" and extra_info["k"] == 1
            return 1.0
    """,
    "ours.py": """
        def score(response, ground_truth, *, data_source, prompt, lang="?"):
            assert data_source == "ours" and lang == "en" and prompt.startswith("Say")
            return {"score": 0.5, "style": 2.0, "note": "not a number: ignored"}
    """,
    "judge.py": """
        import asyncio

        async def judge(response, ground_truth, **row):
            await asyncio.sleep(0.01)  # a judge model behind HTTP
            return 0.25

        async def slow(response, ground_truth, **row):
            await asyncio.sleep(30)
            return 1.0
    """,
    "bad.py": """
        def raises(response, ground_truth, **row):
            raise KeyError("no such field")

        def nan(response, ground_truth, **row):
            return float("nan")
    """,
}


def _setup(tmp_path: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
    for name, code in PLUGINS.items():
        (tmp_path / name).write_text(textwrap.dedent(code))
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Say {source} {i}"}], "data_source": source,
             "reward_model": {"ground_truth": "x"}, "extra_info": {"k": 1}, "lang": "en"}
            for i in range(2) for source in SOURCES]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    specs = [f"verl={tmp_path / 'verl_style.py'}:compute_score", f"ours={tmp_path / 'ours.py'}:score",
             f"judge={tmp_path / 'judge.py'}:judge", f"slow={tmp_path / 'judge.py'}:slow",
             f"raises={tmp_path / 'bad.py'}:raises", f"nan={tmp_path / 'bad.py'}:nan"]
    return data, specs


def _start(tmp_path: pathlib.Path, name: str, *args) -> Command:
    """`asyncrl train cpu-demo ARGS` started in the background (tests/cli_forks.py), its output to NAME.out and
    NAME.err."""
    return start(["train", "cpu-demo", *args], cwd=ROOT, stdout=tmp_path / f"{name}.out",
                 stderr=tmp_path / f"{name}.err")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_tokenizer) -> dict[str, tuple[subprocess.CompletedProcess, pathlib.Path]]:
    """The two runs of this file side by side (each spends much of its time waiting on the slow reward): one that
    goes on through the failing rewards, and one with `--strict-rewards`."""
    tmp_path = tmp_path_factory.mktemp("reward-plugins")
    data, specs = _setup(tmp_path)
    common = [*TEXT, "--data.path", data, "--reward.fn", *specs]
    procs = {
        "lenient": _start(tmp_path, "lenient", *common, "--run-dir", tmp_path / "lenient", "--reward.timeout-s", "1",
                          "--reward.error-warn-share", "0.3"),
        # the slow reward is cut off instead of holding the exit for 30 s
        "strict": _start(tmp_path, "strict", *common, "--run-dir", tmp_path / "strict", "--strict-rewards",
                         "--reward.timeout-s", "1"),
    }
    try:
        for proc in procs.values():
            proc.wait(limit(600))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return {name: (subprocess.CompletedProcess(proc.args, proc.returncode, (tmp_path / f"{name}.out").read_text(),
                                               (tmp_path / f"{name}.err").read_text()), tmp_path / name)
            for name, proc in procs.items()}


def test_plugins_score_count_failures_and_warn(runs):
    out, run_dir = runs["lenient"]
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = summary["rewards"]
    assert rewards["calls"] > 0 and rewards["errors"] > 0 and rewards["timeouts"] > 0
    examples = "\n".join(rewards["examples"])
    assert "bad.py:raises" in examples and "KeyError" in examples and "data_source='raises', row " in examples
    assert "bad.py:nan" in examples and "nan" in examples and "data_source='nan', row " in examples
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["reward/error_share"] <= 1 for r in rows)
    assert any(r.get("reward/style") == 2.0 for r in rows)  # an extra number of a dict result
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    by_reward = {s["reward"] for s in samples}
    assert by_reward <= {1.0, 0.5, 0.25, 0.0}
    lines = [line for line in out.stdout.splitlines() if line.startswith("v ")]
    assert lines and all(len(line) < 120 for line in lines)
    assert any("% of rewards failed" in line for line in lines)
    assert "more than 30% of the rewards failed in" in out.stdout
    assert f"rewards: {rewards['calls']} scored, {rewards['errors']} errors, {rewards['timeouts']} timeouts" in out.stdout


def test_strict_rewards_stop_the_run_naming_the_reward_once(runs):
    out, _ = runs["strict"]
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("asyncrl train: the run failed: ") and "bad.py:" in last, out.stderr[-4000:]
    assert "Traceback" not in last and "On WorkerInfo" not in last
