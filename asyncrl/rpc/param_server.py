"""The parameter server side of a weight publication: gather the trainer's full weights once, bring every
agent to a swappable state, hand them the weights, resume them.

Three transports behind one `publish(state, version) -> metrics`:
* `LocalPublisher` — agents in this process (threads, the in-process launcher): weights are copied tensor by
  tensor into each engine (`copy_`, across devices if needed);
* `CollectivePublisher` — agents in other processes: the weights go in flat buckets over each agent's own
  weight channel (NCCL between GPUs, CUDA IPC on one GPU, gloo on CPU), the agent side driven by RPC;
* `ColocatedPublisher` — every trainer rank hosts an engine: each rank gathers the full weights (FSDP2) and
  copies them into its own engine.

A publication goes to the roster's live agents and to the ones joining (their first weights, after which
they go live), each on its own thread (`SyncRunner`): a slow or hung agent never holds the others back, and
the trainer does not wait for a live agent that has gone silent for five heartbeats: its sync goes on in the
background, and the roster declares it dead when its silence reaches `agent_timeout_s`. An agent whose sync
fails is declared dead (fenced, its prompts re-admitted).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch
import torch.distributed.rpc as rpc

from asyncrl.learner import LearnerState, published_weights
from asyncrl.rpc.channels import buffers_on_gpu, flatten, layout_of, make_buckets
from asyncrl.rpc.fleet import Fleet
from asyncrl.runtime.roster import Roster

__all__ = ["LocalPublisher", "CollectivePublisher", "ColocatedPublisher", "SyncResult", "SyncRunner",
           "source_flats"]

log = logging.getLogger(__name__)


class SyncResult:
    """The outcome of one agent's sync to one version, filled by its thread."""

    def __init__(self, name: str, version: int):
        self.name, self.version = name, version
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class SyncRunner:
    """Runs each agent's sync on a thread of its own and waits for them, but not for a late one: a live agent
    silent for longer than `late_after_s` (it heartbeats every second) is left to finish its sync in the
    background — the trainer goes on, the agent gets no further publication until that sync ends, and the
    roster declares it dead if its silence reaches agent_timeout_s. A hung agent thus stalls the trainer for
    `late_after_s`, not for its whole timeout.

    An agent that keeps its weights until an evaluation of them ends is not waited for either: its sync runs
    once the evaluation ends. It takes no training prompt meanwhile (`Roster.request`), so the next publication
    waits for that sync first (`wait_deferred`): published past it, the agent would hold a superseded version
    with nothing to train that could bring the next one."""

    def __init__(self, roster: Roster, *, late_after_s: float, poll_s: float = 0.02):
        self.roster, self.late_after_s, self.poll_s = roster, late_after_s, poll_s
        self.unfinished: dict[str, SyncResult] = {}  # syncs the trainer stopped waiting for
        self.deferred: set[str] = set()  # of those, the ones waiting for an evaluation to end

    def busy(self) -> set[str]:
        """Agents whose previous sync is still running: not a target until it ends."""
        return {name for name, r in self.unfinished.items() if not r.done.is_set()}

    def wait_deferred(self) -> None:
        """Wait for the syncs an evaluation deferred to end, each while its agent is live (the roster names a
        hung one dead after its timeout)."""
        for name in sorted(self.deferred):
            result = self.unfinished.get(name)
            while result is not None and not result.done.is_set() and self.roster.status(name) == "live":
                result.done.wait(self.poll_s)

    def run(self, work: dict[str, Callable[[], float]], version: int) -> tuple[list[SyncResult], int]:
        """Start the syncs; return the results to settle (these, and earlier late ones that ended since) and how
        many agents were left behind as late."""
        results = {name: SyncResult(name, version) for name in work}
        ended = threading.Event()  # a sync ended: look at once rather than at the next poll

        def run(result: SyncResult, fn: Callable[[], float]) -> None:
            try:
                while self.roster.evaluating(result.name):  # it keeps its weights until that evaluation ends
                    time.sleep(self.poll_s)
                result.seconds = fn()
                self.roster.synced(result.name, result.version)  # now: admission goes by the version it holds
            except BaseException as err:  # noqa: BLE001 - reported by the caller
                result.error = err
            finally:
                result.done.set()
                ended.set()

        for name, fn in work.items():
            threading.Thread(target=run, args=(results[name], fn), name=f"sync-{name}", daemon=True).start()
        pending, late = set(work), 0
        while pending:
            ended.clear()  # before looking: a sync that ends after this wakes the wait below
            for name in list(pending):
                status = self.roster.status(name)
                if results[name].done.is_set() or status in ("dead", "left", None):
                    pending.discard(name)  # ended, or declared dead meanwhile (the fleet aborts its channel)
                elif status == "live" and self.roster.silent_for(name) > self.late_after_s:
                    log.warning("agent %s is late (silent for %.1f s): not waiting for its weight sync", name,
                                self.roster.silent_for(name))
                    self.unfinished[name] = results.pop(name)
                    pending.discard(name)
                    late += 1
                elif status == "live" and self.roster.evaluating(name):  # it finishes them at its version first
                    log.info("agent %s finishes its evaluation prompts before it takes version %d", name, version)
                    self.unfinished[name] = results.pop(name)
                    self.deferred.add(name)
                    pending.discard(name)
            if pending:
                ended.wait(self.poll_s)
        settled = [r for r in self.unfinished.values() if r.done.is_set()]
        for r in settled:
            del self.unfinished[r.name]
            self.deferred.discard(r.name)
        return [r for r in results.values() if r.done.is_set()] + settled, late


