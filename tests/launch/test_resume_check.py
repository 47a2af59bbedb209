"""What a resume may change (`asyncrl.launch.resume_check`, checked by the preflight before anything starts): the
optimizer and its schedule are applied to the restored optimizer, never replaced by the checkpoint's; the
algorithm, the model and the staleness window are refused naming the flag; changed data (a file's content, the
task's seed) is refused unless --resume-allow-data-change, and then the data cursor is clamped to the new
data; harmless changes are listed with the applied ones in one line."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

from asyncrl.checkpoint import load_checkpoint, save_checkpoint
from asyncrl.config import DataConfig, RunConfig
from asyncrl.data.sources import DatasetSource
from asyncrl.learner.state import make_scheduler
from asyncrl.launch.preflight import preflight
from asyncrl.config.presets import PRESETS
from asyncrl.launch.resume_check import check_resume, data_fingerprint, run_record
from asyncrl.types import Prompt
from tests.dist_helpers import build, trainer_config
from tests.run_helpers import NO_EVAL

TINY = ["--model.path", "random:tiny-qwen2", "--data.task", "toy", "--wandb", "off", *NO_EVAL]


# ------------------------------------------------------------------- the optimizer takes this run's settings
def _stepped(algorithm: str = "grpo", steps: int = 3, **kw):
    """A learner after `steps` optimizer steps (gradients of ones), so moments and the schedule have moved."""
    state = build(algorithm, **kw)
    optimizers = [(state.optimizer, state.scheduler, state.policy)]
    if state.critic is not None:
        optimizers.append((state.critic_optimizer, state.critic_scheduler, state.critic))
    for _ in range(steps):
        for optimizer, scheduler, model in optimizers:
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()
            scheduler.step()
    return state


def test_a_resume_with_another_lr_betas_weight_decay_and_schedule_trains_with_them(tmp_path):
    saved = _stepped()  # lr 1e-3, warmup 2 then cosine to 0.1 lr over 40 steps, AdamW defaults
    path = save_checkpoint(tmp_path, saved)
    moments = {k: v["exp_avg"].clone() for k, v in saved.optimizer.state_dict()["state"].items()}
    assert saved.scheduler.last_epoch == 3

    optim = dict(lr=5e-4, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6, warmup_steps=5, schedule="constant")
    resumed = build("grpo", seed=1, config=trainer_config(optim=optim))
    load_checkpoint(path, resumed)
    [group] = resumed.optimizer.param_groups
    # step 3 of the new schedule: still in the 5-step warmup, (3 + 1) / (5 + 1) of the new peak lr
    assert group["lr"] == pytest.approx(5e-4 * 4 / 6, rel=1e-12) and group["initial_lr"] == 5e-4
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.1)
    assert resumed.scheduler.base_lrs == [5e-4] and resumed.scheduler.get_last_lr() == [group["lr"]]
    # the moments and the step count are the checkpoint's
    state = resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(state[k]["exp_avg"], v) for k, v in moments.items())
    assert resumed.scheduler.last_epoch == 3
    # and the schedule goes on as configured: constant after the warmup
    for _ in range(3):
        resumed.optimizer.step()
        resumed.scheduler.step()
    assert group["lr"] == 5e-4


def test_the_critic_takes_its_new_lr_and_a_fixed_kl_beta_its_new_value(tmp_path):
    path = save_checkpoint(tmp_path, _stepped("ppo", algo_kwargs=dict(kl_in_reward_coef=0.1)))
    from asyncrl.config import CriticConfig
    resumed = build("ppo", algo_kwargs=dict(critic=CriticConfig(lr=3e-3), kl_in_reward_coef=0.2))
    load_checkpoint(path, resumed)
    factor = make_scheduler(torch.optim.SGD([torch.zeros(1)], lr=1.0), resumed.config.optim).lr_lambdas[0](3)
    assert resumed.critic_optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * factor, rel=1e-12)
    assert resumed.kl_coef == 0.2


# -------------------------------------------------------------------------- the preflight's comparison
def _cfg(run_dir: pathlib.Path, *args: str) -> RunConfig:
    import tyro
    return tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1], args=[*TINY, "--run-dir", str(run_dir), *args])


def _checkpointed(run_dir: pathlib.Path, *args: str, algorithm: str = "grpo") -> pathlib.Path:
    """A run directory as `asyncrl train cpu-demo ARGS` leaves it: its config.json and a checkpoint (of a tiny
    learner: the comparison reads the checkpoint's copy of the config, not its weights)."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(run_record(_cfg(run_dir, *args))))
    state = build(algorithm)
    state.step = 20
    return save_checkpoint(run_dir, state)


def test_a_resume_lists_the_applied_and_the_harmless_changes_in_one_line(tmp_path):
    _checkpointed(tmp_path / "run")
    report = preflight(_cfg(tmp_path / "run", "--resume", "--trainer.optim.lr", "2e-6", "--trainer.optim.betas",
                            "0.9", "0.95", "--async-training.total-versions", "30", "--checkpoint-every", "5"))
    assert report.problems == []
    [line] = [n for n in report.notes if n.startswith("resume from")]
    assert line == ("resume from step_00000020 changes applied from here: --trainer.optim.lr 2e-05 -> 2e-06, "
                    "--trainer.optim.betas 0.9 0.999 -> 0.9 0.95; harmless: --async-training.total-versions 20 -> 30, "
                    "--checkpoint-every 20 -> 5")
    assert f"resume: from {tmp_path / 'run' / 'checkpoints' / 'step_00000020'}" in report.facts
    # nothing changed: nothing to list
    assert not [n for n in preflight(_cfg(tmp_path / "run", "--resume")).notes if n.startswith("resume from")]


def test_a_resume_with_another_algorithm_is_refused(tmp_path):
    _checkpointed(tmp_path / "run")
    report = preflight(_cfg(tmp_path / "run", "--resume", "algorithm:dapo"))
    assert report.problems == [
        "--resume: step_00000020 was trained with algorithm:grpo, this run asks for algorithm:dapo (the loss, the "
        "advantage estimator and the critic's state come with the algorithm): resume with algorithm:grpo, or start "
        "a new run (--overwrite, or another --run-dir)"]


def test_the_algorithm_of_meta_json_is_compared_when_the_run_config_is_missing(tmp_path):
    path = _checkpointed(tmp_path / "run", algorithm="ppo")
    (path / "run_config.json").unlink()  # a checkpoint of an older asyncrl
    check = check_resume(_cfg(tmp_path / "run", "--resume"), path)
    assert check.problems[0].startswith("--resume: step_00000020 was trained with algorithm:ppo, this run asks "
                                        "for algorithm:grpo")
    assert "holds no copy of its run's config" in check.notes[0]


def test_what_cannot_change_on_resume_is_refused_naming_the_flag(tmp_path):
    _checkpointed(tmp_path / "run")
    report = preflight(_cfg(tmp_path / "run", "--resume", "--model.seed", "3",
                            "--async-training.staleness-threshold", "1", "--trainer.optim.lr", "2e-6"))
    assert report.problems == [
        "--resume: step_00000020 was trained with other values of what a resume cannot change: --model.seed 0 -> 3 "
        "(a random: model's reference is rebuilt from this seed); --async-training.staleness-threshold 0.5 -> 1.0 "
        "(the staleness window (its admission budget) is restored from the checkpoint); give them the "
        "checkpoint's values, or start a new run (--overwrite, or another --run-dir)"]


def test_a_lora_run_recorded_with_the_seven_names_resumes_under_all_linear_on_an_own_model(tmp_path):
    """Runs from before "all-linear" recorded --lora.target-modules as the seven names, which is what all-linear
    adapts on asyncrl's own models: not a change. Another set of names still is."""
    from asyncrl.checkpoint import RUN_CONFIG
    from asyncrl.config.run_config import LORA_TARGETS
    record = run_record(_cfg(tmp_path / "run", "--lora.rank", "4"))
    record["lora"]["target_modules"] = list(LORA_TARGETS)
    checkpoint = tmp_path / "step_00000020"
    checkpoint.mkdir()
    (checkpoint / RUN_CONFIG).write_text(json.dumps(record))
    check = check_resume(_cfg(tmp_path / "run", "--resume", "--lora.rank", "4"), checkpoint)
    assert check.problems == [] and check.line is None
    [problem] = check_resume(_cfg(tmp_path / "run", "--resume", "--lora.rank", "4", "--lora.target-modules", "q_proj"),
                             checkpoint).problems
    assert "--lora.target-modules q_proj k_proj v_proj o_proj gate_proj up_proj down_proj -> q_proj" in problem


def test_changed_task_data_is_refused_unless_allowed(tmp_path):
    _checkpointed(tmp_path / "run")
    refused = preflight(_cfg(tmp_path / "run", "--resume", "--data.seed", "4"))
    assert refused.problems == [
        "--resume: the data differs from step_00000020's: --data.seed 0 -> 4; its data cursor would point into "
        "other prompts: give the run step_00000020's data back, or pass --resume-allow-data-change to go on with "
        "this data (the cursor is kept, clamped to the new data: past its end the next epoch starts)"]
    allowed = preflight(_cfg(tmp_path / "run", "--resume", "--data.seed", "4", "--resume-allow-data-change"))
    assert allowed.problems == []
    assert ("resume from step_00000020 changes data changed (--resume-allow-data-change; the data cursor is kept, "
            "clamped to the new data): --data.seed 0 -> 4") in allowed.notes


def test_a_prompt_file_is_compared_by_content_not_by_name(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    run = tmp_path / "run"
    path = _checkpointed(run, "--data.path", str(data))

    def check(file: pathlib.Path, *args: str):
        cfg = _cfg(run, "--resume", *args)
        return check_resume(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(file))), path)

    assert check(data).problems == [] and check(data).line is None
    data.write_text('{"prompt": "a"}\n{"prompt": "c"}\n')  # same size, same mtime resolution: other bytes
    [problem] = check(data).problems
    new, old = data_fingerprint(DataConfig(path=str(data))), json.loads((path / "run_config.json").read_text())
    old = old["_data_fingerprint"]
    assert problem.startswith(
        f"--resume: the data differs from step_00000020's: --data.path {data}: other content (sha256 "
        f"{new['sha256'][:12]}, 32 bytes; step_00000020's {old['sha256'][:12]}, 32 bytes); its data cursor")
    assert check(data, "--resume-allow-data-change").problems == []
    # the original content under another name is the same data
    copy = tmp_path / "moved.jsonl"
    copy.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    moved = check(copy)
    assert moved.problems == [] and moved.harmless == [f"--data.path {data} -> {copy} (same content)"]


def test_a_cursor_past_the_end_of_smaller_data_starts_the_next_epoch():
    prompts = [Prompt(prompt_ids=[i], data_source="toy", ground_truth=str(i)) for i in range(3)]
    source = DatasetSource(prompts, seed=0)
    source.load_state_dict({"epoch": 2, "position": 40})  # the checkpoint's cursor in data of 50 rows
    assert source.next() in prompts and (source.epoch, source.position) == (3, 1)
