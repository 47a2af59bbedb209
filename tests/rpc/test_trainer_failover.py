"""A dead or hung trainer rank does not end the run (`--trainer.max-recoveries`, `asyncrl.rpc.failover`): `asyncrl
train` with three trainer ranks as a process of its own, faults set by the drill's kill points (`ASYNCRL_FAULT`, one
per trainer-group generation) or sent as real signals, and what the run did read back from its metrics, summary and
log. The group-level pieces (a re-formed gloo group, a bitwise restore) are in tests/rpc/test_trainer_reform.py and
tests/checkpoint/; the launcher's other faults in tests/rpc/test_supervision.py."""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.rpc.jobs import TOY, Job, alive, wait_until
from tests.run_helpers import ROOT, torchrun_port
from tests.timing import agent_timeout, detection_margin, limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(limit(400))]

THREE_TRAINERS = ("--placement.trainer-devices", "cpu", "cpu", "cpu")
# a synchronous split: every version's samples come from the weights before it, whatever the timing, so two runs
# train on the same batches and their metrics can be compared exactly
LOCKSTEP = ("--async-training.staleness-threshold", "0", "--async-training.no-partial-rollout")
# one fault a trainer-group generation: the first recovery meets two more (a follower started again dies before it
# joins the group, then one on receiving the restore command), then one fault in each remaining phase of a version
DRILL = ("trainer:2:version:1:phase:forward,trainer:1:version:0:phase:join,trainer:2:version:1:phase:restore,"
         "trainer:1:version:2:phase:backward,trainer:2:version:3:phase:norm,trainer:1:version:4:phase:step,"
         "trainer:2:version:5:phase:publish,trainer:1:version:7:phase:checkpoint")
COMPARED = ("actor/", "critic/", "training/grad_norm")
# float32 epsilons a shrunk run's learner metrics may differ by: a sum over 2 or 1 ranks' shards instead of 3 is
# rounded differently, and the AdamW steps after the shrink carry the difference on (measured: at most 14)
ROUNDING = 100
LOCKSTEP_RUN = (*TOY, *THREE_TRAINERS, *LOCKSTEP, "--async-training.total-versions", "8", "--checkpoint-every", "1")


def _books_balance(summary: dict) -> None:
    ledger = summary["ledger"]
    assert ledger["in_flight"] == ledger["pending"] == ledger["queued"] == 0, ledger
    assert ledger["admitted"] == ledger["trained"] + ledger["dropped"] + ledger.get("carried", 0), ledger
    assert ledger["trained"] == summary["steps"] * 4, ledger  # cpu-demo: mini-batch 4, one batch per step: none twice


def _no_restore_points_left(job: Job) -> None:
    directory = json.loads((job.run_dir / "processes.json").read_text())["restore_points"]
    assert directory and "asyncrl-" in directory and not pathlib.Path(directory).exists(), directory


def _learning(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k.startswith(COMPARED)} for row in rows]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The uninterrupted lockstep run the drilled runs are compared with."""
    job = Job(tmp_path_factory.mktemp("plain"), *LOCKSTEP_RUN, name="plain")
    try:
        assert job.finish(timeout=limit(180)) == 0, job.tail()
        yield job
    finally:
        job.kill()


def test_every_kill_point_is_recovered_and_the_run_trains_as_an_uninterrupted_one(tmp_path, jobs, plain):
    """Six faults, one per phase of a version (forward, backward, gradient norm, optimizer step, publication,
    checkpoint), on ranks 1 and 2 in turn, and two more while the first recovery is under way (a follower dies
    before it joins the re-formed group; another when told to restore): each time the launcher starts the
    followers again, rank 0 re-forms the group (without waiting out a member that is gone) and restores the last
    committed step, and the command the fault broke is given again. The run then trains every version once, in
    order, with its books balanced, and every learner metric equals, exactly, an uninterrupted run's."""
    drilled = Job(tmp_path, *LOCKSTEP_RUN, "--trainer.max-recoveries", "8", name="drilled",
                  env={"ASYNCRL_FAULT": DRILL})
    jobs.append(drilled)
    assert drilled.finish(timeout=limit(240)) == 0, drilled.tail()
    text, summary = drilled.text(), drilled.summary()
    for point in DRILL.split(","):
        _, rank, _, version, _, phase = point.split(":")
        assert f"trainer rank {rank} killed at {phase} of version {version}" in text, drilled.tail()
    recoveries = summary["trainer_recoveries"]
    assert [r["generation"] for r in recoveries] == [3, 4, 5, 6, 7, 8], recoveries
    assert [r["version"] for r in recoveries] == [1, 2, 3, 4, 5, 7], recoveries  # the counter never went back
    assert all(r["why"].startswith("trainer rank ") and " exited with code 9" in r["why"] for r in recoveries)
    assert "; then trainer rank 2 exited with code 9" in recoveries[0]["why"], recoveries[0]  # at restore
    assert recoveries[0]["seconds"] < 600, recoveries[0]  # the member gone before it joined: not waited for until
    #                                                        --startup-timeout-s (600 s)
    assert "trainer group re-formed at version 5" in text
    assert "trainer failover: training steps " in text  # the steps since the committed one, trained again
    rows = drilled.metrics()
    assert [r["step"] for r in rows] == list(range(1, 9)), rows  # metrics.jsonl counts versions as "step"
    # version V's kill points fall in the step that makes version V + 1; a publication's and a checkpoint's after it
    assert [r["trainer/recoveries"] for r in rows] == [0, 1, 2, 3, 4, 4, 5, 6]
    _books_balance(summary)
    assert summary["versions"] == 8 and summary["steps"] == plain.summary()["steps"] == 8
    assert _learning(rows) == _learning(plain.metrics())
    assert (drilled.run_dir / "checkpoints" / "step_00000008").is_dir()
    _no_restore_points_left(drilled)


