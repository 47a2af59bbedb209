"""LoRA checkpoints, export, eval, resume checks and the refusals before launch.

A LoRA checkpoint holds the trained tensors (adapters; a critic's adapters and value head) with their optimizer
states and the LoRA settings, never the frozen base; it resumes exactly. `asyncrl export --merged` writes base
+ s·B·A as a directory transformers opens (logits equal to the LoRA model's); without --merged, peft's adapter
format. `asyncrl eval` takes the checkpoint or the merged directory alike; both commands take a run directory
for its newest checkpoint.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from asyncrl.checkpoint import describe_checkpoint, load_checkpoint, save_checkpoint
from asyncrl.launch.train_command import run_config
from asyncrl.config import PPO, CriticConfig, DataConfig, LoraConfig
from asyncrl.evaluate import evaluate
from asyncrl.export import ExportArgs, export
from asyncrl.learner import train_step
from asyncrl.policies.lora import LORA_TARGETS, is_adapter_name
from asyncrl.launch.preflight import preflight
from asyncrl.launch.resume_check import check_resume, run_record
from tests.run_helpers import NO_EVAL
from tests.learner.test_lora_learner import MODEL, groups_for, learner, params
from tests.tolerances import forward_tol

IDS = torch.tensor([[5, 9, 13, 2, 7, 11, 40, 41], [3, 3, 8, 1, 0, 4, 6, 200]])
TINY = ["--model.path", "random:tiny-qwen2", "--data.task", "toy", "--wandb", "off", *NO_EVAL]


def _run_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A run directory whose config.json names the model the learners of test_lora_learner train (as `asyncrl
    train` writes it; every checkpoint copies it as run_config.json)."""
    (tmp_path / "model.json").write_text(json.dumps(MODEL))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {"path": f"random:{tmp_path / 'model.json'}", "seed": 0}}))
    return run


def _trained(algorithm=None):
    state = learner(algorithm=algorithm)
    groups = groups_for(state)
    state, _ = train_step(state, groups)
    return state, groups


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state_dict()["state"].values() for t in s.values()]


@pytest.mark.parametrize("algorithm", [None, PPO(critic=CriticConfig(lr=1e-3))], ids=["grpo", "ppo"])
def test_a_lora_checkpoint_holds_the_trained_tensors_and_resumes_exactly(tmp_path, algorithm):
    state, groups = _trained(algorithm)
    path = save_checkpoint(tmp_path, state)
    saved = torch.load(path / "learner.pt", weights_only=True)
    assert set(saved["policy"]) == set(params(state.policy, adapters=True))  # no base, no tied head
    assert saved["lora"] == describe_checkpoint(path)["lora"] == {
        "rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": list(LORA_TARGETS)}
    if algorithm is not None:
        assert {k for k in saved["critic"] if not is_adapter_name(k)} == {"value_head.weight", "value_head.bias"}
    fresh = learner(algorithm=algorithm, trained=False)  # B = 0: other adapters than the checkpoint's
    load_checkpoint(path, fresh)
    for model in ("policy", "critic") if algorithm is not None else ("policy",):
        want, got = params(getattr(state, model)), params(getattr(fresh, model))
        assert all(torch.equal(want[k], got[k]) for k in want), model
    for a, b in ((state.optimizer, fresh.optimizer), (state.critic_optimizer, fresh.critic_optimizer)):
        if a is not None:
            assert all(torch.equal(x, y) for x, y in zip(_optimizer_state(a), _optimizer_state(b)))
    state, _ = train_step(state, groups)
    fresh, _ = train_step(fresh, groups)
    want, got = params(state.policy), params(fresh.policy)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_loading_a_checkpoint_of_another_kind_is_refused(tmp_path):
    state, _ = _trained()
    path = save_checkpoint(tmp_path, state)
    with pytest.raises(ValueError, match=r"holds LoRA 4/8 on q_proj .* this learner trains full weights"):
        load_checkpoint(path, learner(LoraConfig(), trained=False))
    with pytest.raises(ValueError, match=r"this learner trains LoRA 8/8 on q_proj v_proj .*--lora"):
        load_checkpoint(path, learner(LoraConfig(rank=8, alpha=8.0, target_modules=("q_proj", "v_proj"))))


def test_the_merged_export_loads_in_transformers_and_gives_the_lora_logits(tmp_path):
    import transformers
    state, _ = _trained()
    path = save_checkpoint(_run_dir(tmp_path), state)
    out, what = export(ExportArgs(str(path), str(tmp_path / "merged"), merged=True))
    assert "merged" in what and json.loads((out / "config.json").read_text())["dtype"] == "float32"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        want = state.policy.eval().logits(state.policy(IDS))
        got = hf(IDS).logits.float()
    assert float((got - want).abs().max()) < forward_tol(want, state.policy.config, dtype=torch.float32)


