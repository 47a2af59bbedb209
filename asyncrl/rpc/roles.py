"""The multi-process run: the body of each process (one per role), started on one machine by `launch`
(`asyncrl.rpc.supervise`) or on one or more nodes by torchrun (`asyncrl.rpc.torchrun`).

    summary = launch(spec)              # asyncrl.rpc.supervise: spawns trainer + agent processes, supervises them
    torchrun ... -m asyncrl.cli train ... --placement.launcher torchrun   # same roles, from RANK
    asyncrl agent --join HOST:PORT --device cuda:3                        # one more agent, into a running job

Trainer ranks `0 .. T−1` form the trainer group (a torch.distributed process group; FSDP2 when T > 1). Rank 0
serves the run's store at `master_addr:join_port` and is the head (`asyncrl.rpc.head`): controller, queue,
roster, parameter server. Rollout agents are processes of their own that join the run through the store and
RPC (`asyncrl.rpc.fleet` describes the protocol); each builds its engine on its device. Control and samples
travel by RPC, weights over each agent's own weight channel (NCCL between GPUs, CUDA IPC on one GPU, gloo on CPU).

RPC uses pickle: every listener of the run binds loopback (127.0.0.1) unless `master_addr` says otherwise, and
an agent is admitted only with the run's token (`asyncrl.rpc.exposure`) — never expose a run to an untrusted
network.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import hmac
import logging
import os
import pathlib
import pickle
import shutil
import socket
import sys
import time
import traceback
from typing import NoReturn

import torch
import torch.distributed as dist

from asyncrl.rpc.assembly import local_device
from asyncrl.runtime.controller import RunSummary
from asyncrl.runtime.kill_points import kill_point
from asyncrl.rpc.exposure import TOKEN_ENV, RunToken, is_loopback, new_nonce, pin_interface, read_token
from asyncrl.rpc.head import run_head
from asyncrl.runtime.lifecycle import RunFailed, StopRequest, die_with_parent, name_process, on_signals
from asyncrl.runtime.run_log import RunLog
from asyncrl.rpc.commands import FollowerHost
from asyncrl.rpc.failover import (
    Heartbeat, RestorePoints, enter_generation, restore_points_directory, trainer_backend,
)
from asyncrl.rpc.membership import join_rpc, leave_rpc
from asyncrl.rpc.reform import join_trainer_group
from asyncrl.rpc.restart import Restart
from asyncrl.rpc.seal import key_check, rpc_key
from asyncrl.rpc.spec import RunSpec
from asyncrl.rpc.store import RunStore, agent_name

__all__ = ["run_trainer", "run_agent", "run_agent_process", "free_port", "reserve_port"]

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_port(host: str = "") -> socket.socket:
    """A port for a server that a child process will start (on every address by default), held until the
    returned socket is closed.

    The socket is bound with SO_REUSEADDR and never listens: the server (torch's TCPStore, which sets
    SO_REUSEADDR too) can still bind the port, while no other process on the host is handed it meanwhile. A
    port picked with `free_port` is free only at the moment of the pick: two runs started together on one host
    were both given the same one, and one failed with EADDRINUSE while its clients broke the other's store."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


def _setup_logging(role: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s",
                        force=True)
    faulthandler.enable()  # a crash in native code (a segfault) still leaves every thread's Python stack
    dump_every = os.environ.get("ASYNCRL_STACK_DUMP_S")
    if dump_every:  # diagnosing a hang: every process prints every thread's stack to stderr periodically
        faulthandler.dump_traceback_later(float(dump_every), repeat=True)


