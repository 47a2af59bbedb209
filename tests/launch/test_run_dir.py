"""Runs never mix (`asyncrl.launch.run_dir`): a new run into a run directory that holds one is refused before anything
starts, by `asyncrl train` and by `train()`, naming the directory, what is in it and the fixes (--resume,
--overwrite, another --run-dir); --overwrite deletes exactly asyncrl's files (refused when there is more, and
with --resume; --dry-run deletes nothing); and, through the command (run in this process, with the local
launcher), a resume that changes the lr lists it and trains with it, falling back from a damaged newer
checkpoint."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil

import pytest
import torch

from asyncrl.launch.preflight import preflight
from asyncrl.launch.train import train
from asyncrl.launch.run_dir import RUN_FILES, clear_run_dir
from tests.run_helpers import train_here
from tests.launch.test_resume_check import TINY, _cfg


def _used(run_dir: pathlib.Path, *, checkpoints: int = 0) -> dict[str, float]:
    """A run directory as a finished run leaves it (its files' contents do not matter here); returns the
    modification times of what is in it, to show nothing was touched."""
    run_dir.mkdir(parents=True)
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        (run_dir / name).write_text("{}\n")
    for step in range(1, checkpoints + 1):
        (run_dir / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
    return _stamps(run_dir)


def _stamps(run_dir: pathlib.Path) -> dict[str, float]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime for p in run_dir.rglob("*")}


def test_a_new_run_into_a_used_run_dir_is_refused_naming_it_its_contents_and_the_fixes(tmp_path):
    run = tmp_path / "run"
    before = _used(run, checkpoints=2)
    assert preflight(_cfg(run)).problems == [
        f"--run-dir {run} already holds a run (checkpoints/ with 2 checkpoints, newest step_00000002, config.json, "
        "metrics.jsonl, summary.json); a new run would mix with it: pass --resume to continue it, --overwrite to "
        "delete it and start over, or another --run-dir"]
    # train() refuses too (library callers skip the command line), before writing anything
    with pytest.raises(ValueError, match=f"--run-dir {run} already holds a run"):
        train(_cfg(run))
    assert _stamps(run) == before
    # an empty directory, or one that does not exist yet, is a new run's
    (tmp_path / "empty").mkdir()
    assert preflight(_cfg(tmp_path / "empty")).problems == preflight(_cfg(tmp_path / "new")).problems == []


def test_what_is_not_a_run_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    _used(run)
    (run / "notes.txt").write_text("mine")
    [problem] = preflight(_cfg(run)).problems
    assert problem.endswith("pass --resume to continue it, --overwrite once you have moved out what asyncrl did not "
                            "write (notes.txt), or another --run-dir")
    assert preflight(_cfg(run, "--overwrite")).problems == [
        f"--overwrite: --run-dir {run} also holds notes.txt, which asyncrl did not write, so nothing will be "
        "deleted: move that out of it, or choose another --run-dir"]
    with pytest.raises(ValueError, match="also holds notes.txt"):
        clear_run_dir(run)
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl", "notes.txt", "summary.json"]
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("")
    assert preflight(_cfg(home)).problems == [
        f"--run-dir {home} is not empty (thesis.tex) and holds no asyncrl run; a run there would mix with what is in "
        "it: choose another --run-dir (or an empty one)"]


def test_overwrite_deletes_exactly_asyncrl_s_files_and_never_follows_a_link(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    _used(run, checkpoints=1)
    outside.mkdir()
    (outside / "keep.txt").write_text("kept")
    (run / "wandb").symlink_to(outside, target_is_directory=True)
    assert set(clear_run_dir(run)) == {"checkpoints/", "config.json", "metrics.jsonl", "summary.json", "wandb"}
    assert list(run.iterdir()) == [] and (outside / "keep.txt").read_text() == "kept"
    assert set(RUN_FILES) >= {"config.json", "metrics.jsonl", "samples.jsonl", "checkpoints", "wandb"}


def test_overwrite_with_resume_is_refused(tmp_path):
    run = tmp_path / "run"
    _used(run, checkpoints=1)
    for resume in ("--resume", "--resume-or-start"):
        assert preflight(_cfg(run, resume, "--overwrite")).problems == [
            f"--overwrite deletes the run in --run-dir {run} that {resume} continues: pass {resume} to continue it, "
            "or --overwrite to delete it and start a new run, not both"]


def test_resume_or_start_does_not_start_over_a_run_without_checkpoints(tmp_path):
    run = tmp_path / "run"
    _used(run)
    [problem] = preflight(_cfg(run, "--resume-or-start")).problems
    assert problem.startswith(f"--resume-or-start: --run-dir {run} holds no checkpoint to resume from but is not "
                              "empty (config.json, metrics.jsonl, summary.json); a new run there would mix with it")


def _rows(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def _lr_in(checkpoint: pathlib.Path) -> list[float]:
    saved = torch.load(checkpoint / "learner.pt", map_location="cpu", weights_only=True)
    return [group["lr"] for group in saved["optimizer"]["param_groups"]]


def test_through_the_command_refused_then_resumed_with_a_new_lr_then_overwritten(tmp_path, capsys, caplog):
    run = tmp_path / "run"
    common = ["cpu-demo", *TINY, "--run-dir", str(run)]
    train_here(*common, "--async-training.total-versions", "2", "--checkpoint-every", "2")
    assert _lr_in(run / "checkpoints" / "step_00000002") == [2e-5]
    before = _stamps(run)

    with pytest.raises(SystemExit) as again:  # the command prints the message alone, no traceback
        train_here(*common, "--async-training.total-versions", "2")
    assert isinstance(again.value.code, str) and again.value.code.strip().splitlines()[-1] == (
        f"asyncrl train: --run-dir {run} already holds a run (checkpoints/ with 1 checkpoint, newest step_00000002, "
        "config.json, metrics.jsonl, samples.jsonl, summary.json); a new run would mix with it: pass --resume to "
        "continue it, --overwrite to delete it and start over, or another --run-dir")
    assert _stamps(run) == before

    # a newer checkpoint that a power loss cut short: the resume falls back to step 2, saying why in one line
    damaged = run / "checkpoints" / "step_00000009"
    shutil.copytree(run / "checkpoints" / "step_00000002", damaged)
    os.truncate(damaged / "learner.pt", 1000)
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="asyncrl"):
        train_here(*common, "--resume", "--async-training.total-versions", "3", "--checkpoint-every", "3",
                   "--trainer.optim.lr", "1e-4")
    [line] = [r for r in caplog.records if "does not load" in r.getMessage()]
    assert line.levelname == "WARNING" and line.getMessage().endswith(
        "step_00000009 does not load: learner.pt is damaged (File is not a zip file); resuming from step_00000002 "
        "instead"), line.getMessage()
    assert (run / "checkpoints" / "step_00000009.corrupt").is_dir()
    assert ("[asyncrl] note: resume from step_00000002 changes applied from here: --trainer.optim.lr 2e-05 -> "
            "0.0001; harmless: --async-training.total-versions 2 -> 3, --checkpoint-every 2 -> 3") in \
        capsys.readouterr().err
    assert _lr_in(run / "checkpoints" / "step_00000003") == [1e-4]  # trained with the new lr, not the saved one
    assert [r["fully_async/count/current_param_version"] for r in _rows(run)][-1] >= 2
    saved = json.loads((run / "checkpoints" / "step_00000003" / "run_config.json").read_text())
    assert saved["trainer"]["optim"]["lr"] == 1e-4 and saved["_data_fingerprint"]["task"] == "toy"

    train_here(*common, "--overwrite", "--dry-run")
    dry = capsys.readouterr().out
    assert "note  --overwrite: the run starts by deleting checkpoints/ with 2 checkpoints" in dry
    assert "(not with --dry-run: nothing is deleted now)" in dry and (run / "checkpoints").is_dir()

    train_here(*common, "--overwrite", "--async-training.total-versions", "1")
    assert "[asyncrl] --overwrite: deleted checkpoints/, config.json, metrics.jsonl, samples.jsonl, summary.json" \
        in capsys.readouterr().err
    assert len(_rows(run)) == 1 and [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"]
    assert json.loads((run / "config.json").read_text())["placement"]["launcher"] == "local"
    assert os.listdir(run)  # the new run's files


def test_a_job_torchrun_started_again_resumes_its_newest_checkpoint_or_starts_over_without_one(tmp_path):
    """torchrun's --max-restarts starts every process of the node again after one failed (trainer rank 0's
    death): the failed attempt's run directory is then this job's, not another run's to refuse."""
    from asyncrl.launch.run_dir import after_torchrun_restart, run_dir_problem

    restarted = {"TORCHELASTIC_RESTART_COUNT": "1"}
    with_ckpt, without = tmp_path / "with", tmp_path / "without"
    _used(with_ckpt, checkpoints=2)
    _used(without)
    first = _cfg(with_ckpt, "--placement.launcher", "torchrun", "--overwrite")  # the first attempt's command
    assert after_torchrun_restart(first, {"TORCHELASTIC_RESTART_COUNT": "0"}) == (first, None)
    assert after_torchrun_restart(_cfg(with_ckpt), restarted) == (_cfg(with_ckpt), None)  # not under torchrun
    cfg, line = after_torchrun_restart(first, restarted)
    assert cfg.resume_or_start and not cfg.overwrite and not cfg.resume and run_dir_problem(cfg) is None
    assert line == (f"torchrun started this job's processes again (restart 1): resuming from its newest checkpoint "
                    f"in {with_ckpt}")
    cfg, line = after_torchrun_restart(_cfg(without, "--placement.launcher", "torchrun"), restarted)
    assert cfg.overwrite and not cfg.resume_or_start and run_dir_problem(cfg) is None
    assert "no checkpoint yet: starting over, deleting what the failed attempt wrote" in line