def test_the_adapter_export_is_peft_format(tmp_path):
    state, _ = _trained()
    path = save_checkpoint(_run_dir(tmp_path), state)
    out, what = export(ExportArgs(str(path), str(tmp_path / "adapter")))
    assert what.startswith("LoRA adapters (rank 4, alpha 8)")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == list(LORA_TARGETS) and config["base_model_name_or_path"].startswith("random:")
    from safetensors.torch import load_file
    tensors = load_file(out / "adapter_model.safetensors")
    assert tensors.keys() == {f"base_model.model.{k}" for k in params(state.policy, adapters=True)}
    peft = pytest.importorskip("peft")  # not a dependency: where it is installed, it opens the directory
    import transformers
    from asyncrl.policies.loading import load_model, save_pretrained
    base = save_pretrained(load_model(config["base_model_name_or_path"]), tmp_path / "base")
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), out).eval()
    with torch.no_grad():
        want = state.policy.eval().logits(state.policy(IDS))
        assert float((model(IDS).logits - want).abs().max()) < forward_tol(want, state.policy.config)


def test_export_refusals_name_the_fix(tmp_path):
    state, _ = _trained()
    path = save_checkpoint(tmp_path, state)  # no run config: the base is unknown
    with pytest.raises(ValueError, match="pass --base PATH"):
        export(ExportArgs(str(path), str(tmp_path / "merged"), merged=True))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(ValueError, match="not an empty directory"):
        export(ExportArgs(str(path), str(tmp_path / "used")))
    with pytest.raises(ValueError) as err:
        export(ExportArgs(str(tmp_path / "used"), str(tmp_path / "out")))
    assert str(err.value) == (
        f"CHECKPOINT {tmp_path / 'used'}: not a checkpoint directory (no learner.pt) nor a run directory; give a run "
        "directory (its newest checkpoint) or RUN/checkpoints/step_XXXXXXXX")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")  # a run that has not written a checkpoint yet
    with pytest.raises(ValueError) as err:
        export(ExportArgs(str(run), str(tmp_path / "out")))
    assert str(err.value).startswith(f"RUN_DIR {run}: the run directory holds no checkpoint yet (a run writes one "
                                     "every --checkpoint-every versions and when it ends)")
    assert not (tmp_path / "out").exists()


def test_export_of_a_run_directory_writes_its_newest_checkpoint_saying_which(tmp_path, capsys):
    state, _ = _trained()
    run = _run_dir(tmp_path)
    older = save_checkpoint(run, state)
    state.step += 1
    newest = save_checkpoint(run, state)
    out, what = export(ExportArgs(str(run), str(tmp_path / "adapter")))
    assert f"RUN_DIR {run}: taking its newest checkpoint, {newest.name} (2 in the run)" in capsys.readouterr().err
    assert what.startswith("LoRA adapters (rank 4, alpha 8)") and older.name != newest.name
    from safetensors.torch import load_file
    assert load_file(out / "adapter_model.safetensors").keys() == {
        f"base_model.model.{k}" for k in params(state.policy, adapters=True)}


def test_eval_takes_a_lora_checkpoint_or_its_merged_export_alike(tmp_path):
    state, _ = _trained()
    path = save_checkpoint(_run_dir(tmp_path), state)
    merged, _ = export(ExportArgs(str(path), str(tmp_path / "merged"), merged=True))
    kwargs = dict(num_prompts=3, n=2, max_new_tokens=6, max_slots=8, seed=1)
    from_checkpoint = evaluate(str(path), DataConfig(task="toy"), **kwargs)
    from_merged = evaluate(str(merged), DataConfig(task="toy"), **kwargs)
    for key in ("mean_reward", "accuracy", "mean_response_length"):
        assert from_checkpoint[key] == from_merged[key], key


def _lora_run(run_dir: pathlib.Path, *args: str) -> pathlib.Path:
    """A LoRA run's directory: config.json of `asyncrl train cpu-demo TINY --lora.rank 4 ARGS` and a checkpoint."""
    run_dir.mkdir(parents=True)
    cfg = run_config("cpu-demo", [*TINY, "--run-dir", str(run_dir), "--lora.rank", "4", *args])
    (run_dir / "config.json").write_text(json.dumps(run_record(cfg)))
    return save_checkpoint(run_dir, learner(trained=False))


@pytest.mark.parametrize("args, refused", [
    (["--lora.rank", "8"], "--lora.rank 4 -> 8"), (["--lora.alpha", "16"], "--lora.alpha 32.0 -> 16.0"),
    (["--lora.target-modules", "q_proj", "v_proj"], "--lora.target-modules"), (["--lora.rank", "0"], "4 -> 0"),
    (["--lora.dropout", "0.1"], None)])
def test_a_resume_refuses_another_lora_shape_and_applies_another_dropout(tmp_path, args, refused):
    path = _lora_run(tmp_path / "run")
    check = check_resume(run_config("cpu-demo", [*TINY, "--run-dir", str(tmp_path / "run"), "--resume",
                                                 "--lora.rank", "4", *args]), path)
    if refused is None:
        assert check.problems == [] and check.applied == ["--lora.dropout 0.0 -> 0.1"]
    else:
        [problem] = check.problems
        assert refused in problem and "a resume cannot change" in problem


