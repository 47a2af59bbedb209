"""The fork server that starts the launcher's role processes (`asyncrl.rpc.forkserver`): a forked process gets
the launcher's environment and working directory as of its own start, the signal dispositions of a fresh
process, what torch read from the environment when the server loaded it, and objects that cross only by
inheritance; exit codes are reported as multiprocessing reports them; the server survives a signal to the
launcher's process group and to itself, and kill -9 of the launcher takes the server and every process it
forked with it, a stopped one included. Then, in a real run: an agent killed and restarted at once (no
back-off) rejoins from the fork server."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.rpc.forkserver import ForkServer, SpawnStarter
from tests.rpc.jobs import TOY, Job, alive, wait_until
from tests.run_helpers import ROOT
from tests.timing import limit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(limit(300))]


# ------------------------------------------------------------------------- what the forked processes run
def report(queue, tag: str) -> None:
    """Put what this process sees on `queue`."""
    import torch
    queue.put({"tag": tag, "pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(),
               "env": os.environ.get("FORKSERVER_TEST"), "threads": torch.get_num_threads(),
               "signals": {sig.name: repr(signal.getsignal(sig)) for sig in (signal.SIGTERM, signal.SIGINT,
                                                                             signal.SIGHUP)}})


def exit_with(code: int) -> None:
    raise SystemExit(code)


def sleep_forever() -> None:
    while True:
        time.sleep(1)


# ---------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def server():
    """One server for the module, holding a multiprocessing Queue for its processes."""
    import multiprocessing
    queue = multiprocessing.get_context("spawn").Queue()
    starter = ForkServer(preload=(__name__,), inherited=(queue,), start_timeout_s=limit(120))
    yield starter, queue
    starter.close()


def test_a_forked_process_sees_the_launcher_as_of_its_own_start(server, tmp_path, monkeypatch):
    starter, queue = server
    home = os.getcwd()
    monkeypatch.setenv("FORKSERVER_TEST", "first")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = starter.start(report, (queue, "first"), name="first")
    first.join(limit(60))
    monkeypatch.setenv("FORKSERVER_TEST", "second")  # the launcher's environment and directory change
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.chdir(tmp_path)
    second = starter.start(report, (queue, "second"), name="second")
    second.join(limit(60))
    fresh = SpawnStarter().start(report, (queue, "fresh"), name="fresh")  # a fresh interpreter, for comparison
    fresh.join(limit(120))
    seen = {r["tag"]: r for r in (queue.get(timeout=limit(30)) for _ in range(3))}
    assert seen["first"]["env"] == "first" and seen["first"]["cwd"] == home
    assert seen["second"]["env"] == "second" and seen["second"]["cwd"] == str(tmp_path)
    # torch sizes its thread pool from OMP_NUM_THREADS (at most one per core) when a process first uses it: each
    # fork's own
    assert seen["first"]["threads"] == 1 and seen["second"]["threads"] == min(2, os.cpu_count())
    for r, child in ((seen["first"], first), (seen["second"], second)):
        assert r["pid"] == child.pid and r["ppid"] == starter.parent_pid == starter.server_pid
        assert r["signals"] == seen["fresh"]["signals"]  # a fresh interpreter's, not the server's ignored ones
        assert child.exitcode == 0 and not child.is_alive()


def test_exit_codes_are_reported_as_multiprocessing_reports_them(server):
    starter, _ = server
    three = starter.start(exit_with, (3,), name="three")
    sleeper = starter.start(sleep_forever, (), name="sleeper")
    three.join(limit(60))
    assert three.exitcode == 3
    assert sleeper.is_alive() and sleeper.exitcode is None
    sleeper.join(0.1)
    assert sleeper.is_alive()  # a join that times out leaves it running
    sleeper.kill()
    sleeper.join(limit(30))
    assert sleeper.exitcode == -signal.SIGKILL and not sleeper.is_alive()


def test_a_server_that_cannot_start_is_named_when_a_process_is_asked_of_it():
    broken = ForkServer(preload=("tests.rpc.no_such_module",), start_timeout_s=limit(60))
    try:
        with pytest.raises(RuntimeError, match=r"the fork server \(pid \d+\) exited with code 1 before starting "
                                               r"asyncrl-agent0; see its log above"):
            broken.start(exit_with, (0,), name="asyncrl-agent0")
    finally:
        broken.close()


def test_spawn_gives_the_same_process_face():
    """--placement.start-method spawn: fresh interpreters, children of this process."""
    starter = SpawnStarter()
    child = starter.start(exit_with, (5,), name="five")
    child.join(limit(120))
    assert child.exitcode == 5 and starter.parent_pid == os.getpid() and starter.server_pid is None


LAUNCHER = """
import json, os, signal, sys, time
sys.path.insert(0, {root!r})
from asyncrl.rpc.forkserver import ForkServer
from tests.rpc.test_forkserver import sleep_forever
server = ForkServer(preload=("tests.rpc.test_forkserver",))
children = [server.start(sleep_forever, (), name=f"sleeper{{i}}") for i in range(2)]
os.kill(children[1].pid, signal.SIGSTOP)
print(json.dumps({{"server": server.server_pid, "children": [c.pid for c in children]}}), flush=True)
time.sleep(600)
"""


def test_the_server_outlives_stray_signals_and_dies_with_the_launcher_taking_its_processes(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(root=str(ROOT))], stdout=subprocess.PIPE,
                                text=True, start_new_session=True, cwd=tmp_path)
    try:
        started = json.loads(launcher.stdout.readline())
        server, children = started["server"], started["children"]
        assert all(alive(pid) for pid in [server, *children])
        # outside the launcher's process group (a terminal's Ctrl-C, `timeout`, signal that group), and deaf to
        # the signals systemd or Slurm send every process of a job: the server and its processes stay
        assert os.getpgid(server) == server != os.getpgid(launcher.pid)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            os.kill(server, sig)
        time.sleep(1.0)  # a signal's default action is immediate: had it killed the server, it would be gone
        assert all(alive(pid) for pid in [server, *children])
        os.kill(launcher.pid, signal.SIGKILL)
        wait_until(lambda: not any(alive(pid) for pid in [server, *children]), limit(15),
                   "the server and its processes (one of them stopped) to die with the launcher")
    finally:
        launcher.kill()
        launcher.wait()


def test_an_agent_killed_and_restarted_at_once_rejoins_from_the_fork_server(tmp_path, jobs):
    """No back-off: the launcher starts the replacement once rank 0 has declared the dead agent dead (a fork
    starts in a fraction of a second, so one that joined before would wait on the dead member)."""
    job = Job(tmp_path, *TOY, "--async-training.total-versions", "1000000", "--placement.restart-agents", "1",
              "--placement.restart-backoff-s", "0")
    jobs.append(job)
    job.wait_versions(3)
    server = json.loads((job.run_dir / "processes.json").read_text())["forkserver"]
    agent = job.processes()["agent0"]
    assert alive(server) and pathlib.Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[1] == \
        str(server)  # the agent is the server's child
    os.kill(agent, signal.SIGKILL)
    job.wait_for(r"agent agent0_r1 is live", timeout=limit(120))
    job.wait_versions(len(job.metrics()) + 2)
    job.signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM, job.tail()
    wait_until(lambda: not alive(server), limit(20), "the fork server to end with the run")
    assert job.summary()["agents"]["agent0_r1"]["submitted"] > 0