# -------------------------------------------------------------------------------------- trainer ranks
def run_trainer(rank: int, spec: RunSpec, host: str, store_port: int, rpc_port: int, results=None, *,
                parent_pid: int | None = None, token: RunToken | None = None, run_log: RunLog | None = None,
                generation: int = 0, restore_points: str | None = None,
                restart: Restart | None = None) -> RunSummary | None:
    """The body of trainer rank `rank`: the trainer group, then rank 0 joins RPC and runs the head; a follower
    builds its `FollowerHost` and follows rank 0's commands over the trainer group until "stop", outside RPC (a
    colocated follower joins RPC instead and rank 0 creates its role object there: rank 0's roster drives the
    engine it hosts). Returns the summary on rank 0 (also put on `results` when given). `token`: the run's (rank 0
    needs it: agents must prove it). `run_log`: where rank 0 logs the metrics; closed when the rank ends.
    `restore_points`: the run's directory of restore points (failover on: `asyncrl.rpc.failover`), else None;
    `generation`: the trainer group's generation a follower joins (> 0: started again after a fault); `restart`
    (rank 0): the run goes on from a version boundary's restore points after the previous rank 0 died
    (`asyncrl.rpc.restart`; every rank is then of the restart's generation)."""
    role = f"trainer{rank}"
    stop = _enter_trainer_process(role, rank, spec, host, parent_pid, generation)
    started = _start_trainer(role, rank, spec, host, store_port, rpc_port, results, token=token,
                             generation=generation, restore_points=restore_points)
    summary = None
    try:
        if rank == 0:
            summary = run_head(spec, started.store, stop, started.token, started.nonce, run_log=run_log,
                               restore_points=started.restore_points, restart=restart)
            _report(results, summary)
        elif spec.colocate:  # its role object is rank 0's to create, over RPC
            _wait_for_end(started.store, poll_s=0.5, beat=rank)
        else:
            _follow(spec, rank, started.store, generation, started.restore_points)
    except RunFailed as err:  # its message says it all: the launcher prints it once
        _report(results, err)
    except BaseException as err:
        log.exception("%s failed", role)  # the exit below would swallow the traceback
        _report(results, RuntimeError(f"{role} failed: {err}"))
        raise
    finally:
        _end_trainer(started, rank, run_log, parent_pid)
    return summary


@dataclasses.dataclass(frozen=True)
class _StartedTrainer:
    """A trainer rank that joined its group (and rank 0's run, RPC): what its role runs with, and what its end
    gives back."""

    store: RunStore
    nonce: str
    token: RunToken
    restore_points: str | None
    heartbeat: Heartbeat | None  # a non-colocated follower's, from before it joined
    left: pathlib.Path | None  # rank 0 of a loopback run: the token file it left for this host's user
    made: bool  # rank 0 of a torchrun job made its host's restore points directory (removed at the end)


def _enter_trainer_process(role: str, rank: int, spec: RunSpec, host: str, parent_pid: int | None,
                           generation: int) -> StopRequest:
    """This process becomes trainer rank `rank`: its logging, interface, threads, generation and signals. Rank 0
    stops the run on a signal; a follower notes it and keeps following (rank 0's checkpoint needs every rank)."""
    _setup_logging(role)
    pin_interface(host, spec.placement.interface)
    if parent_pid is not None:
        die_with_parent(parent_pid)
        name_process(f"asyncrl-{role}")
    torch.set_num_threads(spec.placement.threads_per_process)
    if generation:
        enter_generation(generation)
    stop = StopRequest()
    if rank == 0:
        on_signals(stop.set)
    else:
        on_signals(lambda name: log.info("%s: %s received; rank 0 is stopping the run", role, name))
    return stop


def _start_trainer(role: str, rank: int, spec: RunSpec, host: str, store_port: int, rpc_port: int, results, *,
                   token: RunToken | None, generation: int, restore_points: str | None) -> _StartedTrainer:
    """Join the run's store and the trainer group of `generation`; rank 0 opens the run, a follower reads its
    keys; rank 0 (and a colocated follower) joins RPC. A failure is reported on `results` and raised."""
    left = None
    try:
        store = RunStore(host, store_port, serve=rank == 0, timeout_s=spec.startup_timeout_s)
        heartbeat = None if rank == 0 or spec.colocate else Heartbeat(
            host, store_port, rank, generation, timeout_s=spec.startup_timeout_s)
        _join_trainer_group(spec, store, rank, generation)
        if rank == 0:
            if token is None:
                raise ValueError("trainer rank 0 needs the run token (the launcher passes it)")
            nonce, left = _open_run(store, spec, host, rpc_port, token)
        else:
            nonce, token = _follower_keys(store, token, role)
        made = False
        if restore_points is None and spec.trainer.max_recoveries and spec.placement.launcher == "torchrun":
            restore_points = str(restore_points_directory(nonce))  # each host's, by the run's nonce (`keep_trainer`)
            made = rank == 0
        if rank == 0 or spec.colocate:  # a follower joins RPC only to host its colocated engine
            join_rpc(role, rank, host, rpc_port, timeout_s=spec.rpc_timeout_s, key=rpc_key(token.value, nonce))
        if rank == 0 and spec.colocate:  # the followers' role objects are created by rank 0: wait until they joined
            store.raw.wait([f"asyncrl/joined/trainer{r}" for r in range(1, spec.num_trainers)],
                           datetime.timedelta(seconds=spec.startup_timeout_s))
        elif rank != 0 and spec.colocate:
            store.raw.set(f"asyncrl/joined/{role}", "1")
    except BaseException as err:
        if left is not None:
            left.unlink(missing_ok=True)
        _report(results, RuntimeError(f"{role} could not start: {err}"))
        raise
    return _StartedTrainer(store, nonce, token, restore_points, heartbeat, left, made)


