"""One job across hosts: three network namespaces on a bridge (tests/netns.py: hosta 198.18.0.1, hostb .2, hostc .3,
each its own host name and hosts file). A torchrun launcher on hosta and one on hostb run one job whose trainer group
(FSDP2 over gloo) and agents span both hosts, its master given by name (hosta), the run's token exported on both.
Proven on the running job: every socket its processes listen on is on the test network or loopback (torchrun's own
store, which binds every interface, is the one exception, and named); a stranger on hostc with torch but without the
token, who reads the RPC port from the run's store and joins the RPC group, is refused by trainer0's seal and never
calls it, and the control records it forges in the store (shutdown, dead reports naming the agents' pids, exits,
leave requests, refusals) change nothing; an agent killed on hostb is restarted there and rejoins; node 0 preempted
ends the run with a checkpoint. A host whose cable is out longer than the agent timeout loses its agent, which
joins again when the cable is back. And a head whose hosts file maps its own name to 127.0.1.1 is refused before
start, naming its address on the network."""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from tests.netns import SUBNET
from tests.rpc.jobs import TOY, alive, wait_until
from tests.rpc.sockets import descendants, is_loopback_address, listening_sockets
from tests.run_helpers import ROOT
from tests.timing import agent_timeout, detection_margin, limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PORT = 29400  # each host has a network of its own: no port can be taken by another test
TOKEN = "0123456789abcdef-hosts-test"


def _named(name: str, parent: int) -> list[int]:
    """The live children of `parent` named `name` (asyncrl names its processes: asyncrl-trainer1, asyncrl-agent1,
    and asyncrl-keep1 for the keeper of agent slot 1)."""
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


def _on_test_network(address: str) -> bool:
    return is_loopback_address(address) or ipaddress.ip_address(address) in ipaddress.ip_network(f"{SUBNET}.0/24")


def _assert_listeners(net_hosts, *launchers: int) -> None:
    """Every listener of the job's own processes is on the test network or loopback; torchrun's store (its static
    rendezvous binds every interface) is the only wildcard, on the master port of hosta's launcher."""
    listeners = listening_sockets(set().union(*(descendants(pid) for pid in launchers)))
    ours = [row for row in listeners if row[2] not in launchers]
    assert ours and all(_on_test_network(address) for address, _, _ in ours), ours
    assert {address for address, _, _ in ours} & {net_hosts.addresses["hosta"], net_hosts.addresses["hostb"]}
    wildcard = [(port, pid) for address, port, pid in listeners if not _on_test_network(address)]
    assert wildcard == [(PORT, launchers[0])], listeners