def test_a_shrunk_group_trains_on_as_an_uninterrupted_run_does_within_rounding(tmp_path, jobs, plain):
    """--trainer.failover shrink: rank 2 dies in a backward, and the group goes on as ranks 0 and 1, each shard
    re-sliced from the three ranks' restore points; then rank 1 dies at a gradient norm, and rank 0 trains alone.
    Every version is trained once, the books balance, and every learner metric is within float32 rounding of the
    uninterrupted three-rank run's (the ranks' partial sums are added in another order)."""
    drill = "trainer:2:version:2:phase:backward,trainer:1:version:5:phase:norm"
    job = Job(tmp_path, *LOCKSTEP_RUN, "--trainer.max-recoveries", "2", "--trainer.failover", "shrink", name="shrunk",
              env={"ASYNCRL_FAULT": drill})
    jobs.append(job)
    assert job.finish(timeout=limit(180)) == 0, job.tail()
    text, summary = job.text(), job.summary()
    assert "trainer group generation 1 re-forms with 2 rank(s); back to step" in text, job.tail()
    assert "trainer group generation 2 re-forms with 1 rank(s); back to step" in text, job.tail()
    assert [(r["generation"], r["version"]) for r in summary["trainer_recoveries"]] == [(1, 2), (2, 5)]
    rows = job.metrics()
    assert [r["step"] for r in rows] == list(range(1, 9)), rows
    _books_balance(summary)
    ours, theirs = _learning(rows), _learning(plain.metrics())
    assert [sorted(r) for r in ours] == [sorted(r) for r in theirs]
    tol = ROUNDING * torch.finfo(torch.float32).eps
    far = [(i + 1, k, a[k], b[k]) for i, (a, b) in enumerate(zip(ours, theirs)) for k in a
           if not math.isclose(a[k], b[k], rel_tol=tol, abs_tol=tol)]
    assert not far, far
    _no_restore_points_left(job)


