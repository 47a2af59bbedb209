"""Real jobs meet faults every day: a hung agent, preemption (SIGTERM), a killed launcher, an agent restarted
or added while the job runs, a wall-clock limit. Each test runs `asyncrl train` as its own process (the toy task
on a tiny model), sends real signals to real pids (run_dir/processes.json), and checks the log, the summary
and the process table. Every run's books must balance: each admitted prompt trained once, dropped with a
reason, or carried by the final checkpoint — the ledger itself refuses a prompt trained twice.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from asyncrl.rpc.param_server import late_after
from tests.rpc.jobs import TOY, Job, alive, wait_until
from tests.run_helpers import free_ports
from tests.timing import agent_timeout, detection_margin, limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(limit(400))]

TWO_AGENTS = ("--placement.agent-devices", "cpu", "cpu")
ENDLESS = ("--async-training.total-versions", "1000000")


def timeouts(timeout: float) -> tuple[str, ...]:
    return ("--async-training.agent-timeout-s", str(timeout))


def books_balance(summary: dict) -> None:
    ledger = summary["ledger"]
    assert ledger["in_flight"] == ledger["pending"] == ledger["queued"] == 0, ledger
    carried = ledger.get("carried", 0)
    assert ledger["admitted"] == ledger["trained"] + ledger["dropped"] + carried, ledger
    assert ledger["trained"] == summary["steps"] * 4, ledger  # cpu-demo: mini-batch 4, one batch per step


def no_process_left(job: Job) -> None:
    wait_until(lambda: not any(alive(pid) for pid in job.all_pids()), limit(20),
               f"every process of the run to be gone ({job.all_pids()})")


def test_a_hung_agent_is_named_and_fenced_the_trainer_steps_on_then_sigterm_checkpoints_and_resume_continues(
        tmp_path, jobs):
    timeout = agent_timeout()
    job = Job(tmp_path, *TOY, *TWO_AGENTS, *ENDLESS, *timeouts(timeout), "--checkpoint-every", "1000")
    jobs.append(job)
    job.wait_versions(5)
    agent1 = job.processes()["agent1"]

    # SIGSTOP: named within agent_timeout_s (+ a margin), whatever the trainer was doing
    os.kill(agent1, signal.SIGSTOP)
    stopped_at, at_stop = time.monotonic(), len(job.metrics())
    found = job.wait_for(r"rollout agent agent1 is dead \(silent for ([0-9.]+) s", timeout=timeout + limit(60))
    named_after, at_death = time.monotonic() - stopped_at, len(job.metrics())
    assert timeout <= float(found.group(1)) <= timeout + detection_margin(), found.group(0)
    assert named_after <= timeout + detection_margin() + 1.0, named_after
    # a publication did not wait for it: after five heartbeats it left the agent's sync in the background and
    # published to agent0. Whether a publication falls inside the hang depends on the trainer: it may wait for
    # samples the whole time instead (the hung agent holds its share of the version's admissions until its
    # death re-admits them). Two versions logged during the hang mean one publication began after the stop ...
    # A sync that blocks on the stopped agent is left behind after five heartbeats ("agent agent1 is late"); the
    # small toy model's weights may instead fit into the socket buffers, and the sync ends at once. Either way
    # no publication during the hang waited for the agent longer than that.
    if at_death - at_stop >= 2:
        during = job.metrics()[at_stop:at_death]
        assert ("agent agent1 is late" in job.text()
                or all(m["timing_s/param_sync"] <= late_after(timeout) + detection_margin() for m in during)), during
    # ... and after
    job.wait_versions(at_death + 10)

    # SIGCONT: the woken agent is fenced (nothing it delivers counts) and its process ends
    os.kill(agent1, signal.SIGCONT)
    wait_until(lambda: not alive(agent1), limit(120), "the woken agent's process to end")
    assert "agent1 was fenced out of the run" in job.text() or "agent1 was removed from the run" in job.text()
    job.wait_versions(len(job.metrics()) + 3)

    # SIGTERM to the launcher (what timeout, kill, Slurm and docker stop send): a checkpoint, one line, exit
    job.signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM
    line = job.wait_for(r"interrupted \(SIGTERM\) at version (\d+); checkpoint (step_\d+) written; resume with --resume")
    version, checkpoint = int(line.group(1)), line.group(2)
    no_process_left(job)
    summary = job.summary()
    assert summary["interrupted"] == "SIGTERM" and summary["dead_agents"] == ["agent1"]
    assert summary["agents"]["agent1"]["status"] == "dead" and summary["agents"]["agent0"]["status"] == "left"
    books_balance(summary)
    meta = json.loads((job.run_dir / "checkpoints" / checkpoint / "meta.json").read_text())
    assert meta["version"] == version == summary["versions"]
    extra = json.loads((job.run_dir / "checkpoints" / checkpoint / "extra.json").read_text())
    queued, unfinished = len(extra["queue"]["queue"]), len(extra["queue"]["unfinished"])
    assert summary["ledger"]["carried"] == queued + unfinished  # exactly the checkpoint's
    before = job.metrics()

    # --resume continues: same prompts, versions on from the checkpoint, the wall-clock goes on
    resumed = Job(tmp_path, *TOY, *TWO_AGENTS, *timeouts(timeout), "--async-training.total-versions",
                  str(version + 3), "--resume", name="job")
    jobs.append(resumed)
    assert resumed.finish() == 0, resumed.tail()
    assert f"resuming from {checkpoint} (version {version}, {queued} queued, {unfinished} in flight)" in resumed.text()
    after = resumed.summary()
    assert after["versions"] == version + 3 and after["steps"] == summary["steps"] + 3
    books_balance(after)
    assert after["ledger"]["trained"] == summary["ledger"]["trained"] + 3 * 4
    rows = resumed.metrics()
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and steps[-1] == version + 3  # no version logged twice
    assert rows[len(before)]["wall_s"] >= before[-1]["wall_s"]  # the clock did not restart


def test_an_agent_stopped_forever_does_not_keep_the_command_from_returning(tmp_path, jobs):
    timeout = agent_timeout()
    job = Job(tmp_path, *TOY, *TWO_AGENTS, *ENDLESS, *timeouts(timeout),
              "--async-training.time-budget-s", str(timeout + detection_margin() + limit(5)))
    jobs.append(job)
    job.wait_versions(3)
    agent1 = job.processes()["agent1"]
    os.kill(agent1, signal.SIGSTOP)
    assert job.finish() == 0, job.tail()
    assert "done:" in job.text()
    no_process_left(job)  # the launcher ended the stopped process (SIGKILL ends a stopped one too)
    summary = job.summary()
    assert summary["dead_agents"] == ["agent1"]
    books_balance(summary)


def test_killing_the_launcher_takes_every_process_of_the_run_with_it(tmp_path, jobs):
    job = Job(tmp_path, *TOY, *TWO_AGENTS, *ENDLESS)
    jobs.append(job)
    job.wait_versions(3)
    pids = job.all_pids()
    assert len(pids) == 3 and all(alive(pid) for pid in pids)
    os.kill(job.launcher_pid(), signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: not any(alive(pid) for pid in pids), limit(15), "the ranks to die with the launcher")
    assert time.monotonic() - killed_at < limit(15)


def test_a_hung_agent_is_ended_and_restarted_and_rejoins_with_the_current_weights(tmp_path, jobs):
    timeout = agent_timeout()
    job = Job(tmp_path, *TOY, *TWO_AGENTS, *ENDLESS, *timeouts(timeout), "--placement.restart-agents", "1",
              "--placement.restart-backoff-s", "0.5")
    jobs.append(job)
    job.wait_versions(5)
    first = job.processes()["agent1"]
    os.kill(first, signal.SIGSTOP)
    job.wait_for(r"rollout agent agent1 is dead \(silent", timeout=timeout + limit(60))
    wait_until(lambda: not alive(first), limit(30), "the launcher to end the hung process")
    job.wait_for(r"agent agent1_r1 is live", timeout=limit(180))
    live_at = len(job.metrics())
    job.wait_versions(live_at + 10)
    job.signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM
    no_process_left(job)
    summary = job.summary()
    restarted = summary["agents"]["agent1_r1"]
    assert summary["agents"]["agent1"]["status"] == "dead"
    # it joined with the weights of the version current at the time (not the initial ones) and took part
    assert restarted["first_version"] >= 5 and restarted["last_version"] == summary["versions"]
    assert restarted["submitted"] > 0
    books_balance(summary)


def test_a_new_agent_joins_a_running_job_gets_prompts_and_leaves_cleanly(tmp_path, jobs):
    port = free_ports()
    job = Job(tmp_path, *TOY, *ENDLESS, "--placement.join-port", str(port))
    jobs.append(job)
    job.wait_for(rf"asyncrl agent --join 127.0.0.1:{port}")
    job.wait_versions(3)
    joiner = Job(tmp_path, "--join", f"127.0.0.1:{port}", "--device", "cpu", name="joiner", command="agent",
                 preset=None)
    jobs.append(joiner)
    job.wait_for(r"agent agent1 is live", timeout=limit(180))
    live_at = len(job.metrics())
    job.wait_versions(live_at + 10)
    joiner.signal(signal.SIGTERM)  # leaves: its unfinished prompts go back to agent0
    assert joiner.finish() == 0, joiner.tail()
    job.wait_for(r"rollout agent agent1 left \(SIGTERM received\)")
    job.wait_versions(len(job.metrics()) + 3)
    job.signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM
    summary = job.summary()
    joined = summary["agents"]["agent1"]
    assert joined["status"] == "left" and joined["submitted"] > 0 and joined["first_version"] >= 3
    books_balance(summary)


def test_max_run_time_stops_the_job_like_sigterm_and_no_cap_is_imposed_by_default(tmp_path, jobs):
    # The cap counts from the launcher's start, start-up included (it bounds the whole job, as an operator's
    # wall-clock limit does). So that it falls while the job trains whatever the machine's speed, it is a
    # start-up allowance (scaled like every deadline here; a start-up takes ~5 s on an idle 2-core machine) plus a
    # few seconds of training. The uncapped job runs beside it (two jobs at once: the allowance covers a machine
    # that busy).
    cap = limit(12) + 4
    capped = Job(tmp_path, *TOY, *ENDLESS, "--placement.max-run-time-s", f"{cap:g}", name="capped")
    jobs.append(capped)
    uncapped = Job(tmp_path, *TOY, *ENDLESS, "--async-training.time-budget-s", f"{cap:g}", name="uncapped")
    jobs.append(uncapped)
    assert capped.finish(cap + limit(120)) == 124, capped.tail()
    stopped = capped.wait_for(rf"interrupted \(max_run_time_s={cap:g} reached\) at version (\d+); "
                              r"checkpoint (step_\d+) written")
    summary = capped.summary()
    assert summary["interrupted"] == f"max_run_time_s={cap:g} reached", summary
    assert int(stopped.group(1)) == summary["versions"] >= 1, stopped.group(0)  # it stopped training, not starting
    assert (capped.run_dir / "checkpoints" / stopped.group(2) / "learner.pt").is_file()
    books_balance(summary)
    # the same job without the cap runs past it (a time budget ends it)
    assert uncapped.finish(cap + limit(120)) == 0, uncapped.tail()
    assert uncapped.summary()["wall_s"] > cap and uncapped.summary()["interrupted"] is None


def test_resume_without_a_checkpoint_is_refused_before_anything_starts_unless_resume_or_start(tmp_path, jobs):
    refused = Job(tmp_path, *TOY, "--resume", name="empty")
    jobs.append(refused)
    assert refused.finish(limit(60)) == 1
    assert "--resume: " in refused.text() and "holds no checkpoint" in refused.text()
    assert "--resume-or-start" in refused.text()
    assert not refused.run_dir.exists()  # nothing written, no process started
    started = Job(tmp_path, *TOY, "--resume-or-start", "--async-training.total-versions", "2", name="empty")
    jobs.append(started)
    assert started.finish() == 0, started.tail()
    assert started.summary()["versions"] == 2


def test_a_run_whose_only_agent_dies_waits_for_its_restart_and_goes_on(tmp_path, jobs):
    job = Job(tmp_path, *TOY, *ENDLESS, "--placement.restart-agents", "1", "--placement.restart-backoff-s", "0.5")
    jobs.append(job)
    job.wait_versions(5)
    os.kill(job.processes()["agent0"], signal.SIGKILL)
    job.wait_for(r"rollout agent agent0 is dead")
    # no agent is live: the trainer publishes as soon as the restarted one has joined, so that it can start
    job.wait_for(r"no live rollout agent; publishing early to start agent0_r1", timeout=limit(180))
    job.wait_for(r"agent agent0_r1 is live")
    job.wait_versions(len(job.metrics()) + 5)
    job.signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM
    summary = job.summary()
    assert summary["agents"]["agent0"]["status"] == "dead" and summary["agents"]["agent0_r1"]["submitted"] > 0
    books_balance(summary)


TWO_TRAINERS = ("--placement.trainer-devices", "cpu", "cpu")


def test_a_dead_trainer_follower_ends_the_run_named_without_failover(tmp_path, jobs):
    """Trainer rank 1 killed (-9), `--trainer.max-recoveries` at its default 0: the launcher names its exit at once,
    every process of the run is gone and the message says how to go on. (A stopped follower, named by its
    heartbeat, and the recoveries themselves are in tests/rpc/test_trainer_failover.py.)"""
    job = Job(tmp_path, *TOY, *TWO_TRAINERS, *ENDLESS, "--async-training.sync-timeout-s", "300")
    jobs.append(job)
    job.wait_versions(2)
    os.kill(job.processes()["trainer1"], signal.SIGKILL)
    assert job.finish(timeout=limit(60)) != 0, job.tail()
    text = job.text()
    assert "trainer rank 1 exited with code -9; the run cannot go on without it (resume from its last checkpoint " \
           "with --resume)" in text, job.tail()
    no_process_left(job)


def test_a_stopped_trainer_rank_0_ends_the_run_named_without_failover(tmp_path, jobs):
    """Trainer rank 0 stopped (SIGSTOP), `--trainer.max-recoveries` at its default 0: its store, the agents' RPC and
    the run's loop stop with it, so nothing else would end the run. The launcher names it after
    --async-training.agent-timeout-s, ends every process of the run and says how to go on. (With failover the run
    starts again: tests/rpc/test_trainer_failover.py.)"""
    timeout = agent_timeout()
    job = Job(tmp_path, *TOY, *ENDLESS, *timeouts(timeout))
    jobs.append(job)
    job.wait_versions(2)
    rank0 = job.processes()["trainer0"]
    os.kill(rank0, signal.SIGSTOP)
    stopped_at = time.monotonic()
    assert job.finish(timeout=timeout + limit(60)) != 0, job.tail()
    assert time.monotonic() - stopped_at < timeout + detection_margin() + limit(15)
    text = job.text()
    assert f"trainer rank 0 (pid {rank0}) is stopped (SIGSTOP) for " in text, job.tail()
    assert "(without --trainer.max-recoveries trainer rank 0's death ends the run: resume from its last checkpoint " \
        "with --resume)" in text, job.tail()
    no_process_left(job)


@pytest.mark.parametrize("case", ["spent", "same step"])
def test_a_fault_failover_does_not_recover_from_ends_the_run_named(tmp_path, jobs, case):
    """`ASYNCRL_FAULT` kills trainer rank 1 once per trainer-group generation. "spent": the second fault finds
    `--trainer.max-recoveries 1` spent. "same step": the second fault (a checkpoint's) comes before another step was
    trained after the first (a publication's), which would repeat the same recovery; either way the run ends and
    says why."""
    points, recoveries = {"spent": ("trainer:1:version:1:phase:backward,trainer:1:version:3:phase:norm", "1"),
                          "same step": ("trainer:1:version:2:phase:publish,trainer:1:version:3:phase:checkpoint",
                                        "2")}[case]
    job = Job(tmp_path, *TOY, *TWO_TRAINERS, *ENDLESS, "--trainer.max-recoveries", recoveries, "--checkpoint-every",
              "1", env={"ASYNCRL_FAULT": points})
    jobs.append(job)
    assert job.finish(timeout=limit(120)) != 0, job.tail()
    text = job.text()
    assert "trainer group generation 1 ready" in text, job.tail()
    if case == "spent":
        assert "trainer rank 1 exited with code 9; the run cannot go on without it (--trainer.max-recoveries 1 " \
               "spent)" in text, job.tail()
        assert len(job.metrics()) == 3  # the step of version 3 → 4 died
    else:
        assert "trainer rank 1 exited with code 9; not recovered: a second fault before another step was trained " \
               "(both at step 3)" in text, job.tail()
    no_process_left(job)
