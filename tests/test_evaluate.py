"""`asyncrl eval`: the pass@k estimator, a smoke eval of a tiny random model on the toy task, eval from
checkpoint directories (a hand-made one and a real run's) and from a run directory (its newest checkpoint),
argument errors, and the CLI."""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

from asyncrl.checkpoint import save_checkpoint
from asyncrl.config import GRPO, DataConfig, TrainerConfig
from asyncrl.evaluate import eval_main, evaluate, pass_at_k
from asyncrl.learner import build_learner
from asyncrl.policies import ARCH_PRESETS, random_model, save_pretrained
from tests.cli_forks import cli_forks
from tests.run_helpers import ROOT, tiny_run

TOY = DataConfig(task="toy")
TINY = dict(num_prompts=6, n=4, max_new_tokens=6, max_slots=16)


def same_numbers(a: dict, b: dict) -> bool:
    drop = ("model", "seconds")
    return {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 2, 0.5),            # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 1, 1, 0.25),           # pass@1 = c/n
    (4, 2, 2, 5 / 6),          # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (4, 0, 4, 0.0),            # nothing correct
    (4, 4, 1, 1.0),            # everything correct
    (5, 2, 4, 1.0),            # n - c < k: every 4-subset holds a correct sample
    (10, 3, 5, 11 / 12),       # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (16, 1, 16, 1.0),
])
def test_pass_at_k_golden_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)


def test_smoke_eval_of_a_tiny_random_model_is_sane():
    result = evaluate("random:tiny-qwen2", TOY, k=(1, 2, 4), success_threshold=0.75, **TINY)
    assert result["prompts"] == 6 and result["n"] == 4 and result["samples"] == 24 and result["task"] == "toy"
    assert 0.0 <= result["mean_reward"] <= 1.0
    assert 1 <= result["mean_response_length"] <= 6
    assert 0.0 <= result["truncated_fraction"] <= 1.0
    assert result["pass@1"] == pytest.approx(result["accuracy"])  # the unbiased pass@1 is the mean correctness
    assert 0.0 <= result["pass@1"] <= result["pass@2"] <= result["pass@4"] <= 1.0
    assert result["reward_errors"] == 0
    # fixed seeds: the same evaluation again gives the same numbers; another seed samples differently
    assert same_numbers(result, evaluate("random:tiny-qwen2", TOY, k=(1, 2, 4), success_threshold=0.75, **TINY))


def test_greedy_samples_agree_so_pass_at_k_is_pass_at_1():
    result = evaluate("random:tiny-qwen2", TOY, k=(1, 4), temperature=0.0, success_threshold=0.5, **TINY)
    assert result["pass@1"] == pytest.approx(result["pass@4"])
    assert result["pass@1"] * TINY["num_prompts"] == pytest.approx(round(result["pass@1"] * TINY["num_prompts"]))


def test_eval_from_a_checkpoint_matches_the_same_weights_as_an_hf_dir(tmp_path):
    # weights unlike `random:tiny-qwen2` (a larger init), so reading anything but the checkpoint would show
    policy = random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.2), seed=3)
    state = build_learner(policy, TrainerConfig(mini_batch_size=1), GRPO())
    checkpoint = save_checkpoint(tmp_path / "run", state)
    hf_dir = save_pretrained(policy, tmp_path / "hf")
    from_checkpoint = evaluate(str(checkpoint), TOY, k=(1, 4), success_threshold=0.5, **TINY)
    from_hf = evaluate(str(hf_dir), TOY, k=(1, 4), success_threshold=0.5, **TINY)
    assert same_numbers(from_checkpoint, from_hf)
    assert from_checkpoint["model"] == str(checkpoint)
    # no run config.json next to checkpoints/ and a task that needs a tokenizer: the error says what to pass
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate(str(checkpoint), DataConfig(task="arithmetic"), **TINY)
    # an HF directory without tokenizer files, likewise (transformers would build an empty tokenizer)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        evaluate(str(hf_dir), DataConfig(task="arithmetic"), **TINY)


def _run_with_two_checkpoints(run: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A run directory holding step 1 and step 2 of different weights (step 2's unlike `random:tiny-qwen2`)."""
    older = build_learner(random_model(ARCH_PRESETS["tiny-qwen2"], seed=1), TrainerConfig(mini_batch_size=1), GRPO())
    newer = build_learner(random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.2), seed=3),
                          TrainerConfig(mini_batch_size=1), GRPO())
    older.step, newer.step = 1, 2
    return save_checkpoint(run, older), save_checkpoint(run, newer)


def test_a_run_directory_is_evaluated_at_its_newest_checkpoint_saying_which(tmp_path, capsys):
    run = tmp_path / "run"
    _, newest = _run_with_two_checkpoints(run)
    from_run = evaluate(str(run), TOY, k=(1, 4), success_threshold=0.5, **TINY)
    assert f"--model {run}: taking its newest checkpoint, step_00000002 (2 in the run)" in capsys.readouterr().err
    assert from_run["model"] == str(newest)
    assert same_numbers(from_run, evaluate(str(newest), TOY, k=(1, 4), success_threshold=0.5, **TINY))
    # the command: RUN_DIR as its argument (or --model RUN_DIR), not both
    eval_main([str(run), "--data.task", "toy", "--num-prompts", "2", "--n", "1", "--max-new-tokens", "2"])
    out = capsys.readouterr()
    assert json.loads(out.out.strip().splitlines()[-1])["model"] == str(newest)
    assert f"RUN_DIR {run}: taking its newest checkpoint, step_00000002 (2 in the run)" in out.err
    both = f"RUN_DIR {run} and --model smollm2x both name what to evaluate"
    with pytest.raises(SystemExit, match=re.escape(both)):
        eval_main([str(run), "--model", "smollm2x", "--data.task", "toy"])
    with pytest.raises(SystemExit, match=re.escape(f"RUN_DIR {newest}: not a run directory")):
        eval_main([str(newest), "--data.task", "toy"])  # a checkpoint goes to --model


