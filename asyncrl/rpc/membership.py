"""Membership of the run's RPC group, which processes can join and leave while it runs.

torch.distributed.rpc has a dynamic mode (`init_rpc(world_size=None)`): a process joins by taking a token in
the group's store, contacting every member, then releasing the token. Two things make it unfit for faults on
its own: a member that died (kill -9) or hangs (SIGSTOP) stays listed, so every later join tries to reach it
and fails; and a join that fails keeps the token, blocking every later join. Rank 0 therefore manages the
group: `evict(name)` removes a member it declared dead or that left from the group's list, which a joining
process reads to know whom to contact, and releases a token the member held; agents never leave through torch's
graceful shutdown but ask rank 0 to evict them, then shut their RPC agent down locally. Rank 0's own RPC agent is
not told (see `RpcMembership.evict`).

These are the only calls into torch's RPC internals (the group's worker list key and its membership token);
they are checked by the fault tests on the installed torch.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rpc import api as rpc_api

from asyncrl.rpc.seal import seal_rpc
from asyncrl.rpc.store import serve_store

__all__ = ["join_rpc", "leave_rpc", "raise_open_files", "RpcMembership"]

log = logging.getLogger(__name__)

_WORKERS_KEY = "names/_ALL_WORKER_INFOS"  # "name-id,name-id," in the group's store (TensorPipe agent)
_TOKEN_KEY = "RpcGroupManagementToken"
TRANSPORTS = ["uv"]
"""TensorPipe's transports for the run's RPC messages: TCP through libuv's event loop, which sleeps until a message
comes. TensorPipe's default adds its shared-memory transport between processes of one host, whose reactor thread
busy-polls its ring buffer: each process of a run burnt ~0.6 of a core doing nothing (mostly in the kernel), on
a 2-core machine more than the training itself. The RPC messages are control calls and samples (weights go over
gloo or NCCL), for which loopback TCP's tens of microseconds are no cost."""
CHANNELS = ["basic"]
"""TensorPipe's channels for tensors inside RPC messages: the basic one, over the transport above. Its default adds
the multiplexed uv channel, 16 more listening sockets per process, for tensors a run never sends over RPC (weights
go over gloo or NCCL)."""


def raise_open_files() -> int:
    """Raise this process's soft limit of open files to its hard limit (TensorPipe keeps a connection to every
    member it talks to, and each gloo pair is a socket: a group of dozens of processes passes the common 1,024
    default). Returns the new soft limit."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def join_rpc(name: str, rank: int, host: str, port: int, *, timeout_s: float, key: bytes, threads: int = 16) -> None:
    """Join the run's RPC group as `name` (rank 0 first: it serves the group's store), every message sealed with
    the run's `key` (`asyncrl.rpc.seal`; unsealed ones refused). A join that fails releases the membership token
    it may hold, so the next one can proceed."""
    seal_rpc(key)
    raise_open_files()
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{host}:{port}", rpc_timeout=timeout_s,
                                              num_worker_threads=threads, _transports=TRANSPORTS,
                                              _channels=CHANNELS)
    # under torchrun the tcp:// rendezvous would make every rank a client of torchrun's own store (which does
    # not listen on this port): the group's store is served by rank 0 here
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    # rank 0 serves the group's store on the master address only; init_rpc's own (multi-tenant) store of the
    # same port shares that server instead of listening on every interface
    served = serve_store(host, port, timeout_s, multi_tenant=True) if rank == 0 else None
    try:
        rpc.init_rpc(name, rank=rank, world_size=None, rpc_backend_options=options)
    except Exception as err:
        if rank != 0:
            _release_own_token(name, host, port)
        raise RuntimeError(f"{name} could not join the run's RPC group at {host}:{port}: {err}") from err
    finally:
        if agent_store is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
        del served  # the RPC agent's store holds the server from here on


def _release_own_token(name: str, host: str, port: int) -> None:
    """torch keeps the group's membership token when a join fails halfway; give it back."""
    try:
        store = dist.PrefixStore("rpc_prefix_0", dist.TCPStore(host, port, is_master=False,
                                                               timeout=datetime.timedelta(seconds=10)))
        token = f"Token_for_{name}_join"
        if store.compare_set(_TOKEN_KEY, token, "").decode() == "":
            store.set(token, "Done")
    except Exception as err:  # noqa: BLE001 - rank 0 releases a stuck token after a grace period anyway
        log.warning("%s could not release the RPC membership token: %r", name, err)


