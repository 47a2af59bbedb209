"""What a run exposes: on loopback every listening socket of every process of a running job is a loopback one;
an agent must prove the run's token before it gets anything; tokens are read, checked and never shown by repr.

The listening sockets are read from /proc (each process's socket inodes, matched against the kernel's TCP
tables), so the test sees what the kernel sees, including what torch, TensorPipe and gloo open on their own.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

from asyncrl.config.evaluation import EvalConfig
from asyncrl.rpc.exposure import (RunToken, bind_address, is_loopback, listening_socket, new_token, outward_address,
                                  read_token)
from asyncrl.rpc.roles import free_port
from tests.rpc.jobs import TOY, Job
from tests.rpc.sockets import descendants, is_loopback_address, listening_sockets
from tests.timing import limit

ROOT = pathlib.Path(__file__).resolve().parents[2]

ENDLESS = ("--async-training.total-versions", "1000000")


# ------------------------------------------------------------------------------------------- tests
def test_the_reader_sees_a_socket_listening_on_every_interface():
    """The reader has power: a socket bound to 0.0.0.0 is listed as such."""
    with socket.socket() as wide:
        wide.bind(("0.0.0.0", 0))
        wide.listen(1)
        port = wide.getsockname()[1]
        listed = [row for row in listening_sockets({os.getpid()}) if row[1] == port]
    assert listed == [("0.0.0.0", port, os.getpid())]
    assert not is_loopback_address("0.0.0.0") and is_loopback_address("::ffff:127.0.0.1")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(limit(600))
def test_every_listener_of_a_loopback_job_is_on_loopback_and_an_agent_with_a_wrong_token_is_refused(
        tmp_path, jobs, monkeypatch):
    """One job on loopback, two agents and a join port: every listener of its processes is a loopback one; then an
    agent with a wrong token is refused and told before it joins, a process using torch alone (no token) that joins
    the RPC group is refused by trainer0's seal and never calls it, and the run goes on without either."""
    port = free_port()
    job = Job(tmp_path, *TOY, *ENDLESS, "--placement.agent-devices", "cpu", "cpu", "--placement.join-port", str(port))
    jobs.append(job)
    job.wait_for(rf"asyncrl agent --join 127.0.0.1:{port} --device DEVICE\n")  # loopback: no token to show
    job.wait_versions(3)
    pids = descendants(job.proc.pid)
    assert set(job.processes().values()) <= pids
    listeners = listening_sockets(pids)
    ports = {p for _, p, _ in listeners}
    assert port in ports, f"the run's store on {port} is not among the listeners {sorted(ports)}"
    assert len({pid for _, _, pid in listeners}) >= 3, "trainer and both agents listen (RPC, gloo)"
    exposed = [row for row in listeners if not is_loopback_address(row[0])]
    assert not exposed, f"listening beyond loopback (address, port, pid): {exposed}"

    monkeypatch.setenv("ASYNCRL_RUN_TOKEN", "not-the-token-of-this-run")
    intruder = Job(tmp_path, "--join", f"127.0.0.1:{port}", name="intruder", command="agent", preset=None)
    jobs.append(intruder)
    assert intruder.finish() == 2, intruder.tail()
    assert "the run refused this agent: it did not present the run's token" in intruder.text()
    # torch alone, without the token: its join's first message to trainer0 is refused unread, and it never calls
    stranger = subprocess.run([sys.executable, str(ROOT / "tests/rpc/stranger.py"), "127.0.0.1", str(port)],
                              capture_output=True, text=True, timeout=limit(180), cwd=tmp_path)
    outcome = stranger.stdout.splitlines()
    assert outcome and outcome[0].startswith("join refused"), (stranger.stdout, stranger.stderr[-2000:])
    assert not any(line.startswith("called") for line in outcome)
    job.wait_for(r"SealError: a message whose seal does not match this run's key")
    versions = len(job.metrics())
    job.wait_versions(versions + 3)  # the run goes on
    assert "token-of-this-run" not in job.text()
    job.signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM, job.tail()
    assert set(job.summary()["agents"]) == {"agent0", "agent1"}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(limit(360))
