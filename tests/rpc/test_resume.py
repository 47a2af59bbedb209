"""Stop and resume an async run from its checkpoint: every admitted prompt is trained (or dropped) exactly once
across both halves, the staleness bounds hold after the resume, and versions continue where they stopped.

In-process (LocalRun) with a recorder of trained ids, and once through the multi-process launcher
(RunSpec(run_dir, checkpoint_every, resume=True)) where the ledger is the witness."""

from __future__ import annotations

import dataclasses
import json

import pytest

from asyncrl.algos.staleness import verl_max_required_samples
from asyncrl.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from asyncrl.config import AsyncConfig
from asyncrl.rpc.spec import AgentSpec
from asyncrl.rpc.supervise import launch
from tests.envs.helpers import echo_runtime
from tests.rpc.helpers import TrainRecorder, allowed_lag, build_state, check_books, local_run
from tests.timing import limit

MINI = 2


@pytest.mark.parametrize("knobs, episodes", [
    (dict(staleness_threshold=0.5, trigger_parameter_sync_step=2, partial_rollout=False), False),
    (dict(staleness_threshold=1.0, trigger_parameter_sync_step=1, partial_rollout=True, max_version_lag=1), False),
    (dict(staleness_threshold=0.5, trigger_parameter_sync_step=1, partial_rollout=False, max_version_lag=1,
          lag_policy="wait"), True),
], ids=["stale", "stale+partial+cap", "multi-turn-episodes"])
def test_local_run_resumes_without_losing_or_repeating_a_prompt(tmp_path, knobs, episodes):
    """With episodes, a checkpoint falls mid-episode: unfinished episodes restart from their prompt; without
    partial rollout a weight update waits for running episodes to end, and the cap (wait) holds across the
    resume."""
    run_kw = dict(mini_batch_size=MINI, engines=2, step_delays=[0.0, 0.01], concurrent_prompts=2,
                  env_setup=echo_runtime if episodes else None, max_new_tokens=24 if episodes else 8)
    batch = MINI * 1  # require_batches 1

    # ---- run A: 4 versions, a checkpoint every 2
    config_a = AsyncConfig(total_versions=4, take_timeout_s=limit(60), **knobs)
    run_a = local_run(config_a, run_dir=str(tmp_path), checkpoint_every=2, **run_kw)
    rec_a = TrainRecorder(run_a)
    summary_a = run_a.run()
    assert summary_a.versions == 4
    # the last version was checkpointed: unfinished prompts are carried to it, not dropped
    assert summary_a.ledger.get("carried_to_checkpoint") is True
    assert len(list_checkpoints(tmp_path)) == 2
    state, extra, trained_a, carried = _reload_checkpoint(tmp_path, summary_a, rec_a)
    saved = extra["queue"]

    # ---- run B: fresh objects from the checkpoint, up to version 8
    config_b = AsyncConfig(total_versions=8, take_timeout_s=limit(60), **knobs)
    run_b = local_run(config_b, state=state, resume_extra=extra, **run_kw)
    assert run_b.queue.version == 4 and run_b.queue.next_id == saved["next_id"]
    # the admission counter and the books resume as they stopped (AReaL's capacity grew to (η + v + 1)·B after
    # a resume that restarted its counters at zero while the version went on)
    assert tuple(run_b.queue.budget) == tuple(saved["budget"]) == tuple(run_a.queue.budget)
    assert dict(run_b.queue.ledger.counts) == saved["ledger"]["counts"] == dict(run_a.queue.ledger.counts)
    rec_b = TrainRecorder(run_b)
    handed_out = []
    inner_request = run_b.queue.request

    def request(agent, n, **kw):
        tasks = inner_request(agent, n, **kw)
        handed_out.extend(tasks)
        return tasks

    run_b.queue.request = request
    summary_b = run_b.run()

    if episodes:  # what was trained were whole episodes: three turns with the environment's tokens between them
        for g in rec_a.groups + rec_b.groups:
            assert g.info.env["turns"] == 3 * len(g.completions), g.info.env
            assert all(c.loss_mask is not None and c.loss_mask.count(False) == 4 for c in g.completions)
    # versions continue from 4
    assert summary_b.versions == run_b.state.version == 8 and len(summary_b.history) == 4
    assert rec_b.steps[0][0] == 4 and [v for v, _ in rec_b.steps] == sorted(v for v, _ in rec_b.steps)
    for agent in run_b.agents:
        assert agent.versions_seen == [0, 4, 5, 6, 7, 8], agent.versions_seen  # initial weights, then 4
    # no id trained twice across A and B; B's ledger (continuing A's) closes every admitted id once
    trained_b = rec_b.trained_ids
    assert not trained_a & set(trained_b), sorted(trained_a & set(trained_b))
    drops_stale = knobs.get("max_version_lag") is not None and knobs.get("lag_policy", "drop") == "drop"
    check_books(run_b.queue.ledger, summary_b.ledger, sorted(trained_a) + trained_b, stale_drops_allowed=drops_stale)
    assert summary_b.ledger["trained"] == len(trained_a) + len(trained_b) == (summary_a.steps + len(rec_b.steps)) * batch
    # what the checkpoint carried ended in B (trained there, or dropped), and nothing A admitted was lost
    states_b = run_b.queue.ledger.state
    assert all(states_b[pid] in ("trained", "dropped") for pid in carried)
    assert set(range(saved["next_id"])) <= set(states_b)
    _check_unfinished_came_back_first(handed_out, saved)
    # staleness bounds after the resume
    max_required = verl_max_required_samples(MINI, 1, config_b.staleness_threshold,
                                             config_b.trigger_parameter_sync_step)
    assert run_b.queue.budget.max_required_samples == max_required
    assert 0 < run_b.queue.peak_staleness_samples <= max_required
    bound = allowed_lag(config_b)
    if bound is not None:
        assert max(rec_b.lags) <= bound, rec_b.lags


