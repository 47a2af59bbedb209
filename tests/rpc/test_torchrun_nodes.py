"""Several nodes under torchrun, proven on one host: two torchrun launchers (separate process trees, each with its
own local ranks, rendezvous over loopback) run one job whose trainer group (FSDP2 over gloo) and agents span
both "nodes"; an agent killed on node 1 is restarted there by its keeper and rejoins. The role layout itself is
checked as a table."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from asyncrl.rpc.torchrun import TorchrunRole, torchrun_role
from tests.rpc.jobs import TOY, alive, wait_until
from tests.run_helpers import ROOT, torchrun_port
from tests.timing import limit


def _env(rank: int, world: int, nodes: int = 1, node: int = 0, local: int | None = None, per_node: int | None = None):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "GROUP_WORLD_SIZE": str(nodes), "GROUP_RANK": str(node)}
    if local is not None:
        env.update(LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_node))
    return env


def test_one_node_takes_trainers_first_then_agents():
    roles = [torchrun_role(_env(r, 5), num_trainers=2, num_agents=3) for r in range(5)]
    assert roles == [TorchrunRole("trainer", 0), TorchrunRole("trainer", 1), TorchrunRole("agent", 0),
                     TorchrunRole("agent", 1), TorchrunRole("agent", 2)]


def test_every_node_takes_the_same_share_of_trainers_and_agents():
    # 2 nodes x 3 processes, 2 trainers + 4 agents: each node has trainer n and agents 2n, 2n + 1
    layout = {(node, local): torchrun_role(_env(node * 3 + local, 6, 2, node, local, 3), 2, 4)
              for node in range(2) for local in range(3)}
    assert layout == {(0, 0): TorchrunRole("trainer", 0), (0, 1): TorchrunRole("agent", 0),
                      (0, 2): TorchrunRole("agent", 1), (1, 0): TorchrunRole("trainer", 1),
                      (1, 1): TorchrunRole("agent", 2), (1, 2): TorchrunRole("agent", 3)}
    # 4 trainers + 2 agents on 2 nodes: the trainer group's ranks 0-1 on node 0, 2-3 on node 1
    assert [torchrun_role(_env(3 + local, 6, 2, 1, local, 3), 4, 2) for local in range(3)] == [
        TorchrunRole("trainer", 2), TorchrunRole("trainer", 3), TorchrunRole("agent", 1)]


def test_a_layout_that_does_not_fit_names_the_flags():
    with pytest.raises(ValueError, match=r"torchrun started 4 processes but the placement needs 5 .* "
                                         r"fix --nproc-per-node / --nnodes"):
        torchrun_role(_env(0, 4), 2, 3)
    with pytest.raises(ValueError, match=r"--nnodes 2: every node takes the same share .* "
                                         r"--placement.trainer-devices lists 1 .* give multiples of 2"):
        torchrun_role(_env(0, 4, 2, 0, 0, 2), 1, 3)
    with pytest.raises(ValueError, match=r"--nproc-per-node 3: each of the 2 nodes runs 2 processes"):
        torchrun_role(_env(0, 4, 2, 0, 0, 3), 2, 2)
    with pytest.raises(ValueError, match=r"needs RANK, WORLD_SIZE in the environment"):
        torchrun_role({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, 1, 1)


# ----------------------------------------------------------------------------------- two nodes, one host
def _named(name: str, parent: int) -> list[int]:
    """The live children of `parent` named `name` (asyncrl names its processes: asyncrl-trainer1, asyncrl-agent1,
    and asyncrl-keep1 for the keeper of agent slot 1); a job of another test may run processes of the same names."""
    found = []
    for comm in pathlib.Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == name and _parent(int(comm.parent.name)) == parent:
                found.append(int(comm.parent.name))
        except (OSError, ValueError, IndexError):  # it ended meanwhile
            pass
    return [pid for pid in found if alive(pid)]


def _parent(pid: int) -> int:
    return int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _children(pid: int) -> list[str]:
    """The names of `pid`'s live child processes (the first 15 characters: asyncrl-trainer0 shows as
    asyncrl-trainer)."""
    names = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            if _parent(int(stat.parent.name)) == pid and alive(int(stat.parent.name)):
                names.append((stat.parent / "comm").read_text().strip())
        except (OSError, ValueError, IndexError):
            pass
    return sorted(names)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(limit(600))
def test_two_torchrun_nodes_train_one_job_and_restart_a_killed_agent(tmp_path):
    port = torchrun_port()
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    train = ["-m", "asyncrl.cli", "train", "cpu-demo", *TOY, "--run-dir", str(run_dir),
             "--placement.launcher", "torchrun", "--placement.trainer-devices", "cpu", "cpu",
             "--placement.agent-devices", "cpu", "cpu", "--placement.restart-agents", "1",
             "--placement.restart-backoff-s", "0.5", "--async-training.total-versions", "1000000"]
    nodes, logs = {}, {node: tmp_path / f"node{node}.log" for node in (0, 1)}
    for node in (1, 0):  # node 1 first: it waits at the rendezvous for node 0
        with open(logs[node], "w") as out:
            nodes[node] = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                 "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), *train],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    node0, node1 = nodes[0], nodes[1]

    def text(node: int) -> str:
        return logs[node].read_text(errors="replace")

    def versions() -> int:
        path = run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    try:
        wait_until(lambda: versions() >= 3 or node0.poll() is not None, limit(240), "3 versions")
        assert node0.poll() is None, text(0)[-6000:]
        # the trainer group spans the nodes (rank 1 is a worker of node 1's torchrun) and so do the agents (slot 1
        # is kept there, as a child of its keeper)
        assert _children(node0.pid) == ["asyncrl-keep0", "asyncrl-trainer"]
        assert _children(node1.pid) == ["asyncrl-keep1", "asyncrl-trainer"]
        [keeper] = _named("asyncrl-keep1", node1.pid)
        [victim] = wait_until(lambda: _named("asyncrl-agent1", keeper), limit(60), "agent slot 1's process")
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: "agent agent1_r1 is live" in text(0), limit(240),
                   "the restarted agent to be live (rank 0's log)")
        restarted = versions()
        wait_until(lambda: versions() >= restarted + 5, limit(120), "5 more versions after the restart")
        node0.send_signal(signal.SIGTERM)  # node 0 preempted: torchrun passes it on, rank 0 checkpoints and ends the run
        node0.wait(limit(120))
        node1.wait(limit(120))  # node 1's ranks follow the end of the run: nothing left to kill
    finally:
        for proc in nodes.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert node1.returncode == 0, text(1)[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    agents = summary["agents"]
    assert agents["agent1"]["status"] == "dead" and agents["agent1_r1"]["submitted"] > 0, agents
    assert agents["agent0"]["submitted"] > 0
    assert summary["interrupted"] == "SIGTERM" and summary["checkpoint"] is not None
    ledger = summary["ledger"]
    assert ledger["admitted"] == ledger["trained"] + ledger["dropped"] + ledger.get("carried", 0), ledger
