"""Rank 0's hold on the rollout agents of a multi-process run: their servers and weight channels (`Fleet`),
and the door through which agent processes enter the run (`Admissions`).

The join protocol (the same for the agents the launcher starts, the ones it restarts, torchrun's agent ranks
and `asyncrl agent --join HOST:PORT`):

1. the agent process reaches the run's store at HOST:PORT, takes a slot (its configured one, or the next free
   one) and an incarnation (restarts count up: `agent1`, `agent1_r1`, ...), joins the RPC group under that
   name, and announces itself in the store (name, slot, device, pid, and an HMAC of its name proving it knows
   the run's token: `asyncrl.rpc.exposure`); an agent without it is refused and told so;
2. rank 0's admissions thread sees the announcement and, in a thread of its own, creates the agent's
   `AgentServer` in that process with `rpc.remote` (the agent builds its engine on its device), connects the
   agent's weight channel (a fresh two-member process group over the store), and enters it in the roster as
   *joining*;
3. at the next weight publication rank 0 sends it the current weights and version with everyone else, marks
   it *live* and starts its generation loop: from then on it asks for prompts and gets its fair share of the
   admissions (each live agent holds at most ceil(budget / live agents) prompts);
4. it leaves cleanly on SIGTERM (it asks in the store; rank 0 stops its loop, re-admits its unfinished prompts
   to the others and ends it) and is evicted from the RPC group when it dies.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import socket
import threading
import time

import torch
import torch.distributed.rpc as rpc

from asyncrl.rpc.agent_server import AgentServer
from asyncrl.rpc.channels import WeightChannel, channel_backend
from asyncrl.rpc.exposure import RunToken
from asyncrl.rpc.membership import RpcMembership
from asyncrl.runtime.roster import Roster
from asyncrl.rpc.spec import RunSpec
from asyncrl.rpc.store import RunStore

__all__ = ["AgentHandle", "Fleet", "Admissions"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class AgentHandle:
    name: str
    server: rpc.RRef
    channel: WeightChannel | None = None
    device: str = ""
    pid: int | None = None


class Fleet:
    """The agents rank 0 can reach, by name. `discard` (the roster's `on_removed`) tears one down: its weight
    channel is aborted, its server's reference is dropped, it is evicted from the RPC group, and, when it died,
    the launcher is told (store) so it can end and restart the process. Dropping the last reference to an RRef
    sends its owner a delete: to a live owner (an agent that left) it frees the server there; to a dead one it is
    retried a few times in the background and given up (tensorpipe logs each failed try), and rank 0's RPC agent
    keeps the member's address, which eviction leaves it, so the send has somewhere to fail. A run that loses
    agents for days so holds no reference to any of them."""

    def __init__(self, store: RunStore | None, membership: RpcMembership | None):
        self.store, self.membership = store, membership
        self.handles: dict[str, AgentHandle] = {}
        self.lock = threading.Lock()

    def add(self, handle: AgentHandle) -> None:
        with self.lock:
            self.handles[handle.name] = handle

    def get(self, name: str) -> AgentHandle | None:
        with self.lock:
            return self.handles.get(name)

    def discard(self, name: str, status: str, why: str) -> None:
        with self.lock:
            handle = self.handles.pop(name, None)
        if handle is None:
            return
        if handle.channel is not None:
            handle.channel.abort()
        if self.store is not None and status == "dead":
            self.store.report_dead(name, handle.pid, why)
        if self.membership is not None:
            threading.Thread(target=self._evict, args=(name,), name=f"evict-{name}", daemon=True).start()

    def _evict(self, name: str) -> None:
        try:
            self.membership.evict(name)
        except Exception as err:  # noqa: BLE001 - a later join then waits for the token; logged
            log.warning("could not evict %s from the RPC group: %r", name, err)


class Admissions:
    """Rank 0's door: polls the store for agent processes that joined the RPC group and admits them."""

    def __init__(self, spec: RunSpec, store: RunStore, fleet: Fleet, roster: Roster, roster_rref: rpc.RRef,
                 trainer_device: str, *, token: RunToken, nonce: str, poll_s: float = 0.2):
        self.spec, self.store, self.fleet, self.roster = spec, store, fleet, roster
        self.token, self.nonce = token, nonce
        self.roster_rref, self.trainer_device, self.poll_s = roster_rref, trainer_device, poll_s
        self.failed: dict[str, str] = {}  # agents whose admission failed, and why (start-up reports them)
        self._joins = self._leaves = self._exits = 0
        self._token_watch: dict[str, float] = {}
        self._unknown_since: dict[str, float] = {}
        self._announced: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="admissions", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - the door stays open
                log.exception("admissions: poll failed")

    def _poll(self) -> None:
        joins = self.store.announcements(self._joins)
        self._joins += joins.consumed
        self._announced.update(str(record.get("name")) for record in joins)
        for record in joins:
            if not self.token.admits(str(record.get("name")), self.nonce, record.get("proof")):
                self.refuse(record)
                continue
            threading.Thread(target=self.admit, args=(record,), name=f"admit-{record['name']}", daemon=True).start()
        leaves = self.store.leave_requests(self._leaves)
        self._leaves += leaves.consumed
        for record in leaves:
            threading.Thread(target=self.release, args=(record["name"], record["reason"]), daemon=True).start()
        exits = self.store.exits(self._exits)
        self._exits += exits.consumed
        for record in exits:
            name = self.roster.name_of(record["pid"])
            if name is not None:
                code = record["code"]
                how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
                self.roster.declare_dead(name, f"its process ended ({how})")
        self.roster.allow_empty = self.store.restarts_left() > 0
        if self.fleet.membership is not None:
            # a process in the RPC group that never announced itself in the store (a join that failed halfway, a
            # stranger refused by the seal) is evicted after the grace, with the membership token it may hold
            known = {f"trainer{r}" for r in range(self.spec.num_trainers)} | self._announced
            grace_s = max(10.0, min(30.0, self.spec.rpc_timeout_s))
            self.fleet.membership.evict_unknown(known, self._unknown_since, grace_s=grace_s)
            alive = set(self.fleet.membership.members())
            self.fleet.membership.release_stuck_token(alive, self._token_watch, grace_s=grace_s)

    def refuse(self, record: dict) -> None:
        """An agent without the run's token: it gets nothing (no server, weights or prompts), leaves the RPC
        group, and is told why (its process exits)."""
        name = str(record.get("name"))
        why = "it did not present the run's token (give the same ASYNCRL_RUN_TOKEN or --token-file as the run)"
        log.error("refused agent %s from host %s (pid %s): %s", name, record.get("host"), record.get("pid"), why)
        self.store.refuse(name, why)
        if self.fleet.membership is not None:
            try:
                self.fleet.membership.evict(name)
            except Exception as err:  # noqa: BLE001 - refused either way
                log.warning("could not evict the refused agent %s from the RPC group: %r", name, err)

    def admit(self, record: dict) -> None:
        """Build the announced agent's server and weight channel; enter it in the roster as joining."""
        name, device = record["name"], record["device"]
        if self.spec.colocate:
            log.error("agent %s asked to join a colocated run, which has no room for agents of its own; ignored",
                      name)
            return
        try:
            server = rpc.remote(name, AgentServer, args=(self.spec, record["slot"], name, device, self.roster_rref),
                                timeout=self.spec.startup_timeout_s)
            info = server.rpc_sync(timeout=self.spec.startup_timeout_s).ready()
            backend = channel_backend(self.trainer_device, info["device"],
                                      same_host=record.get("host") == socket.gethostname())
            connected = server.rpc_async(timeout=self.spec.startup_timeout_s).connect(
                self.store.host, self.store.port, backend)
            trainer_device = torch.device(self.trainer_device)
            channel = WeightChannel(self.store.raw, name, 0, backend=backend, device=trainer_device,
                                    timeout_s=self.spec.async_.agent_timeout_s)
            connected.wait()
        except Exception as err:  # noqa: BLE001 - reported; the run goes on with the others
            why = _root_message(err)
            self.failed[name] = why
            log.error("agent %s could not be admitted: %s", name, why)
            self.store.report_dead(name, record.get("pid"), f"admission failed: {why}")
            return
        self.fleet.add(AgentHandle(name, server, channel, info["device"], info["pid"]))
        self.roster.add(name, device=info["device"], pid=info["pid"])
        log.info("agent %s (pid %s, %s) admitted, weights over %s; it starts with the next weight publication",
                 name, info["pid"], info["device"], channel.backend)

    def release(self, name: str, reason: str) -> None:
        """An agent asked to leave: stop its loop (its unfinished prompts go to the others), end its process."""
        handle = self.fleet.get(name)
        if handle is None:
            return
        try:
            handle.server.rpc_sync(timeout=self.spec.rpc_timeout_s).stop()
        except Exception as err:  # noqa: BLE001 - leaving anyway
            log.warning("agent %s did not stop cleanly: %r", name, err)
        try:
            handle.server.rpc_sync(timeout=self.spec.rpc_timeout_s).exit_process()
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        self.roster.leave(name, reason)

    def wait_for(self, count: int, timeout_s: float, stop=None) -> list[str]:
        """Start-up: wait until `count` agents are admitted (or failed), or a stop request; return the admitted
        ones. Raises when none could join."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            if len(self.roster.joining()) + len(self.roster.live()) + len(self.failed) >= count:
                break
            self.roster.wait_for_change(0.5)
        admitted = self.roster.joining() + self.roster.live()
        if stop is not None and stop.is_set():
            return admitted
        if not admitted:
            detail = "; ".join(f"{n}: {why}" for n, why in self.failed.items()) or \
                f"none announced itself within {timeout_s:.0f} s (startup_timeout_s)"
            raise RuntimeError(f"no rollout agent could start: {detail}")
        if len(admitted) < count:
            log.warning("%d of %d rollout agents joined within %.0f s; starting with %s (the others can join later)",
                        len(admitted), count, timeout_s, ", ".join(admitted))
        return admitted


def _root_message(err: BaseException) -> str:
    """The innermost message of an error that crossed RPC (the remote traceback is folded into the text)."""
    text = str(err).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line.strip()
    return lines[-1] if lines else repr(err)