def leave_rpc() -> None:
    """Stop this process's RPC agent without the group-wide handshake (rank 0 evicts us, or the run is over)."""
    try:
        rpc.shutdown(graceful=False)
    except Exception as err:  # noqa: BLE001 - leaving anyway
        log.info("rpc shutdown: %r", err)


class RpcMembership:
    """Rank 0's hand on the group's member list."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    @property
    def _agent(self):
        return rpc_api._get_current_rpc_agent()

    def members(self) -> list[str]:
        """The group's members as its store lists them (what a joining process contacts; evicted ones are gone)."""
        return [entry.rsplit("-", 1)[0] for entry in self._listed()]

    def _listed(self) -> list[str]:
        store = self._agent.store
        raw = store.get(_WORKERS_KEY).decode() if store.check([_WORKERS_KEY]) else ""
        return [entry for entry in raw.split(",") if entry]

    def evict(self, name: str) -> None:
        """Remove `name` from the group: its entry in the group's list (so a later join does not try to reach
        it) and a membership token it held. Rank 0's own RPC agent keeps knowing the name (unused from here on:
        a restarted agent joins under a new name and rank): torch 2.13's leave update of an agent's view erases its
        maps without the lock its sends and lookups take, and a concurrent RPC then crashed the trainer (SIGSEGV)."""
        store = self._agent.store
        for _ in range(100):
            current = store.get(_WORKERS_KEY) if store.check([_WORKERS_KEY]) else b""
            kept = b"".join(e + b"," for e in current.split(b",") if e and e.decode().rsplit("-", 1)[0] != name)
            if kept == current or store.compare_set(_WORKERS_KEY, current, kept) == kept:
                break
        self._release_token_of(name)

    def _release_token_of(self, name: str) -> None:
        store = self._agent.store
        held = store.get(_TOKEN_KEY).decode() if store.check([_TOKEN_KEY]) else ""
        if held in (f"Token_for_{name}_join", f"Token_for_{name}_leave"):
            if store.compare_set(_TOKEN_KEY, held, "").decode() == "":
                store.set(held, "Done")
                log.warning("released the RPC membership token %s (its holder is gone)", held)

    def evict_unknown(self, known: set[str], listed_since: dict[str, float], grace_s: float) -> list[str]:
        """Evict every listed member not in `known` that has been listed longer than `grace_s` (a process whose join
        failed halfway stays listed, and every later join would try to reach it). Returns the names evicted."""
        now, evicted = time.monotonic(), []
        listed = set(self.members())
        for name in listed - known:
            if now - listed_since.setdefault(name, now) > grace_s:
                log.warning("evicting %s from the RPC group: it joined but never announced itself to the run", name)
                self.evict(name)
                evicted.append(name)
                listed_since.pop(name, None)
        for name in set(listed_since) - listed:
            listed_since.pop(name, None)
        return evicted

    def release_stuck_token(self, alive: set[str], held_since: dict[str, float], grace_s: float) -> None:
        """A join that died halfway keeps the token forever: release a token held longer than `grace_s` by a
        process that is not a member."""
        store = self._agent.store
        held = store.get(_TOKEN_KEY).decode() if store.check([_TOKEN_KEY]) else ""
        if not held:
            held_since.clear()
            return
        holder = held.removeprefix("Token_for_").rsplit("_", 1)[0]
        first = held_since.setdefault(held, time.monotonic())
        if holder not in alive and time.monotonic() - first > grace_s:
            self._release_token_of(holder)
            held_since.pop(held, None)