def late_after(agent_timeout_s: float) -> float:
    """How long a publication waits for a silent live agent: five heartbeats, at most its timeout."""
    return min(agent_timeout_s, 5.0)


def _settle(roster: Roster, results: list[SyncResult], activate: Callable[[str], None]) -> dict:
    """Declare dead the agents whose sync failed; record which version each holds; bring the joiners that got
    their weights live."""
    failed = 0
    for r in results:
        if r.error is not None and roster.status(r.name) in ("dead", "left"):
            continue  # its channel broke because it was declared dead: nothing more to say
        if r.error is not None:
            failed += 1
            log.error("weight sync to %s failed: %r", r.name, r.error)
            roster.declare_dead(r.name, f"its weight sync failed: {r.error!r}")
            continue
        roster.synced(r.name, r.version)
        if roster.status(r.name) == "joining" and roster.activate(r.name):
            activate(r.name)
    synced = [r.seconds for r in results if r.seconds is not None]
    return {"fully_async/sync_failures": failed, "timing_s/param_transfer": max(synced, default=0.0)}


class LocalPublisher:
    """Publishes to `RolloutAgent`s living in this process."""

    def __init__(self, agents: list, roster: Roster, *, partial_rollout: bool, timeout: float,
                 dtype: torch.dtype | None = None):
        self.agents = {a.name: a for a in agents}
        self.roster, self.partial, self.timeout, self.dtype = roster, partial_rollout, timeout, dtype
        self.syncs = SyncRunner(roster, late_after_s=late_after(roster.agent_timeout_s))

    def publish(self, state: LearnerState, version: int) -> dict:
        start = time.perf_counter()
        weights = list(published_weights(state.policy, dtype=self.dtype))
        sent = _bytes(weights)
        gathered = time.perf_counter()
        self.syncs.wait_deferred()
        busy = self.syncs.busy()
        targets = {n: self.agents[n] for n in self.roster.live() + self.roster.joining()
                   if n in self.agents and n not in busy}
        for agent in targets.values():  # all drain or freeze at once
            agent.begin_sync(self.partial)

        def sync(agent) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                agent.pause_for_sync(self.partial, self.timeout)
                agent.load_weights(weights, version)
                agent.resume()
                return time.perf_counter() - t0
            return run

        results, late = self.syncs.run({n: sync(a) for n, a in targets.items()}, version)
        metrics = _settle(self.roster, results, lambda name: self.agents[name].start())
        done = time.perf_counter()
        return {**metrics, "fully_async/sync_late": late, "timing_s/param_sync": done - start,
                "timing_s/param_gather": gathered - start, "param_sync/bytes": sent}


