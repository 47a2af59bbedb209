"""Evaluation during training (`--eval.*`) in real runs: every evaluated token carries the evaluation's version
though publications fall in the middle of evaluations, the trainer keeps training while an evaluation runs, the
metrics carry verl's names, and a resumed run neither repeats nor skips an evaluation."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from asyncrl.config import AsyncConfig, EvalConfig
from asyncrl.runtime.evaluation import EvalBoard
from tests.rpc.helpers import local_run, make_prompt
from tests.rpc.jobs import Job, wait_until
from tests.run_helpers import train_here
from tests.timing import agent_timeout, limit

VERSIONS = 6


def test_evaluations_are_pinned_to_their_version_while_training_goes_on(caplog):
    """Two agents (one slow), stale + partial rollout, an evaluation of 16 prompts × 2 samples every 2 versions,
    at the start and at the end: every accepted result's tokens carry its evaluation's version, publications
    happened while evaluations ran (the agents finished their evaluation prompts first, the trainer did not
    wait), learner steps ran while an evaluation was open, and every evaluation completed."""
    board = EvalBoard([make_prompt(1000 + i) for i in range(16)],
                      EvalConfig(every_versions=2, at_start=True, at_end=True, n=2, temperature=1.0), seed=3,
                      max_new_tokens=8)
    accepted: list[tuple[int, set[int]]] = []
    submit = board.submit

    def recording_submit(agent, task, completions, rewards):
        ok = submit(agent, task, completions, rewards)
        if ok:
            accepted.append((task.version, {v for c in completions for v in c.versions}))
        return ok

    board.submit = recording_submit
    config = AsyncConfig(total_versions=VERSIONS, staleness_threshold=0.5, trigger_parameter_sync_step=1,
                         partial_rollout=True, take_timeout_s=limit(60), sync_timeout_s=limit(60))
    run = local_run(config, engines=2, step_delays=[0.0, 0.01], evals=board, eval_slots=2)
    busy_at_step: list[bool] = []
    inner = run.controller.trainers.step

    def step(state, groups):
        busy_at_step.append(board.busy())
        return inner(state, groups)

    run.controller.trainers.step = step
    with caplog.at_level(logging.INFO, logger="asyncrl"):
        summary = run.run()
    assert summary.versions == VERSIONS
    rows = [m for m in summary.history if "val/version" in m]
    versions = [int(m["val/version"]) for m in rows]
    # an evaluation due while one runs waits for it (on a busy machine the start's may run up to the end)
    assert versions[0] == 0 and versions[-1] == VERSIONS and len(set(versions)) == len(versions)
    for m in rows:
        assert m["val/complete"] == 1.0 and m["val/prompts"] == 16 and m["val/refused_results"] == 0
        assert 0.0 <= m["val-core/toy/reward/mean@2"] <= 1.0
        assert {"val-aux/toy/reward/pass@1", "val-aux/toy/reward/pass@2", "val-aux/toy/response_length/mean",
                "val/wall_s"} <= m.keys()
    assert len(accepted) == 16 * len(rows)
    assert all(tokens == {version} for version, tokens in accepted), accepted
    assert "finishes its evaluation prompts before it takes version" in caplog.text  # a publication mid-evaluation
    assert any(busy_at_step), "no learner step ran while an evaluation was open"


def test_an_evaluation_never_lets_the_trainer_train_past_the_staleness_bound():
    """One agent, stale + partial at staleness 0.5, an evaluation every 2 versions whose prompts outnumber a
    version's: the agent keeps its weights while an evaluation of them runs, and takes no training prompt once the
    trainer has published past them, so no group is trained more than one version late (a 2-GPU run before this
    rule trained at a lag of up to 15)."""
    board = EvalBoard([make_prompt(2000 + i) for i in range(48)],
                      EvalConfig(every_versions=2, n=2, temperature=1.0), seed=4, max_new_tokens=8)
    config = AsyncConfig(total_versions=VERSIONS, staleness_threshold=0.5, trigger_parameter_sync_step=1,
                         partial_rollout=True, take_timeout_s=limit(60), sync_timeout_s=limit(60))
    summary = local_run(config, engines=1, evals=board, eval_slots=2).run()
    assert summary.versions == VERSIONS
    lags = [m["training/version_lag/max"] for m in summary.history if "training/version_lag/max" in m]
    assert len(lags) == VERSIONS and max(lags) <= 1, lags
    evaluated = [int(m["val/version"]) for m in summary.history if "val/version" in m]
    assert evaluated and all(m["val/complete"] == 1.0 for m in summary.history if "val/version" in m), evaluated


@pytest.mark.slow
def test_a_run_through_the_command_logs_evaluations_and_a_resume_keeps_their_schedule(tmp_path, capsys, caplog):
    """`asyncrl train` (in this process, the local launcher: the trainer and two agents): metrics.jsonl holds the
    evaluations under verl's names; a run stopped at a checkpoint and resumed evaluates no version twice, and the
    resumed part evaluates too."""
    run_dir = tmp_path / "run"
    base = ["cpu-demo", "--model.path", "random:tiny-qwen2", "--data.task", "toy", "--wandb", "off",
            "--run-dir", str(run_dir), "--placement.agent-devices", "cpu", "cpu", "--checkpoint-every", "2",
            "--eval.every-versions", "2", "--eval.at-start", "--eval.at-end", "--eval.max-prompts", "8",
            "--eval.n", "2", "--eval.temperature", "1.0"]
    with caplog.at_level(logging.INFO, logger="asyncrl"):
        train_here(*base, "--async-training.total-versions", "4")
    printed = capsys.readouterr()
    assert "eval v0: toy" in printed.out + printed.err + caplog.text
    train_here(*base, "--async-training.total-versions", "8", "--resume")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [int(r["val/version"]) for r in rows if "val/version" in r]
    assert len(evaluated) == len(set(evaluated)), evaluated  # none twice, across the resume
    assert evaluated[0] == 0 and 8 in evaluated and any(4 < v < 8 for v in evaluated), evaluated
    for r in rows:
        if "val/version" in r:
            assert r["val/complete"] == 1.0 and "val-core/toy/reward/mean@2" in r and "val-aux/toy/reward/pass@2" in r


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(limit(400))
def test_an_agent_killed_mid_evaluation_hands_its_prompts_to_one_holding_the_same_version(tmp_path, jobs):
    """Two agents evaluate version 0 one prompt at a time each; agent1 is killed (SIGKILL) while it runs: once it
    is named dead, the prompt it held goes to agent0, which still holds version 0, and the evaluation completes
    with every prompt under that version; the run trains on with one agent."""
    job = Job(tmp_path, "--model.path", "random:tiny-qwen2", "--data.task", "toy", "--wandb", "off",
              "--placement.agent-devices", "cpu", "cpu", "--async-training.total-versions", "3",
              "--async-training.agent-timeout-s", str(agent_timeout()), "--eval.every-versions", "0",
              "--eval.at-start", "--eval.no-at-end", "--eval.max-prompts", "128", "--eval.max-share", "0.03")
    jobs.append(job)
    job.wait_for(r"evaluating version 0 on 128 held-out prompts")
    agents = wait_until(lambda: {"agent0", "agent1"} <= job.processes().keys() and job.processes(), limit(60),
                        "both agents in processes.json")
    os.kill(agents["agent1"], signal.SIGKILL)
    job.wait_for(r"eval v0: toy", timeout=limit(180))
    assert job.finish() == 0, job.tail()
    log = job.text()
    assert log.index("rollout agent agent1 is dead") < log.index("eval v0: toy"), job.tail()  # killed mid-way
    [held_out] = [m for m in job.metrics() if "val/version" in m]
    assert held_out["val/version"] == 0 and held_out["val/prompts"] == 128
    assert held_out["val/complete"] == 1.0 and held_out["val/refused_results"] == 0
    summary = job.summary()
    assert summary["versions"] == 3 and summary["agents"]["agent1"]["status"] == "dead"