def test_under_torchrun_kept_followers_are_started_again_and_the_run_trains_as_an_uninterrupted_one(tmp_path, plain):
    """The same run under torchrun (one node, four processes: three trainer ranks and an agent): a trainer
    follower's torchrun process keeps its rank as a child, so a killed rank does not take the node down with it;
    its keeper posts the fault, every keeper starts its rank again, and the run equals the uninterrupted one
    exactly."""
    drill = "trainer:2:version:1:phase:backward,trainer:1:version:3:phase:norm"
    run_dir = tmp_path / "torchrun"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                          str(torchrun_port()), "-m", "asyncrl.cli", "train", "cpu-demo", *LOCKSTEP_RUN, "--run-dir",
                          str(run_dir), "--placement.launcher", "torchrun", "--trainer.max-recoveries", "2"],
                         capture_output=True, text=True, timeout=limit(240), cwd=ROOT,
                         env={**os.environ, "ASYNCRL_FAULT": drill, "OMP_NUM_THREADS": "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(r["generation"], r["version"]) for r in summary["trainer_recoveries"]] == [(1, 1), (2, 3)], text[-6000:]
    assert "starting trainer rank 2 again as generation 1" in text and "trainer rank 1 exited with code 9" in text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    _books_balance(summary)
    assert _learning(rows) == _learning(plain.metrics())


def test_under_torchrun_max_restarts_rank_0s_death_resumes_from_the_newest_checkpoint(tmp_path, plain):
    """Trainer rank 0 killed under torchrun (no kept followers): torchrun's own --max-restarts 1 starts the node's
    processes again, and the job goes on in its run directory, which the failed attempt used, from its newest
    checkpoint rather than being refused there; it trains as the uninterrupted run did."""
    run_dir = tmp_path / "restarted"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "1",
                          "--master-port", str(torchrun_port()), "-m", "asyncrl.cli", "train", "cpu-demo",
                          *LOCKSTEP_RUN, "--run-dir", str(run_dir), "--placement.launcher", "torchrun"],
                         capture_output=True, text=True, timeout=limit(300), cwd=ROOT,
                         env={**os.environ, "ASYNCRL_FAULT": "trainer:0:version:4:phase:backward", "OMP_NUM_THREADS": "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-6000:]
    assert "trainer rank 0 killed at backward of version 4" in text, text[-6000:]
    assert "torchrun started this job's processes again (restart 1): resuming from its newest checkpoint" in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 8
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert _learning(rows) == _learning(plain.metrics())


def test_a_killed_and_a_stopped_follower_are_replaced_and_the_run_goes_on(tmp_path, jobs):
    """Trainer rank 2 killed mid-run, and the rank 2 started in its place stopped (hung as a whole) before it joins
    the re-formed group: its heartbeat, which beats from its start, stops, so the launcher names it within
    agent_timeout_s, rank 0 leaves that group's assembly (not its 600 s startup timeout) and the group forms again.
    Then SIGSTOP of a following rank 1: the same, mid-run (not rank 0's 300 s collective timeout). SIGTERM then ends
    the run as usual: a checkpoint, balanced books, and no process left."""
    timeout = agent_timeout()
    job = Job(tmp_path, *TOY, *THREE_TRAINERS, "--async-training.total-versions", "1000000",
              "--async-training.agent-timeout-s", str(timeout), "--async-training.sync-timeout-s", "300",
              "--trainer.max-recoveries", "3",
              env={"ASYNCRL_FAULT": "trainer:2:version:2:phase:backward,trainer:2:version:0:phase:join:hang"})
    jobs.append(job)
    job.wait_for(r"trainer group generation 2 ready", timeout=limit(120) + timeout)
    assert "trainer rank 2 exited with code" in job.text() and "is stopped (SIGSTOP): no heartbeat for" in job.text()
    versions = len(job.metrics())
    job.wait_versions(versions + 2)  # trained on
    trainer1 = job.processes()["trainer1"]
    os.kill(trainer1, signal.SIGSTOP)
    stopped_at = time.monotonic()
    job.wait_for(r"trainer group generation 3 ready", timeout=limit(60) + timeout)
    assert time.monotonic() - stopped_at < timeout + detection_margin() + limit(15)
    assert f"trainer rank 1 (pid {trainer1}) is stopped (SIGSTOP): no heartbeat for" in job.text()
    assert not alive(trainer1)
    versions = len(job.metrics())
    job.wait_versions(versions + 2)
    job.signal(signal.SIGTERM)
    assert job.finish(timeout=limit(120)) == 128 + signal.SIGTERM, job.tail()  # interrupted, as the shell says
    summary = job.summary()
    assert summary["interrupted"] == "SIGTERM" and summary["checkpoint"]
    first = summary["trainer_recoveries"][0]["why"]  # one recovery, two faults: the kill, then the hang in it
    assert "trainer rank 2 exited with code 9" in first and "; then trainer rank 2 (pid" in first, first
    assert "is stopped (SIGSTOP)" in first, first
    assert len(summary["trainer_recoveries"]) == 2
    versions = [r["step"] for r in job.metrics()]
    assert versions == list(range(1, len(versions) + 1))
    _books_balance(summary)
    wait_until(lambda: not any(alive(pid) for pid in job.all_pids()), limit(20), "every process of the run gone")
    _no_restore_points_left(job)


def test_trainer_rank_0_killed_twice_the_run_starts_again_from_its_restore_points_as_an_uninterrupted_one(
        tmp_path, jobs, plain):
    """Trainer rank 0 (the head: queue, roster, agents, the run's store) killed in a backward; then, in the run
    started again, a follower killed at a gradient norm; then rank 0 again while it gathers a publication. Each time
    rank 0 dies the launcher ends every other process and starts them all again from the newest version boundary
    every rank holds a restore point of (`asyncrl.rpc.restart`); the follower's fault is recovered as usual in
    between. The run trains every version once, in order, with its books balanced, and every learner metric equals
    an uninterrupted run's, exactly."""
    drill = "trainer:0:version:2:phase:backward,trainer:2:version:4:phase:norm,trainer:0:version:6:phase:publish"
    job = Job(tmp_path, *LOCKSTEP_RUN, "--trainer.max-recoveries", "3", name="rank0", env={"ASYNCRL_FAULT": drill})
    jobs.append(job)
    assert job.finish(timeout=limit(240)) == 0, job.tail()
    text, summary = job.text(), job.summary()
    assert "trainer rank 0 killed at backward of version 2" in text and "trainer rank 0 killed at publish of version " \
        "6" in text, job.tail()
    assert "trainer rank 0 started again (trainer rank 0 exited with code 9): every rank back to step 2, version 2" \
        in text, job.tail()
    recoveries = summary["trainer_recoveries"]
    assert [(r["generation"], r["version"], r["restarted"]) for r in recoveries] == \
        [(1, 2, True), (2, 4, False), (3, 6, True)], recoveries
    assert recoveries[0]["why"] == recoveries[2]["why"] == "trainer rank 0 exited with code 9"
    assert "run's processes started again at version 2 (step 2) in " in text
    rows = job.metrics()
    assert [r["step"] for r in rows] == list(range(1, 9)), rows
    # version V's kill points fall in the step that makes version V + 1, a publication's after it
    assert [r["trainer/recoveries"] for r in rows] == [0, 0, 1, 1, 2, 2, 3, 3]
    _books_balance(summary)
    assert summary["versions"] == summary["steps"] == 8
    assert _learning(rows) == _learning(plain.metrics())
    _no_restore_points_left(job)


def test_a_launched_run_survives_a_sigkill_of_trainer_rank_2_and_then_of_trainer_rank_0(tmp_path, jobs):
    """Real signals in a running asynchronous job: SIGKILL of trainer rank 2 (the group re-forms around rank 0),
    then SIGKILL of trainer rank 0 (every process of the run starts again from the newest version boundary). The run
    keeps training after each, and SIGTERM ends it as usual: a checkpoint, balanced books, versions in order, no
    process and no restore point left."""
    job = Job(tmp_path, *TOY, *THREE_TRAINERS, "--async-training.total-versions", "1000000",
              "--trainer.max-recoveries", "2")
    jobs.append(job)
    job.wait_versions(3)
    os.kill(job.processes()["trainer2"], signal.SIGKILL)
    job.wait_for(r"trainer group generation 1 ready")
    job.wait_versions(len(job.metrics()) + 2)
    rank0 = job.processes()["trainer0"]
    os.kill(rank0, signal.SIGKILL)
    restarted = job.wait_for(r"every rank back to step \d+, version (\d+)")
    job.wait_for(r"trainer rank 0 restarted as generation 2 in")
    assert not alive(rank0) and job.processes()["trainer0"] != rank0
    job.wait_versions(int(restarted.group(1)) + 2)  # trained on
    job.signal(signal.SIGTERM)
    assert job.finish(timeout=limit(120)) == 128 + signal.SIGTERM, job.tail()
    summary = job.summary()
    assert summary["interrupted"] == "SIGTERM" and summary["checkpoint"]
    follower, head = summary["trainer_recoveries"]
    assert follower["why"].startswith("trainer rank 2 exited with code -9") and not follower["restarted"], follower
    assert head["why"] == "trainer rank 0 exited with code -9" and head["restarted"], head
    versions = [r["step"] for r in job.metrics()]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= int(restarted.group(1)) + 2
    _books_balance(summary)
    wait_until(lambda: not any(alive(pid) for pid in job.all_pids()), limit(20), "every process of the run gone")
    _no_restore_points_left(job)


def test_a_stopped_trainer_rank_0_is_named_and_the_run_starts_again(tmp_path, jobs):
    """Trainer rank 0 stopped (SIGSTOP) in a running job of one trainer rank: the launcher names it after
    --async-training.agent-timeout-s, ends it, and starts the run's processes again from the newest version boundary;
    the run trains on, and SIGTERM ends it as usual."""
    timeout = agent_timeout()
    job = Job(tmp_path, *TOY, "--async-training.total-versions", "1000000", "--async-training.agent-timeout-s",
              str(timeout), "--trainer.max-recoveries", "1")
    jobs.append(job)
    job.wait_versions(3)
    rank0 = job.processes()["trainer0"]
    os.kill(rank0, signal.SIGSTOP)
    stopped_at = time.monotonic()
    restarted = job.wait_for(r"every rank back to step \d+, version (\d+)", timeout=timeout + limit(90))
    assert time.monotonic() - stopped_at < timeout + detection_margin() + limit(60)
    assert f"trainer rank 0 started again (trainer rank 0 (pid {rank0}) is stopped (SIGSTOP) for " in job.text()
    assert not alive(rank0)
    job.wait_versions(int(restarted.group(1)) + 2)
    job.signal(signal.SIGTERM)
    assert job.finish(timeout=limit(120)) == 128 + signal.SIGTERM, job.tail()
    summary = job.summary()
    (recovery,) = summary["trainer_recoveries"]
    assert recovery["restarted"] and recovery["why"].startswith(f"trainer rank 0 (pid {rank0}) is stopped"), recovery
    _books_balance(summary)
    wait_until(lambda: not any(alive(pid) for pid in job.all_pids()), limit(20), "every process of the run gone")
    _no_restore_points_left(job)
