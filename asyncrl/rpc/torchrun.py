"""The run under torchrun, on one node or several: which role each torchrun process takes, and the agent
keeper that lets a rollout agent die and come back without torchrun tearing its node down.

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr HOST0 --master-port 29500 \
        -m asyncrl.cli train cpu-demo --placement.launcher torchrun \
        --placement.trainer-devices cpu cpu --placement.agent-devices cpu cpu      # and --node-rank 1 on HOST1

**Roles.** On one node, ranks `0 .. T−1` train and the rest are agents. On N nodes every node gets the same
share, T/N trainers then A/N agents by local rank, so the trainer group (FSDP2) and the agents both span the
nodes: node n's trainers are ranks n·T/N .. (n+1)·T/N − 1 of the trainer group, its agents slots n·A/N ... Node
0's local rank 0 is trainer rank 0, which serves the run's store (MASTER_PORT + 1) and RPC (MASTER_PORT + 2).
A device `cuda` means the node's GPU LOCAL_RANK.

**With `--trainer.max-recoveries`, trainer followers are kept too** (`keep_trainer`): a follower's torchrun process
starts its trainer rank as a child. When a child exits with an error or its heartbeat stops for
`--async-training.agent-timeout-s`, its keeper claims the trainer group's next generation in the store (one keeper
wins it) and posts the fault; every keeper that sees a fault of a newer generation ends its child and starts it
again in that generation, and trainer rank 0 re-forms the group (`asyncrl.rpc.failover`). Restore points live in
each host's shared memory, in a directory named by the run's nonce.

**Agents are kept, not run.** torchrun ends every process of a node when one of them fails, so an agent's
torchrun process does not run the agent itself: it starts it as a child and keeps it. A child that dies (or
that rank 0 declares dead: a hung one is ended) is reported to rank 0 at once and started again after a
back-off, under its slot's next name, while the run's restart budget (`--placement.restart-agents`, shared by
every node through the store) lasts; the keeper ends when its agent ends with the run.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import multiprocessing
import os
import shutil
import time
from typing import Literal, Mapping, NoReturn

from asyncrl.rpc.assembly import resolve_resume
from asyncrl.rpc.failover import Silence, restore_points_directory
from asyncrl.rpc.exposure import TOKEN_ENV, RunToken, is_loopback, new_token, outward_address, read_token
from asyncrl.rpc.roles import run_agent_process, run_trainer
from asyncrl.rpc.spec import RunSpec
from asyncrl.rpc.store import RunStore
from asyncrl.runtime.controller import RunSummary
from asyncrl.runtime.kill_points import check_kill_point_env
from asyncrl.runtime.lifecycle import StopRequest, die_with_parent, name_process, on_signals
from asyncrl.runtime.run_log import RunLog

__all__ = ["TorchrunRole", "torchrun_role", "run_torchrun", "keep_agent", "keep_trainer"]

log = logging.getLogger(__name__)

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class TorchrunRole:
    kind: Literal["trainer", "agent"]
    index: int
    """The trainer group rank, or the agent slot."""


def torchrun_role(env: Mapping[str, str], num_trainers: int, num_agents: int) -> TorchrunRole:
    """This process's role from torchrun's environment (see the module docstring). Raises ValueError naming
    the flags to fix when the processes torchrun started do not fit the placement."""
    missing = [k for k in REQUIRED if k not in env]
    if missing:
        raise ValueError(f"--placement.launcher torchrun needs {', '.join(missing)} in the environment; start the "
                         "run with `torchrun --nnodes N --nproc-per-node P ... -m asyncrl.cli train ...`")
    world = num_trainers + num_agents
    if int(env["WORLD_SIZE"]) != world:
        raise ValueError(f"torchrun started {env['WORLD_SIZE']} processes but the placement needs {world} "
                         f"({num_trainers} trainers + {num_agents} agents); fix --nproc-per-node / --nnodes or "
                         "--placement.trainer-devices / --placement.agent-devices")
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    if nodes == 1:
        rank = int(env["RANK"])
        return TorchrunRole("trainer", rank) if rank < num_trainers else TorchrunRole("agent", rank - num_trainers)
    if num_trainers % nodes or num_agents % nodes:
        raise ValueError(f"--nnodes {nodes}: every node takes the same share of trainers and agents, but "
                         f"--placement.trainer-devices lists {num_trainers} and --placement.agent-devices "
                         f"{num_agents}; give multiples of {nodes} (e.g. {nodes} trainers and {nodes} agents)")
    per_node = world // nodes
    if int(env.get("LOCAL_WORLD_SIZE", per_node)) != per_node:
        raise ValueError(f"--nproc-per-node {env['LOCAL_WORLD_SIZE']}: each of the {nodes} nodes runs {per_node} "
                         f"processes ({num_trainers // nodes} trainers + {num_agents // nodes} agents); "
                         f"give --nproc-per-node {per_node}")
    node, local = int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])
    trainers_here = num_trainers // nodes
    if local < trainers_here:
        return TorchrunRole("trainer", node * trainers_here + local)
    return TorchrunRole("agent", node * (num_agents // nodes) + local - trainers_here)


def _loopback_by_name(host: str) -> bool:
    """A host name (not an address, not localhost) that this machine resolves to loopback only: the hosts-file trap
    of a multi-node job (the other nodes resolve the head's name to its network address)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return False
    except ValueError:
        pass
    return host.lower() not in ("localhost", "localhost.localdomain", "ip6-localhost") and is_loopback(host)


def check_master(host: str, nodes: int) -> None:
    """Raises ValueError naming MASTER_ADDR and this machine's address when a job of several `nodes` has a master
    name this machine resolves to loopback: the other nodes would resolve it elsewhere and never reach rank 0."""
    if nodes > 1 and _loopback_by_name(host):
        address = outward_address()
        raise ValueError(f"MASTER_ADDR={host} resolves to loopback here (the hosts file maps this machine's name to "
                         f"127.0.1.1, the Debian/Ubuntu default) but this job spans {nodes} nodes, which resolve it "
                         f"to another address that rank 0 would not listen on; give the head's network address as "
                         f"MASTER_ADDR"
                         + (f" (this machine's: {address})" if address else ""))


def run_torchrun(spec: RunSpec, *, run_log: RunLog | None = None) -> RunSummary | None:
    """Entry point under `torchrun`: rank 0 returns the summary (and logs the metrics to `run_log`), other
    trainer ranks None; an agent's process keeps its agent (`keep_agent`) and ends with it."""
    role = torchrun_role(os.environ, spec.num_trainers, spec.num_agent_processes)
    check_kill_point_env(spec.num_trainers)  # a failover drill's kill points, refused before any rank starts
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    spec = dataclasses.replace(spec, placement=dataclasses.replace(spec.placement, master_addr=host))
    check_master(host, int(os.environ.get("GROUP_WORLD_SIZE", "1")))
    token = read_token(spec.placement.token_file, flag="--placement.token-file")
    if token is None and not is_loopback(host):
        raise ValueError(f"a torchrun job with MASTER_ADDR={host} (not loopback) needs the run's token on every node: "
                         f"export {TOKEN_ENV}=<at least 16 random characters> (the same on each node) or give "
                         "--placement.token-file FILE")
    parent = os.getppid()  # torchrun's agent: if it is killed, so is this rank
    if role.kind == "trainer" and role.index > 0 and spec.trainer.max_recoveries:
        os._exit(keep_trainer(spec, host, port + 1, port + 2, role.index, token=token, parent_pid=parent))
    if role.kind == "trainer":
        if role.index == 0:
            spec = resolve_resume(spec)  # train() settled it already: then the spec comes back as it is
        return run_trainer(role.index, spec, host, port + 1, port + 2, parent_pid=parent,
                           token=token or (new_token() if role.index == 0 else None),
                           run_log=run_log if role.index == 0 else None)
    code = keep_agent(spec, host, port + 1, role.index, token=token, parent_pid=parent)
    os._exit(code)


def _agent_entry(host: str, port: int, device: str, slot: int, parent_pid: int, token: RunToken | None,
                 interface: str) -> NoReturn:
    run_agent_process(host, port, device=device, slot=slot, parent_pid=parent_pid, token=token, interface=interface)


def _trainer_entry(rank: int, spec: RunSpec, host: str, store_port: int, rpc_port: int, parent_pid: int,
                   token: RunToken | None, generation: int) -> None:
    run_trainer(rank, spec, host, store_port, rpc_port, parent_pid=parent_pid, token=token, generation=generation)


def _run_store(spec: RunSpec, host: str, port: int, token: RunToken | None) -> RunStore:
    """A keeper's view of the run's store, signing with the run's token (on loopback the one rank 0 left)."""
    store = RunStore(host, port, serve=False, timeout_s=spec.startup_timeout_s)
    store.info()  # rank 0 has started: on loopback, the token it left is there
    keys = token or store.left_token()
    if keys is not None:
        store.authenticate(keys)
    return store


class _Watch:
    """A keeper's watch over its trainer child of one generation: a newer fault posted, or a stopped heartbeat."""

    def __init__(self, store: RunStore, rank: int, generation: int, timeout_s: float, devices: list[str]):
        self.store, self.rank, self.generation = store, rank, generation
        self.devices = devices  # the trainer group's, the same in every generation (torchrun does not shrink)
        self.silence = Silence(timeout_s)

    def newer_fault(self) -> dict | None:
        fault = self.store.trainer_fault()
        return fault if fault is not None and fault["generation"] > self.generation else None


def keep_trainer(spec: RunSpec, host: str, store_port: int, rpc_port: int, rank: int, *, token: RunToken | None,
                 parent_pid: int | None = None, poll_s: float = 0.2) -> int:
    """Run trainer follower `rank` as a child process, and start it again in the trainer group's next generation
    after a fault (see the module docstring). Returns 0 when the run ended, 1 when its store is gone."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    name_process(f"asyncrl-keep-trainer{rank}")
    stop = StopRequest()
    on_signals(stop.set)
    ctx = multiprocessing.get_context("spawn")
    store: RunStore | None = None
    generation, child, nonce = 0, None, None
    try:
        while True:
            child = ctx.Process(target=_trainer_entry, name=f"asyncrl-trainer{rank}", daemon=False,
                                args=(rank, spec, host, store_port, rpc_port, os.getpid(), token, generation))
            child.start()
            if store is None:
                store = _run_store(spec, host, store_port, token)
                nonce = store.info()["nonce"]  # names this host's restore points (removed at the end)
            fault = _keep(child, _Watch(store, rank, generation, spec.async_.agent_timeout_s,
                                               spec.trainer_devices), stop, poll_s)
            if fault is None:
                return 0
            generation = fault["generation"]
            log.warning("%s: starting trainer rank %d again as generation %d of the trainer group", fault["why"],
                        rank, generation)
    except Exception as err:  # noqa: BLE001 - the store went away with rank 0: so did the run
        if child is not None:
            child.join(10.0)
            if child.exitcode == 0:  # rank 0 ended the run, and its store with it, as this rank ended
                return 0
        log.warning("keeper of trainer rank %d: %s; ending", rank, err)
        return 1
    finally:
        if nonce is not None:
            shutil.rmtree(restore_points_directory(nonce), ignore_errors=True)


def _keep(child, watch: _Watch, stop: StopRequest, poll_s: float) -> dict | None:
    """Until the child's generation ends: the newer fault to start it again for, or None when the run ended (the
    child then ended too)."""
    why = None
    while child.is_alive() and why is None:
        if stop.is_set():  # torchrun is ending this node: the rank goes with it
            child.terminate()
            child.join(10.0)
            return None
        if (fault := watch.newer_fault()) is not None:
            child.kill()
            child.join(5.0)
            return fault
        silent = watch.silence.past_timeout(watch.store.trainer_beats(watch.rank, watch.generation))
        if silent is not None:
            why = watch.silence.why(watch.rank, child.pid, silent)
            child.kill()
        child.join(poll_s)
    child.join(5.0)
    if why is None:
        if child.exitcode == 0 or watch.store.is_shut_down():
            return None
        why = f"trainer rank {watch.rank} exited with code {child.exitcode}"
        if child.exitcode == 1:  # its collective broke with a dead peer's: that peer's keeper names the fault first
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                if (fault := watch.newer_fault()) is not None:
                    return fault
                time.sleep(poll_s)
    if watch.store.claim_trainer_generation(watch.generation):
        watch.store.post_trainer_fault(watch.generation + 1, why, watch.devices)
    while (fault := watch.newer_fault()) is None:
        if watch.store.is_shut_down():
            return None
        time.sleep(poll_s)
    return fault


def keep_agent(spec: RunSpec, host: str, port: int, slot: int, *, token: RunToken | None,
               parent_pid: int | None = None, poll_s: float = 0.2) -> int:
    """Run agent `slot` as a child process and start it again when it dies, while the run's restart budget
    lasts (see the module docstring). Returns 0 when the agent ended with the run (or the budget is spent:
    the run goes on without it), the child's status when the run's store cannot be reached."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    name_process(f"asyncrl-keep{slot}")
    stop = StopRequest()
    on_signals(stop.set)
    device = spec.agent_spec(slot).device
    ctx = multiprocessing.get_context("spawn")
    store: RunStore | None = None
    restarts = 0
    while True:
        child = ctx.Process(target=_agent_entry, name=f"asyncrl-agent{slot}", daemon=False,
                            args=(host, port, device, slot, os.getpid(), token, spec.placement.interface))
        child.start()
        store = store or _run_store(spec, host, port, token)
        seen = store.dead_reports(0).consumed
        while child.is_alive():
            if stop.is_set():  # torchrun is ending this node: the agent goes with it
                child.terminate()
                child.join(10.0)
                return 0
            reports = store.dead_reports(seen)
            seen += reports.consumed
            if any(r.get("pid") == child.pid for r in reports):  # declared dead but still there: hung
                log.warning("agent slot %d (pid %d) was declared dead; ending it", slot, child.pid)
                child.kill()
            child.join(poll_s)
        code = child.exitcode
        try:
            store.report_exit(child.pid, code)  # rank 0 learns of the death now, not at its heartbeat timeout
            if code == 0 or store.is_shut_down():
                return 0
            if not store.take_restart():
                log.error("agent slot %d exited with code %s; the run's restart budget is spent, it stays down",
                          slot, code)
                return 0
        except Exception:  # noqa: BLE001 - the store went away with rank 0: so did the run
            return code if code is not None else 1
        delay = spec.placement.restart_backoff_s * 2 ** restarts
        restarts += 1
        log.warning("agent slot %d exited with code %s; restarting it in %.1f s", slot, code, delay)
        time.sleep(delay)