def _stranger(net_hosts, cwd: pathlib.Path, *args: str) -> str:
    """What tests/rpc/stranger.py printed, run on hostc against the job's store, without the token."""
    env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_RUN_TOKEN"}
    out = subprocess.run(net_hosts.command("hostc", [sys.executable, str(ROOT / "tests/rpc/stranger.py"), "hosta",
                                                     str(PORT + 1), *args]),
                         capture_output=True, text=True, timeout=limit(180), cwd=cwd, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _kill_on_hostb_and_train_on(node1: int, keeper_name: str, name: str, versions, more: int, back) -> None:
    """SIGKILL the process `name` that hostb's keeper `keeper_name` keeps; wait until `back()` (rank 0's log says
    it is back) and `more` versions were trained after that."""
    [keeper] = _named(keeper_name, node1)
    [victim] = wait_until(lambda: _named(name, keeper), limit(60), f"{name}'s process")
    os.kill(victim, signal.SIGKILL)
    wait_until(back, limit(240), f"{name} back (rank 0's log)")
    after = versions()
    wait_until(lambda: versions() >= after + more, limit(120), f"{more} more versions after {name} came back")


@pytest.mark.timeout(limit(720))
def test_a_job_across_two_hosts_trains_listens_only_on_its_network_and_a_stranger_changes_nothing(tmp_path, net_hosts):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ASYNCRL_RUN_TOKEN": TOKEN}
    train = ["-m", "asyncrl.cli", "train", "cpu-demo", *TOY, "--run-dir", str(run_dir),
             "--placement.launcher", "torchrun", "--placement.trainer-devices", "cpu", "cpu",
             "--placement.agent-devices", "cpu", "cpu", "--placement.restart-agents", "1",
             "--placement.restart-backoff-s", "0.5", "--async-training.total-versions", "1000000",
             "--trainer.max-recoveries", "1"]
    nodes, logs = {}, {node: tmp_path / f"node{node}.log" for node in (0, 1)}
    for node, host in ((1, "hostb"), (0, "hosta")):  # node 1 first: it waits at the rendezvous for node 0
        with open(logs[node], "w") as out:
            nodes[node] = net_hosts.popen(
                host, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                       "--nproc-per-node", "2", "--master-addr", "hosta", "--master-port", str(PORT), *train],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    node0, node1 = nodes[0], nodes[1]

    def text(node: int) -> str:
        return logs[node].read_text(errors="replace")

    def versions() -> int:
        path = run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    try:
        wait_until(lambda: versions() >= 3 or node0.poll() is not None or node1.poll() is not None, limit(300),
                   "3 versions")
        assert node0.poll() is None and node1.poll() is None, (text(0)[-5000:], text(1)[-5000:])
        # the trainer group spans the hosts (rank 1 is a worker of hostb's torchrun) and so do the agents
        assert _children(node0.pid) == ["asyncrl-keep0", "asyncrl-trainer"]
        assert _children(node1.pid) == ["asyncrl-keep-tr", "asyncrl-keep1"]  # trainer rank 1 is kept (failover)

        _assert_listeners(net_hosts, node0.pid, node1.pid)

        # a stranger on hostc: torch alone, no token; reads the RPC port from the run's store and joins
        outcome = _stranger(net_hosts, tmp_path).splitlines()
        assert outcome and outcome[0].startswith("join refused"), outcome
        # its join sends to every member: whichever reads its message first refuses it (trainer0, or an agent)
        wait_until(lambda: any("SealError: a message whose seal does not match" in text(n) for n in (0, 1)),
                   limit(60), "a process of the run to refuse the stranger's message")
        # the stranger forges the run's control records: shutdown, every agent dead (pid included), exits,
        # leave requests, refusals; none is signed with the run's token, so nothing happens
        agents_before = {pid for pid in descendants(node0.pid) | descendants(node1.pid)}
        assert _stranger(net_hosts, tmp_path, "--forge").startswith("forged: ")
        before = versions()
        wait_until(lambda: versions() >= before + 3, limit(120), "3 versions after the forged records")
        assert node0.poll() is None and node1.poll() is None
        assert agents_before <= descendants(node0.pid) | descendants(node1.pid), "a process of the run was ended"
        assert "declared dead" not in text(0) and "ignored store entry" in text(0) + text(1)

        # an agent killed on hostb is restarted there by its keeper and rejoins
        _kill_on_hostb_and_train_on(node1.pid, "asyncrl-keep1", "asyncrl-agent1", versions, 5, lambda: re.search(
            r"agent agent1_r1 \(pid \d+, cpu\) admitted", text(0)))
        # so is trainer rank 1 (failover), and rank 0 on hosta re-forms the trainer group with it
        _kill_on_hostb_and_train_on(node1.pid, "asyncrl-keep-tr", "asyncrl-trainer", versions, 3,
                                    lambda: "trainer group generation 1 ready" in text(0))
        node0.send_signal(signal.SIGTERM)  # hosta preempted: rank 0 checkpoints and ends the run
        node0.wait(limit(120))
        node1.wait(limit(120))  # hostb's ranks follow the end of the run: nothing left to kill
    finally:
        for proc in nodes.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert node1.returncode == 0, text(1)[-6000:]
    assert TOKEN not in text(0) + text(1)
    summary = json.loads((run_dir / "summary.json").read_text())
    agents = summary["agents"]
    assert agents["agent1"]["status"] == "dead" and agents["agent1_r1"]["submitted"] > 0, agents
    assert agents["agent0"]["submitted"] > 0
    assert summary["interrupted"] == "SIGTERM" and summary["checkpoint"] is not None
    [recovery] = summary["trainer_recoveries"]
    assert recovery["why"].startswith("trainer rank 1 exited with code -9"), recovery
    ledger = summary["ledger"]
    assert ledger["admitted"] == ledger["trained"] + ledger["dropped"] + ledger.get("carried", 0), ledger


@pytest.mark.timeout(limit(600))
def test_a_head_whose_name_resolves_to_127_0_1_1_is_refused_naming_its_network_address(tmp_path, net_hosts):
    """The Debian/Ubuntu hosts file maps a machine's own name to 127.0.1.1: a two-node job with that name as its
    master would bind rank 0 to loopback on the head while the other node dials the network address, and never
    form. A worker of such a job (torchrun's environment, on hostc with hostc's name on 127.0.1.1) is refused
    before it starts anything, naming MASTER_ADDR and hostc's address on the test network."""
    env = {**os.environ, "ASYNCRL_RUN_TOKEN": TOKEN, "MASTER_ADDR": "hostc", "MASTER_PORT": str(PORT),
           "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}
    train = [sys.executable, "-m", "asyncrl.cli", "train", "cpu-demo", *TOY, "--run-dir", str(tmp_path / "run"),
             "--placement.launcher", "torchrun", "--placement.trainer-devices", "cpu", "cpu",
             "--placement.agent-devices", "cpu", "cpu"]
    with net_hosts.own_name_on_loopback("hostc"):
        out = subprocess.run(net_hosts.command("hostc", train), capture_output=True, text=True,
                             timeout=limit(180), cwd=ROOT, env=env)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Traceback" not in text, text[-3000:]
    assert "MASTER_ADDR=hostc resolves to loopback" in text, text[-3000:]
    assert f"(this machine's: {net_hosts.addresses['hostc']})" in text, text[-3000:]
    assert not (tmp_path / "run").exists()  # refused before the run began


def test_a_host_cut_off_past_the_agent_timeout_loses_its_agent_which_rejoins_when_the_link_returns(tmp_path,
                                                                                                 net_hosts):
    """The job on hosta (its own agent there); an agent joins from hostb (`asyncrl agent --join hosta:PORT`, the
    token exported). hostb's cable out longer than the agent timeout: rank 0 names that agent dead and re-admits its
    prompts, the job trains on; cable back in: the agent learns it was fenced and joins again as a new agent."""
    timeout = agent_timeout()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ASYNCRL_RUN_TOKEN": TOKEN}
    run_dir, logs = tmp_path / "run", {host: tmp_path / f"{host}.log" for host in ("hosta", "hostb")}
    procs = {}
    try:
        with open(logs["hosta"], "w") as out:
            procs["hosta"] = net_hosts.popen(
                "hosta", [sys.executable, "-m", "asyncrl.cli", "train", "cpu-demo", *TOY, "--run-dir", str(run_dir),
                          "--placement.master-addr", "hosta", "--placement.join-port", str(PORT + 11),
                          "--async-training.agent-timeout-s", f"{timeout:g}",
                          "--async-training.total-versions", "1000000"],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        with open(logs["hostb"], "w") as out:
            procs["hostb"] = net_hosts.popen(
                "hostb", [sys.executable, "-m", "asyncrl.cli", "agent", "--join", f"hosta:{PORT + 11}"],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

        def text(host: str) -> str:
            return logs[host].read_text(errors="replace")

        def metrics() -> list[str]:
            path = run_dir / "metrics.jsonl"
            return path.read_text().splitlines() if path.is_file() else []

        def admitted(name: str) -> bool:  # rank 0 logs every admission ("is live" only when an agent was late)
            return re.search(rf"agent {name} \(pid \d+, cpu\) admitted", text("hosta")) is not None

        def live_agents() -> int:  # the newest version's count of agents generating
            rows = metrics()
            return int(json.loads(rows[-1]).get("fully_async/agents/live", 0)) if rows else 0

        wait_until(lambda: admitted("agent1"), limit(180), "hostb's agent to be admitted")
        # live, not just admitted: cut during its first weight sync, a joiner would stall that publication until
        # --async-training.sync-timeout-s (it is not yet subject to the agent timeout); then 2 versions with it
        wait_until(lambda: live_agents() >= 2, limit(120), "hostb's agent to get its first weights")
        versions = len(metrics())
        wait_until(lambda: len(metrics()) >= versions + 2, limit(120), "2 versions with hostb's agent")
        net_hosts.link("hostb", up=False)
        dead = wait_until(lambda: re.search(r"rollout agent agent1 is dead \(silent for ([0-9.]+) s.*re-admitting",
                                            text("hosta")), timeout + detection_margin() + limit(30),
                          "rank 0 to name hostb's agent dead")
        assert float(dead.group(1)) >= timeout * 0.9
        versions = len(metrics())
        wait_until(lambda: len(metrics()) >= versions + 3, limit(120), "3 more versions without hostb")
        net_hosts.link("hostb", up=True)
        wait_until(lambda: admitted("agent2"), limit(180), "hostb's agent to join again")
        assert "was fenced out of the run" in text("hostb") and "joining it again" in text("hostb")
        assert procs["hosta"].poll() is None and procs["hostb"].poll() is None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
