"""The `make train` job: a real GRPO run with `asyncrl.algos` that must learn."""

import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_train():
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_grpo_demo_reward_rises():
    train = _load_train()
    history = train.main(train.Args(steps=120, seed=0))
    first, last = sum(history[:10]) / 10, sum(history[-10:]) / 10
    # chance is ~1/12 for the right digit; GRPO must get well past it
    assert first < 0.3, f"the task should start hard, got mean reward {first:.3f} over the first 10 steps"
    assert last > 0.7, f"reward did not rise: {first:.3f} -> {last:.3f}"


def test_train_cli_help_and_tiny_run():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--group-size" in out.stdout
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--steps", "2", "--prompts-per-step", "4"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "critic/score/mean" in out.stdout