def _end_trainer(started: _StartedTrainer, rank: int, run_log: RunLog | None, parent_pid: int | None) -> None:
    """Leave RPC, stop the heartbeat, take back the token file and this host's restore points, close the metrics
    log; a follower started by a launcher exits here."""
    leave_rpc()
    if started.heartbeat is not None:
        started.heartbeat.stop()
    if started.left is not None:
        started.left.unlink(missing_ok=True)
    if run_log is not None:
        run_log.close()
    if started.made:
        shutil.rmtree(started.restore_points, ignore_errors=True)
    if rank != 0 and parent_pid is not None:
        os._exit(0)


def _join_trainer_group(spec: RunSpec, store: RunStore, rank: int, generation: int) -> None:
    """On this rank's device, join the trainer group of `generation` (`asyncrl.rpc.reform`)."""
    device = local_device(spec.trainer_devices[rank])
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if generation:
        kill_point("join", rank, 0)
    join_trainer_group(store.raw, generation=generation, rank=rank, world_size=spec.num_trainers,
                       backend=trainer_backend(spec), timeout=datetime.timedelta(seconds=spec.async_.sync_timeout_s),
                       startup_timeout_s=spec.startup_timeout_s)


def _follower_keys(store: RunStore, token: RunToken | None, role: str) -> tuple[str, RunToken]:
    """A follower's nonce (rank 0's) and token: the launcher's, else (a loopback torchrun job) the one rank 0 left;
    the store then signs with it."""
    nonce, token = store.info()["nonce"], token or store.left_token()
    if token is None:
        raise ValueError(f"{role} needs the run's token (its store's records are signed with it)")
    store.authenticate(token)
    return nonce, token


def _follow(spec: RunSpec, rank: int, store: RunStore, generation: int, restore_points: str | None) -> None:
    """A follower of its own: rank 0's commands over the trainer group, no RPC, until the commands end or the run
    does (its heartbeat, `Heartbeat`, beats meanwhile)."""
    points = RestorePoints(restore_points, rank, spec.num_trainers) if restore_points else None
    building = time.monotonic()
    follower = FollowerHost(spec, rank, None, points, initial_weights=not generation)  # later: a restore fills it
    if generation:
        log.warning("trainer%d: learner built in %.1f s for trainer group generation %d", rank,
                    time.monotonic() - building, generation)
    while not follower.done.wait(0.5):
        if store.is_shut_down():
            return


def _open_run(store: RunStore, spec: RunSpec, host: str, rpc_port: int, token: RunToken
              ) -> tuple[str, pathlib.Path | None]:
    """Rank 0: make the run joinable. First what joining agents must find when they read the run's info: the token
    file (a loopback run), the configured agents' slots (a joiner that read the info first would take slot 0, and
    the run's own agent0 a second incarnation), the restart budget; then the info (the RPC port, the nonce, the
    key check). Returns the nonce and the token file left (None off loopback)."""
    nonce = new_nonce()
    left = store.leave_token(token) if is_loopback(host) else None
    store.reserve_slots(len(spec.agents))
    store.set_restarts_left(spec.placement.restart_agents)
    store.authenticate(token)
    store.set_info({"rpc_port": rpc_port, "rpc_timeout_s": spec.rpc_timeout_s, "nonce": nonce,
                    "key_check": key_check(rpc_key(token.value, nonce))})
    print(f"[asyncrl] more rollout agents can join this run: {_join_line(host, store.port)}", flush=True)
    return nonce, left


def _join_line(host: str, port: int) -> str:
    """How to start one more agent: on loopback the token waits for this user in a file; elsewhere the agent needs
    it, and the token is never printed."""
    command = f"asyncrl agent --join {host}:{port} --device DEVICE"
    if is_loopback(host):
        return command
    return f"{command} (with the run's token in ${TOKEN_ENV} or --token-file FILE)"


def _report(results, outcome) -> None:
    if results is not None:
        results.put(pickle.dumps(outcome))