def test_a_full_weight_run_cannot_resume_as_lora_and_unused_lora_knobs_are_not_compared(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = run_record(run_config("cpu-demo", [*TINY, "--run-dir", str(run_dir)]))
    del config["lora"]  # a run from before LoRA existed
    (run_dir / "config.json").write_text(json.dumps(config))
    path = save_checkpoint(run_dir, learner(LoraConfig(), trained=False))
    base = [*TINY, "--run-dir", str(run_dir), "--resume"]
    [problem] = check_resume(run_config("cpu-demo", [*base, "--lora.rank", "4"]), path).problems
    assert "--lora.rank 0 -> 4" in problem
    check = check_resume(run_config("cpu-demo", [*base, "--lora.alpha", "4"]), path)
    assert check.problems == [] and check.line is None


@pytest.mark.parametrize("args, message", [
    (["--lora.rank", "-1"], "--lora.rank -1 is invalid: must be >= 0"),
    (["--lora.rank", "8", "--lora.alpha", "0"], "--lora.alpha 0.0 is invalid: must be > 0"),
    (["--lora.rank", "8", "--lora.dropout", "1"], "--lora.dropout 1.0 is invalid: must lie in [0, 1)"),
    (["--lora.rank", "8", "--lora.target-modules", "q_proj", "qkv"], "--lora.target-modules q_proj qkv is invalid"),
    (["--lora.rank", "8", "--lora.target-modules", "q_proj", "q_proj"], "--lora.target-modules q_proj q_proj"),
    (["--lora.rank", "8", "--trainer.param-dtype", "bfloat16"], "--trainer.param-dtype bfloat16 is invalid"),
    (["--lora.rank", "32"], "--lora.rank 32 is invalid for random:tiny-qwen2: k_proj (64 -> 32), v_proj (64 -> 32)"),
])
def test_bad_lora_flags_are_refused_before_launch_naming_the_flag(tmp_path, args, message):
    report = preflight(run_config("cpu-demo", [*TINY, "--run-dir", str(tmp_path / "r"), *args]))
    assert any(message in p for p in report.problems), report.problems
    assert not (tmp_path / "r").exists()


def test_the_preflight_states_what_lora_trains(tmp_path):
    report = preflight(run_config("cpu-demo", [*TINY, "--run-dir", str(tmp_path / "r"), "--lora.rank", "8"]))
    assert report.ok, report.problems
    [fact] = [f for f in report.facts if f.startswith("lora:")]
    # per layer 8 × (q 64+64, k 64+32, v 64+32, o 64+64, gate 64+128, up 64+128, down 128+64) = 8 × 1024; 2 layers
    assert "16,384 trained parameters" in fact and "alpha 32 (scale 4)" in fact


@pytest.mark.slow
def test_a_short_lora_run_publishes_adapters_resumes_and_exports(tmp_path, caplog, capsys):
    """`asyncrl train --lora.rank 4` (in this process, the local launcher: adapter publications, checkpoint), then
    `--resume` for two more versions, then `asyncrl export RUN_DIR --merged`: the run's newest checkpoint."""
    import logging
    import transformers
    from asyncrl.export import export_main
    from tests.run_helpers import train_here
    run_dir = tmp_path / "lora"
    common = ["cpu-demo", *TINY, "--lora.rank", "4", "--run-dir", str(run_dir)]
    train_here(*common, "--async-training.total-versions", "3", "--checkpoint-every", "3")
    with caplog.at_level(logging.INFO, logger="asyncrl"):
        train_here(*common, "--async-training.total-versions", "5", "--checkpoint-every", "5", "--resume")
    assert "resuming from step_00000003" in caplog.text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # a publication is the adapters: 2 layers × rank 4 × (in + out summed over the 7 layers: 1024) fp32 numbers
    assert {r["param_sync/bytes"] for r in rows} == {2 * 4 * 1024 * 4}
    assert all(r["actor/skipped_updates"] == 0 for r in rows)
    last = run_dir / "checkpoints" / "step_00000005"
    first = torch.load(run_dir / "checkpoints" / "step_00000003" / "learner.pt", weights_only=True)["policy"]
    saved = torch.load(last / "learner.pt", weights_only=True)["policy"]
    assert saved.keys() == first.keys() and all(is_adapter_name(k) for k in saved)
    assert any(not torch.equal(saved[k], first[k]) for k in saved)  # the resumed run trained on
    capsys.readouterr()
    export_main([str(run_dir), str(tmp_path / "merged"), "--merged"])
    out = capsys.readouterr()
    assert f"RUN_DIR {run_dir}: taking its newest checkpoint, step_00000005 (2 in the run)" in out.err
    assert "asyncrl export: wrote the policy merged with its base" in out.out
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").config.model_type == "qwen2"