def _reload_checkpoint(run_dir, summary_a, rec_a):
    """Run A's last checkpoint loaded into fresh objects, checked against A: (state, extra, the ids A trained,
    the ids it carried to the checkpoint)."""
    path = latest_checkpoint(run_dir)
    assert json.loads((path / "meta.json").read_text())["version"] == 4
    state = build_state(MINI)
    extra = load_checkpoint(path, state)
    assert state.version == 4 and state.step == summary_a.steps
    saved = extra["queue"]
    ledger_at_ckpt = {int(pid): state for pid, state in saved["ledger"]["state"].items()}
    trained_a = {pid for pid, s in ledger_at_ckpt.items() if s == "trained"}
    carried = {pid for pid, s in ledger_at_ckpt.items() if s in ("in_flight", "pending", "queued")}
    # A trained nothing after its last checkpoint (it was the end of the run)
    assert trained_a == set(rec_a.trained_ids) and len(rec_a.trained_ids) == len(trained_a)
    assert {t["prompt_id"] for t in saved["unfinished"]} | {g["prompt_id"] for g in saved["queue"]} == carried
    # the summary's carried prompts are exactly the checkpoint's
    assert summary_a.ledger["carried"] == len(carried)
    assert summary_a.ledger["admitted"] == summary_a.ledger["trained"] + summary_a.ledger["dropped"] + len(carried)
    return state, extra, trained_a, carried


def _check_unfinished_came_back_first(handed_out, saved) -> None:
    """The unfinished prompts came back first, with their ids and seeds (re-admitted, not re-drawn)."""
    unfinished = {t["prompt_id"]: t for t in saved["unfinished"]}
    assert {t.prompt_id for t in handed_out[:len(unfinished)]} == set(unfinished)
    for task in handed_out[:len(unfinished)]:
        saved_task = unfinished[task.prompt_id]
        assert task.seed == saved_task["seed"] and task.prompt.prompt_ids == saved_task["prompt"]["prompt_ids"]
        assert task.admitted_version >= 4
    assert all(t.prompt_id >= saved["next_id"] for t in handed_out[len(unfinished):])


@pytest.mark.e2e
def test_launched_run_resumes_from_its_checkpoint(tmp_path):
    from tests.rpc.test_rpc_run import make_spec

    spec_a = make_spec([AgentSpec(), AgentSpec()], total_versions=4, staleness_threshold=0.5,
                       trigger_parameter_sync_step=1)
    spec_a.run_dir, spec_a.checkpoint_every = str(tmp_path), 2
    summary_a = launch(spec_a)
    assert summary_a.versions == 4 and summary_a.ledger.get("carried_to_checkpoint") is True
    path = latest_checkpoint(tmp_path)
    state = build_state(4)
    saved = load_checkpoint(path, state)["queue"]
    assert state.version == 4
    trained_a = sum(s == "trained" for s in saved["ledger"]["state"].values())
    assert trained_a == summary_a.steps * 4

    spec_b = make_spec([AgentSpec(), AgentSpec()], total_versions=6, staleness_threshold=0.5,
                       trigger_parameter_sync_step=1)
    spec_b.run_dir, spec_b.resume = str(tmp_path), True
    # B trains with its weights and optimizer state on the host (FSDP2's CPU offload, one trainer rank): a
    # checkpoint moves between the layouts
    spec_b.trainer = dataclasses.replace(spec_b.trainer, offload="params")
    summary_b = launch(spec_b)
    assert summary_b.versions == 6 and len(summary_b.history) == 2  # versions 5 and 6 only
    assert summary_b.steps == summary_a.steps + 2  # the learner's step counter came back too
    ledger = summary_b.ledger
    assert ledger["in_flight"] == ledger["pending"] == ledger["queued"] == 0, ledger
    # B ends normally, so it writes its final checkpoint (no --checkpoint-every) and carries what is left to it
    assert ledger.get("carried_to_checkpoint") is True and latest_checkpoint(tmp_path).name == f"step_{summary_b.steps:08d}"
    assert ledger["admitted"] == ledger["trained"] + ledger["dropped"] + ledger["carried"], ledger
    # B's ledger continues A's: A's trained ids plus one batch per new step, none twice (the ledger raises)
    assert ledger["trained"] == trained_a + 2 * 4
    assert ledger["admitted"] >= saved["next_id"]
    max_required = verl_max_required_samples(4, 1, 0.5, 1)
    assert all(0 <= m["fully_async/count/staleness_samples"] <= max_required for m in summary_b.history)


def test_a_full_disk_at_checkpoint_time_stops_the_run_naming_it_and_leaves_no_partial_checkpoint(tmp_path,
                                                                                                 monkeypatch):
    import errno

    import asyncrl.checkpoint.save_load as checkpoint_module
    from asyncrl.checkpoint import CheckpointError

    real_save, saves = checkpoint_module.torch.save, []

    def save(obj, path, *args, **kwargs):  # the disk fills up during the second checkpoint
        saves.append(path)
        if len(saves) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", save)
    config = AsyncConfig(total_versions=6, take_timeout_s=limit(60), staleness_threshold=0.5)
    run = local_run(config, mini_batch_size=MINI, run_dir=str(tmp_path), checkpoint_every=1)
    with pytest.raises(CheckpointError, match="no space left on device: .*step_00000002 needs ~"):
        run.run()
    checkpoints = tmp_path / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step_00000001"]  # the good one stays, no .tmp left
    assert latest_checkpoint(tmp_path).name == "step_00000001"