def test_a_run_directory_without_a_checkpoint_is_refused_naming_the_argument_and_the_fix(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"async_training": {}, "model": {"path": "random:tiny-qwen2"}}))
    with pytest.raises(ValueError) as err:
        evaluate(str(run), TOY, **TINY)
    assert str(err.value) == (
        f"--model {run}: the run directory holds no checkpoint yet (a run writes one every --checkpoint-every "
        "versions and when it ends); give a run directory that holds one, or a checkpoint directory "
        "RUN/checkpoints/step_XXXXXXXX")
    (run / "metrics.jsonl").write_text("")
    (run / "config.json").unlink()  # a run's files other than its config tell a run directory too
    refused = f"asyncrl eval: RUN_DIR {run}: the run directory holds no checkpoint yet"
    with pytest.raises(SystemExit, match=re.escape(refused)):
        eval_main([str(run), "--data.task", "toy"])


@pytest.mark.e2e
def test_eval_from_a_real_runs_checkpoint(tmp_path_factory):
    run_dir = tiny_run(tmp_path_factory)
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert (checkpoint / "learner.pt").is_file()
    result = evaluate(str(checkpoint), TOY, k=(1, 2), success_threshold=0.75, **TINY)
    assert result["samples"] == 24 and 0.0 <= result["mean_reward"] <= 1.0
    # the run's model path (random:tiny-qwen2) has no tokenizer, so a text task names the fix
    with pytest.raises(ValueError, match="--tokenizer"):
        evaluate(str(checkpoint), DataConfig(task="arithmetic"), **TINY)


@pytest.mark.parametrize("kwargs, field", [(dict(k=(5,)), "k"), (dict(k=(0,)), "k"),
                                            (dict(num_prompts=0), "num_prompts"), (dict(max_slots=2), "max_slots"),
                                            (dict(temperature=-1.0), "temperature")])
def test_bad_arguments_name_the_field(kwargs, field):
    args = {**TINY, **kwargs}
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} .* is invalid"):
        evaluate("random:tiny-qwen2", TOY, **args)


@pytest.mark.e2e
def test_cli_help_and_smoke_run(tmp_path):
    target, missing = tmp_path / "eval" / "result.json", tmp_path / "run" / "checkpoints" / "step_00000020"
    helped, ran, bad_k, no_checkpoint, out = cli_forks([
        ["eval", "--help"],
        ["eval", "--model", "random:tiny-qwen2", "--data.task", "toy", "--num-prompts", "4", "--n", "2", "--k", "1",
         "2", "--max-new-tokens", "4", "--out", str(target)],
        ["eval", "--model", "random:tiny-qwen2", "--data.task", "toy", "--n", "2", "--k", "3"],
        ["eval", "--model", str(missing), "--data.task", "toy"],
        ["eval", "--model", str(tmp_path / "nope"), "--data.task", "toy"]], cwd=ROOT, env={"OMP_NUM_THREADS": "1"})
    assert helped.returncode == 0
    for flag in ("--model", "--data.task", "--num-prompts", "--n", "--k", "--tokenizer", "--out"):
        assert flag in helped.stdout, flag
    assert ran.returncode == 0, ran.stderr[-2000:]
    printed = json.loads(ran.stdout.strip().splitlines()[-1])
    assert printed["prompts"] == 4 and "pass@1" in printed and "pass@2" in printed
    assert json.loads(target.read_text()) == printed
    assert bad_k.returncode != 0 and "--k 3 is invalid" in bad_k.stderr
    assert no_checkpoint.returncode != 0 and f"--model {missing}: no such checkpoint" in no_checkpoint.stderr
    assert "--checkpoint-every" in no_checkpoint.stderr and "Traceback" not in no_checkpoint.stderr
    assert out.returncode != 0 and "does not exist" in out.stderr and "Traceback" not in out.stderr


def test_speculation_evaluates_the_same_samples_and_reports_its_acceptance():
    """Greedy evaluation with drafts: the same scores as without (speculation is lossless), and what it kept."""
    from asyncrl.config.speculation import SpeculationConfig
    kwargs = dict(TINY, max_new_tokens=24)
    plain = evaluate("random:tiny-qwen2", TOY, k=(1,), temperature=0.0, **kwargs)
    spec = evaluate("random:tiny-qwen2", TOY, k=(1,), temperature=0.0, speculation=SpeculationConfig(tokens=4),
                    **kwargs)
    assert same_numbers(plain, {k: v for k, v in spec.items() if k != "speculation_acceptance"})
    assert "speculation_acceptance" not in plain and 0.0 <= spec["speculation_acceptance"] <= 1.0