def test_a_run_on_a_network_address_needs_a_token_it_never_prints(tmp_path, jobs, monkeypatch):
    address = outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    port = free_port()
    token = "0123456789abcdef-network-run"
    monkeypatch.setenv("ASYNCRL_RUN_TOKEN", token)
    job = Job(tmp_path, *TOY, *ENDLESS, "--placement.master-addr", address, "--placement.join-port", str(port))
    jobs.append(job)
    job.wait_for(rf"asyncrl agent --join {address}:{port} --device DEVICE \(with the run's token in "
                 r"\$ASYNCRL_RUN_TOKEN or --token-file FILE\)")
    store = [row for row in listening_sockets(descendants(job.proc.pid)) if row[1] == port]
    assert [row[0] for row in store] == [address], "the store listens on the address it was given, nowhere else"
    monkeypatch.delenv("ASYNCRL_RUN_TOKEN")
    stranger = Job(tmp_path, "--join", f"{address}:{port}", name="stranger", command="agent", preset=None)
    jobs.append(stranger)
    assert stranger.finish() == 2, stranger.tail()
    assert "is not on loopback: give its token" in stranger.text()
    monkeypatch.setenv("ASYNCRL_RUN_TOKEN", token)
    member = Job(tmp_path, "--join", f"{address}:{port}", name="member", command="agent", preset=None)
    jobs.append(member)
    job.wait_for(r"agent agent1 is live", timeout=limit(180))  # the member (the run's own agent is agent0)
    job.signal(signal.SIGTERM)
    assert job.finish() == 128 + signal.SIGTERM, job.tail()
    assert member.finish() == 0, member.tail()
    metrics_text = (job.run_dir / "metrics.jsonl").read_text() + (job.run_dir / "config.json").read_text()
    assert token not in metrics_text + job.text() + member.text()


def test_tokens_are_read_from_a_file_or_the_environment_and_checked(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCRL_RUN_TOKEN", raising=False)
    assert read_token(None, flag="--token-file") is None
    monkeypatch.setenv("ASYNCRL_RUN_TOKEN", "0123456789abcdef")
    assert read_token(None, flag="--token-file") == RunToken("0123456789abcdef")
    file = tmp_path / "token"
    file.write_text("fedcba9876543210fedcba\nignored\n")
    assert read_token(str(file), flag="--token-file").value == "fedcba9876543210fedcba"  # the file wins
    file.write_text("short\n")
    with pytest.raises(ValueError, match=r"--token-file .*token: the run token has 5 characters; use at least 16"):
        read_token(str(file), flag="--token-file")
    with pytest.raises(ValueError, match=r"--placement.token-file .*missing: cannot read the run token"):
        read_token(str(tmp_path / "missing"), flag="--placement.token-file")


def test_a_token_proves_a_name_without_travelling_and_is_never_shown():
    token, other = new_token(), new_token()
    proof = token.proof("agent1", "nonce")
    assert token.admits("agent1", "nonce", proof)
    assert not token.admits("agent2", "nonce", proof)  # bound to the name
    assert not token.admits("agent1", "another", proof)  # and to the run's nonce
    assert not other.admits("agent1", "nonce", proof)
    assert not token.admits("agent1", "nonce", None) and not token.admits("agent1", "nonce", 5)
    assert token.value not in proof and token.value not in repr(token) and token.value not in str(token)


def test_loopback_addresses_bind_loopback_and_others_bind_what_they_name():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.0.0.2")
    assert not is_loopback("10.1.2.3") and not is_loopback("0.0.0.0")
    assert bind_address("127.0.0.1") == bind_address("localhost") == "127.0.0.1"
    with listening_socket("localhost", 0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
    for host, says in (("10.1.2.3", "10.1.2.3 is not an address of this machine"),
                       ("0.0.0.0", "listens on every interface"), ("no-such-host.invalid", "does not resolve")):
        with pytest.raises(ValueError, match=f"--placement.master-addr {host}: .*{says}"):
            bind_address(host)
    address = outward_address()
    if address is not None:  # an address of this machine binds itself; its name binds that address, never ''
        assert bind_address(address) == address
    name = socket.gethostname()
    try:
        bound = bind_address(name)
    except ValueError as err:
        assert "is not an address of this machine" in str(err)  # a name the hosts file maps elsewhere
    else:
        assert bound and bound != "0.0.0.0"


def _toy_config(tmp_path, **placement):
    from asyncrl.config.presets import PRESETS
    base = PRESETS["cpu-demo"][1]
    return dataclasses.replace(
        base, model=dataclasses.replace(base.model, path="random:tiny-qwen2"),
        data=dataclasses.replace(base.data, task="toy"), run_dir=str(tmp_path / "run"), eval=EvalConfig(),
        placement=dataclasses.replace(base.placement, **placement))


def test_the_checks_before_launch_say_what_is_exposed_and_refuse_a_bad_token(tmp_path, monkeypatch):
    from asyncrl.launch.preflight import preflight
    monkeypatch.delenv("ASYNCRL_RUN_TOKEN", raising=False)
    report = preflight(_toy_config(tmp_path))
    assert report.ok and "network: every listener of asyncrl on loopback (127.0.0.1); nothing exposed" in report.facts
    assert "listen: the run's store 127.0.0.1:a free port and the RPC group's store 127.0.0.1:a free port (trainer " \
        "rank 0)" in report.facts
    assert "listen: each of the 2 processes, one TensorPipe (RPC) port and gloo's pairs (trainer group, commands, " \
        "CPU weight channels) on lo (127.0.0.1), ports the kernel picks" in report.facts
    report = preflight(_toy_config(tmp_path, interface="no-such-if0"))
    assert any(p.startswith("--placement.interface no-such-if0: no interface of this machine by that name") and
               "lo (127.0.0.1" in p for p in report.problems), report.problems
    (tmp_path / "short").write_text("abc\n")
    report = preflight(_toy_config(tmp_path, master_addr="10.9.8.7", token_file=str(tmp_path / "short")))
    assert any(p.startswith("--placement.token-file ") and "use at least 16" in p for p in report.problems)
    report = preflight(_toy_config(tmp_path, master_addr="10.9.8.7"))
    assert any(p.startswith("--placement.master-addr 10.9.8.7: 10.9.8.7 is not an address of this machine")
               for p in report.problems), report.problems
    address = outward_address()
    if address is not None:  # an address of this machine, no token given: refused before launch, nothing printed
        report = preflight(_toy_config(tmp_path, master_addr=address))
        assert any(p.startswith(f"--placement.master-addr {address} is not loopback: a run other hosts can reach "
                                "needs a token you give") for p in report.problems), report.problems
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    report = preflight(_toy_config(tmp_path, launcher="torchrun"))
    assert any("listen: torchrun's own store on every interface, port 29500" in f for f in report.facts)
    assert "listen: the run's store 127.0.0.1:29501 and the RPC group's store 127.0.0.1:29502 (trainer rank 0)" \
        in report.facts
    monkeypatch.setenv("MASTER_ADDR", "10.9.8.7")  # another node's: this one only reaches its stores
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("ASYNCRL_RUN_TOKEN", "0123456789abcdef0123")
    report = preflight(_toy_config(tmp_path, launcher="torchrun"))
    assert not any("10.9.8.7" in p for p in report.problems), report.problems
    monkeypatch.delenv("GROUP_RANK")
    monkeypatch.delenv("ASYNCRL_RUN_TOKEN")
    address = outward_address()
    if address is None:
        return
    monkeypatch.setenv("MASTER_ADDR", address)
    report = preflight(_toy_config(tmp_path, launcher="torchrun"))
    assert any(f"MASTER_ADDR={address} is not loopback" in p and "ASYNCRL_RUN_TOKEN" in p for p in report.problems)
    monkeypatch.setenv("ASYNCRL_RUN_TOKEN", "0123456789abcdef0123")
    report = preflight(_toy_config(tmp_path, launcher="torchrun"))
    assert not any("MASTER_ADDR" in p for p in report.problems)
    assert any("every RPC message sealed with the run's token" in f for f in report.facts)


def test_a_master_name_the_hosts_file_maps_to_loopback_is_refused_on_a_job_of_several_nodes(monkeypatch):
    from asyncrl.rpc.torchrun import check_master
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):  # the Debian/Ubuntu hosts file: this machine's name -> 127.0.1.1
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))] if host == "head" else \
            real(host, *args, **kwargs)
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with pytest.raises(ValueError, match="MASTER_ADDR=head resolves to loopback here .* this job spans 2 nodes"):
        check_master("head", 2)
    check_master("head", 1)  # one node: loopback is right
    check_master("127.0.0.1", 2)  # an address typed as loopback: two launchers on one host, as the tests run
    check_master("localhost", 2)