class CollectivePublisher:
    """Rank 0's side of a publication to agents in other processes."""

    def __init__(self, fleet: Fleet, roster: Roster, *, partial_rollout: bool, timeout: float, bucket_mb: int,
                 dtype: torch.dtype, weights_fn: Callable):
        self.fleet, self.roster = fleet, roster
        self.partial, self.timeout, self.bucket_bytes = partial_rollout, timeout, bucket_mb * 2**20
        self.dtype, self.weights_fn = dtype, weights_fn
        self.syncs = SyncRunner(roster, late_after_s=late_after(roster.agent_timeout_s))

    def publish(self, state: LearnerState, version: int) -> dict:
        start = time.perf_counter()
        self.syncs.wait_deferred()
        busy = self.syncs.busy()
        targets = [h for h in map(self.fleet.get, self.roster.live() + self.roster.joining())
                   if h is not None and h.name not in busy]
        weights = self.weights_fn(state, self.dtype)  # every trainer rank takes part in the gather
        sent = _bytes(weights)
        if not targets:
            return {"timing_s/param_sync": time.perf_counter() - start, "fully_async/sync_failures": 0,
                    "param_sync/bytes": 0}
        buckets = make_buckets(weights, self.bucket_bytes)
        layout = layout_of(buckets)
        gpu = weights[0][1].device if weights[0][1].is_cuda else None
        flats = source_flats(buckets, {h.channel.backend for h in targets}, gpu)
        del weights, buckets
        gathered = time.perf_counter()

        drains: dict[str, float] = {}  # how long each agent took to reach a swappable state

        def sync(handle) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                handle.server.rpc_async(timeout=self.timeout).prepare(self.partial, self.timeout).wait()
                drains[handle.name] = time.perf_counter() - t0
                on_cuda = buffers_on_gpu(handle.channel.backend)
                received = handle.server.rpc_async(timeout=self.timeout).receive(version, layout, on_cuda)
                for flat in flats[handle.channel.backend]:
                    handle.channel.broadcast(flat)
                return received.wait()
            return run

        results, late = self.syncs.run({h.name: sync(h) for h in targets}, version)
        metrics = _settle(self.roster, results, self._start)
        done = time.perf_counter()
        return {**metrics, "fully_async/sync_late": late, "timing_s/param_sync": done - start,
                "timing_s/param_gather": gathered - start,
                "timing_s/param_drain": max(list(drains.values()), default=0.0), "param_sync/bytes": sent}

    def _start(self, name: str) -> None:
        """Tell a joiner that got its weights to start generating, without waiting for its answer: its host may have
        dropped off the network just after the sync, and the training loop must not stall for the RPC timeout
        (`--async-training.sync-timeout-s`) on it; the roster's heartbeats name it dead if it never answers."""
        handle = self.fleet.get(name)
        if handle is None:
            return

        def answered(future: torch.futures.Future) -> None:
            try:
                future.value()
                log.info("agent %s is live", name)
            except Exception as err:  # noqa: BLE001 - the heartbeats decide; this only says why it did not start
                log.warning("agent %s did not start: %r", name, err)

        handle.server.rpc_async(timeout=self.timeout).start().add_done_callback(answered)


class ColocatedPublisher:
    """Rank 0's side of a publication when every trainer rank hosts its own agent: pause them all over RPC,
    then every rank gathers the full weights and copies them into its own engine (`load_fn`)."""

    def __init__(self, servers: dict[str, rpc.RRef], roster: Roster, *, partial_rollout: bool, timeout: float,
                 load_fn: Callable):
        self.servers, self.roster = servers, roster
        self.partial, self.timeout, self.load_fn = partial_rollout, timeout, load_fn

    def publish(self, state: LearnerState, version: int) -> dict:
        start = time.perf_counter()
        prepares = [rref.rpc_async(timeout=self.timeout).prepare(self.partial, self.timeout)
                    for name, rref in self.servers.items() if self.roster.is_live(name)]
        for future in prepares:
            future.wait()  # a colocated agent is its trainer rank: if it cannot drain, the run cannot go on
        paused = time.perf_counter()
        sent = self.load_fn(state, version)
        for name in self.servers:
            self.roster.synced(name, version)
        done = time.perf_counter()
        return {"timing_s/param_sync": done - start, "timing_s/param_drain": paused - start,
                "timing_s/param_transfer": done - paused, "fully_async/sync_failures": 0, "param_sync/bytes": sent}


def source_flats(buckets: list, backends: set[str], gpu: torch.device | None) -> dict[str, list[torch.Tensor]]:
    """The flat buckets each channel backend sends from: NCCL from the trainer's GPU; CUDA IPC from there too
    (it stages them bucket by bucket), or from host memory when that GPU has no room for a copy of the weights
    (a trainer sharing its GPU with an agent); gloo from host memory. Flat copies, not views of the weights: a
    late agent's sync goes on while the trainer updates them."""
    host = torch.device("cpu")
    on_gpu = None
    if backends & {"nccl", "cuda_ipc"} and gpu is not None:
        try:
            on_gpu = [flatten(b, gpu) for b in buckets]
        except torch.cuda.OutOfMemoryError:
            if "nccl" in backends:
                raise
            log.warning("publication: no room on %s for a copy of the weights; CUDA IPC channels stage them from "
                        "host memory", gpu)
    on_host = [flatten(b, host) for b in buckets] if "gloo" in backends or (backends and on_gpu is None) else None
    return {backend: on_gpu if backend != "gloo" and on_gpu is not None else on_host for backend in backends}


def _bytes(weights: list) -> int:
    """What one agent receives of a publication (a LoRA run: its adapters), in bytes."""
    return sum(tensor.numel() * tensor.element_size() for _, tensor in weights)