def _wait_for_end(store: RunStore, poll_s: float, beat: int | None = None) -> None:
    """Until rank 0 marks the end of the run (or its store goes away with it); `beat`: this trainer rank's heartbeat
    goes out every poll meanwhile."""
    while True:
        try:
            if store.is_shut_down():
                return
            if beat is not None:
                store.trainer_beat(beat)
        except Exception:  # noqa: BLE001 - rank 0 is gone: so is the run
            return
        time.sleep(poll_s)


# --------------------------------------------------------------------------------------------- agents
def run_agent(host: str, port: int, *, device: str, slot: int | None = None, parent_pid: int | None = None,
              leave_grace_s: float = 60.0, connect_timeout_s: float = 600.0, token: RunToken | None = None,
              token_file: str | None = None, interface: str = "auto") -> int:
    """The body of a rollout agent process: reach the run's store, join the RPC group, announce itself with
    proof of the run's token, and wait; rank 0 creates its `AgentServer` (engine, loop) and ends the process at
    the end of the run, or when it leaves (first SIGTERM / SIGINT: it asks rank 0 to let it go; a second one
    exits at once). Returns the exit status.

    The token: `token`, else `token_file` or $ASYNCRL_RUN_TOKEN, else (a loopback run) the one rank 0 left in
    the store."""
    managed = parent_pid is not None
    if managed:
        die_with_parent(parent_pid)
    pin_interface(host, interface)
    stop = StopRequest()
    on_signals(stop.set)
    token = token or read_token(token_file, flag="--token-file")
    store = RunStore(host, port, serve=False, timeout_s=connect_timeout_s)
    info = store.info()
    token = token or store.left_token()
    if token is None:
        log.error("the run at %s:%d is not on loopback: give its token (%s=... or --token-file FILE, the one the "
                  "run was given)", host, port, TOKEN_ENV)
        return 2
    store.authenticate(token)
    key = rpc_key(token.value, info.get("nonce", ""))
    if not hmac.compare_digest(info.get("key_check", ""), key_check(key)):
        log.error("the run refused this agent: it did not present the run's token (its RPC messages would not be "
                  "sealed with the run's key); give the token the run printed or was given (%s=... or --token-file "
                  "FILE)", TOKEN_ENV)
        return 2
    slot = store.new_slot() if slot is None else slot
    rank = store.next_rpc_rank()  # one rank for every attempt: torch keeps the first one this process initialised
    for attempt in range(1, 4):  # a member that just died may still be listed until rank 0 evicts it
        name = agent_name(slot, store.next_incarnation(slot))  # a fresh name: a failed join may have left its own
        _setup_logging(name)
        try:
            join_rpc(name, rank, host, info["rpc_port"], timeout_s=info["rpc_timeout_s"], key=key)
            break
        except RuntimeError as err:
            if attempt == 3:
                raise
            log.warning("%s: joining failed (%s); trying again in 5 s", name, err)
            time.sleep(5.0)
    name_process(f"asyncrl-{name}")
    store.announce({"name": name, "slot": slot, "device": device, "pid": os.getpid(), "host": socket.gethostname(),
                    "proof": token.proof(name, info.get("nonce", ""))})
    log.info("%s joined the run at %s:%d on %s; waiting to be admitted", name, host, port, device)
    asked_at = None
    try:
        while True:
            try:
                if store.is_shut_down():
                    return 0
                refused = store.refusal(name)
            except Exception:  # noqa: BLE001 - the run's head is gone
                log.error("%s: the run's store at %s:%d is gone; exiting", name, host, port)
                return 1
            if refused is not None:
                log.error("%s: the run refused this agent: %s", name, refused)
                return 2
            if stop.is_set() and asked_at is None:
                asked_at = time.monotonic()
                if not managed:  # a launcher-managed agent is stopped by rank 0 with the whole run
                    log.info("%s: %s received; asking rank 0 to let it leave", name, stop.reason)
                    store.request_leave(name, f"{stop.reason} received")
            if asked_at is not None and time.monotonic() - asked_at > leave_grace_s:
                log.error("%s: not released within %.0f s; exiting", name, leave_grace_s)
                return 1
            time.sleep(0.2)
    finally:
        leave_rpc()


def run_agent_process(host: str, port: int, **kwargs) -> NoReturn:
    """`run_agent`, then end the process at once with its status. An agent must not end through the
    interpreter's teardown: its weight channel (a gloo group held by the `AgentServer` that RPC owns) still has
    live threads then, and destroying it there aborts the process ("terminate called without an active
    exception", exit -6) after a run that went well."""
    try:
        code = run_agent(host, port, **kwargs)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed here: os._exit below skips the interpreter's report
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