def test_the_run_s_interface_is_loopback_the_named_one_or_the_one_that_routes_to_the_master(monkeypatch):
    from asyncrl.rpc.exposure import SOCKET_VARIABLES, interface_addresses, pin_interface, socket_interface
    addresses = interface_addresses()
    assert "127.0.0.1" in addresses["lo"]
    assert socket_interface("127.0.0.1") == ("lo", "127.0.0.1")
    assert socket_interface("127.0.0.1", "lo") == ("lo", "127.0.0.1")
    with pytest.raises(ValueError, match="--placement.interface eth9x: no interface"):
        socket_interface("127.0.0.1", "eth9x")
    address = outward_address()
    if address is not None:  # the interface holding this machine's outward address routes to it
        name, local = socket_interface(address)
        assert local == address and address in addresses[name]
    for variable in (*SOCKET_VARIABLES, "VLLM_HOST_IP"):
        monkeypatch.setenv(variable, "set-by-the-operator")
    if address is not None:  # auto keeps what the operator exported on a network run
        pin_interface(address)
        assert os.environ["GLOO_SOCKET_IFNAME"] == "set-by-the-operator"
    assert pin_interface("127.0.0.1") == ("lo", "127.0.0.1")  # a loopback run pins every variable
    assert all(os.environ[v] == "lo" for v in SOCKET_VARIABLES) and os.environ["VLLM_HOST_IP"] == "127.0.0.1"
    pin_interface("127.0.0.1", "lo")
    assert os.environ["TP_SOCKET_IFNAME"] == "lo"
