"""Trainer failover inside a running job: a trainer follower that dies or hangs costs the run seconds, not its
steps since the last checkpoint (`--trainer.max-recoveries N`; 0, the default, ends the run as before).

    asyncrl train cpu-demo --placement.trainer-devices cpu cpu cpu --trainer.max-recoveries 2

1. Restore points. After a training step, when no rank is still writing the previous one, each trainer rank copies
   its shard (weights, optimizer moments, schedules, counters, RNG: `ShardSnapshot`) to host buffers and writes it to
   the run's directory in host shared memory (/dev/shm) on a thread of its own. After every step the ranks agree on
   the newest step every rank's file holds: the committed one. A rank keeps its newest two files, so a death while
   writing leaves the committed one whole (`RestorePoints`); rank 0 keeps the batches trained since.
2. Detection (the launcher, `asyncrl.rpc.supervise`). A follower's exit is seen at once; a stopped or hung one when
   its heartbeat (`Heartbeat`: a thread of its own, from when the process reaches the store, so also while it
   builds its learner or joins a re-formed group) has been silent for `--async-training.agent-timeout-s`. The
   launcher then ends every other follower as well (on gloo a survivor blocked in a collective with a live peer is
   freed only by that peer's exit), posts the fault to the run's store with the trainer group's next generation,
   and starts followers 1..T−1 again.
3. Rank 0 (the head: queue, roster, agents and their weight channels stay up) finds its command broken or the fault
   posted (on NCCL a watcher aborts its communicators when the fault is posted), and recovers (`Failover`): it leaves
   the broken group, joins the new generation's over a store prefix of its own (`asyncrl.rpc.reform`), rebuilds its
   learner, restores the committed step, tells the new followers to restore theirs from their files, trains the
   steps since again on their batches, and gives the command again: no group is trained twice, the version counter
   never goes back, and the ledger is unchanged. Each recovery is in the run's metrics (`trainer/recoveries`) and summary.
4. `--trainer.failover shrink`: the launcher leaves the faulty rank's device out (the fault's record lists the
   devices), and every rank of the smaller group re-slices the old group's restore points of the committed step
   (`RestorePoints.restore` with the old group's size).
5. A fault while the group re-forms (a follower started again that dies or hangs) starts the recovery over with the
   newer generation (`take_on`, then `rebuild` again); the members assemble before the backend's rendezvous, so rank
   0 never waits for a member that is gone (`asyncrl.rpc.reform`).

Under torchrun each follower's torchrun process keeps its rank and does the launcher's part for it
(`asyncrl.rpc.torchrun.keep_trainer`).

Rank 0's own death: the launcher starts every process again from the newest version boundary every rank holds
(`asyncrl.rpc.restart`). Limits: the placement is split (not colocated);
`--trainer.failover shrink` needs the rpc launcher; a second fault before another step was
trained, or more than `--trainer.max-recoveries` faults, end the run with the reason. Cost: host memory for two
files of every rank's shard (16 bytes a trained parameter over the ranks) and pinned buffers of one, the writes'
bandwidth beside training, and rank 0's batches since the committed step (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import threading
import time
import weakref

import torch
import torch.distributed as dist

from asyncrl.checkpoint.snapshot import ShardSnapshot
from asyncrl.checkpoint.snapshot_files import read_packed, snapshot_directory, write_packed
from asyncrl.learner import LearnerState
from asyncrl.rpc.reform import abort_communicators, reform_trainer_group
from asyncrl.rpc.restart import Restart, write_books
from asyncrl.rpc.spec import RunSpec
from asyncrl.rpc.store import RunStore
from asyncrl.runtime.kill_points import GENERATION_ENV
from asyncrl.runtime.lifecycle import RunFailed, is_stopped

__all__ = ["RestorePoints", "Failover", "Heartbeat", "Recovery", "Silence", "refusal", "trainer_backend",
           "enter_generation", "restore_points_directory"]

log = logging.getLogger(__name__)


def trainer_backend(spec: RunSpec) -> str:
    """The trainer group's backend: NCCL when every trainer rank is a GPU, else gloo."""
    return "nccl" if all(d.startswith("cuda") for d in spec.trainer_devices) else "gloo"


def restore_points_directory(nonce: str) -> pathlib.Path:
    """A torchrun job's restore points on each of its hosts (named by the run's nonce; the rpc launcher names its
    own)."""
    return snapshot_directory(f"run-{nonce}")


class Silence:
    """A trainer follower's heartbeat count as a watcher reads it (the launcher, or a torchrun keeper): how long it
    has not moved, once that passes `timeout_s` (--async-training.agent-timeout-s)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._count, self._since = 0, time.monotonic()

    def past_timeout(self, count: int) -> float | None:
        """Seconds the count has stood at `count`, once past the timeout; None while it moves or is 0 (the
        follower's process has not reached the store yet)."""
        now = time.monotonic()
        if count == 0 or count != self._count:
            self._count, self._since = count, now
            return None
        return now - self._since if now - self._since > self.timeout_s else None

    def why(self, rank: int, pid: int, silent: float) -> str:
        how = "is stopped (SIGSTOP)" if is_stopped(pid) else "hangs (its whole process)"
        return (f"trainer rank {rank} (pid {pid}) {how}: no heartbeat for {silent:.0f} s "
                f"(--async-training.agent-timeout-s {self.timeout_s:g})")


class Heartbeat:
    """A trainer follower's heartbeat (`RunStore.trainer_beat`, every `period_s`), from a thread of its own over a
    store connection of its own, from the moment the process reaches the store until `stop()` or the run's end:
    a follower stopped or hung as a whole while it builds its learner, joins a re-formed group or follows is named
    by its watcher (`Silence`) within the timeout, not by rank 0's assembly or collective timeout."""

    def __init__(self, host: str, port: int, rank: int, generation: int, *, timeout_s: float, period_s: float = 0.5):
        self._store = RunStore(host, port, serve=False, timeout_s=timeout_s)
        self._rank, self._generation, self._period_s = rank, generation, period_s
        self._stopped = threading.Event()
        self._store.trainer_beat(rank, generation)  # the first before the constructor returns: counted from here on
        self._thread = threading.Thread(target=self._beat, name=f"trainer{rank}-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._period_s):
            try:
                if self._store.is_shut_down():
                    return
                self._store.trainer_beat(self._rank, self._generation)
            except Exception:  # noqa: BLE001 - rank 0 (the store) is gone: so is the run
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def enter_generation(generation: int) -> None:
    """This trainer process now belongs to the trainer group's generation `generation` (a failover drill's kill
    points are per generation: `asyncrl.runtime.kill_points`)."""
    os.environ[GENERATION_ENV] = str(generation)


class RestorePoints:
    """One trainer rank's restore points: files of its packed shard snapshot in the run's directory (the newest two).

    A snapshot is taken after a step when no rank is still writing the previous one (the device's copies go to
    host buffers at once, on a side stream on a GPU) and written to its file on a thread of its own while training
    goes on; the ranks agree after every step on the newest step whose file every rank completed (`after_step`),
    which is the committed one. Steps since then are trained again from it on a fault (rank 0 keeps their batches)."""

    def __init__(self, directory: str | os.PathLike, rank: int, world: int):
        self.base, self.rank, self.world = pathlib.Path(directory), rank, world
        self.directory = self.base / f"world{world}"  # a group of another size (a shrink) writes beside, not over
        self._snapshot: ShardSnapshot | None = None
        self._of: weakref.ref | None = None  # the policy the snapshot's buffers were built for (an id() could be
        #                                      a dropped policy's, reused by the one a recovery built)
        self._writer: threading.Thread | None = None
        self._written = -1  # the newest step whose file this rank completed
        self._failed: BaseException | None = None
        self.latest = -1  # the newest step whose snapshot was taken (its file written or being written)
        self.pinned: int | None = None  # a step whose file is kept past the newest two (`pin`)

    def _snapshot_of(self, state: LearnerState) -> ShardSnapshot:
        if self._snapshot is None or self._of is None or self._of() is not state.policy:
            self._snapshot, self._of = ShardSnapshot(state), weakref.ref(state.policy)
        return self._snapshot

    def start(self, state: LearnerState) -> None:
        """Snapshot `state` now and write it to its file in the background (no write may be under way)."""
        self.wait()
        snapshot = self._snapshot_of(state)
        copied = snapshot.take(state)
        snapshot.settle()  # the next step's updates come after the copies on the device
        step = self.latest = state.step
        self._writer = threading.Thread(target=self._write, args=(snapshot, copied, step), daemon=True,
                                        name=f"restore-point-{step}")
        self._writer.start()

    def _write(self, snapshot: ShardSnapshot, copied, step: int) -> None:
        try:
            if copied is not None:
                copied.synchronize()
            write_packed(self.directory, rank=self.rank, step=step, packed=snapshot.packed_parts(), pinned=self.pinned)
            self._written = step
        except BaseException as err:  # noqa: BLE001 - raised on the training thread by `wait`
            self._failed = err

    def _join(self) -> BaseException | None:
        """Wait for the write under way; its failure, if it failed (then cleared)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        err, self._failed = self._failed, None
        return err

    def idle(self) -> bool:
        return self._writer is None or not self._writer.is_alive()

    def wait(self) -> None:
        """Until the write under way (if any) is done; raises RunFailed when it failed (a full disk)."""
        err = self._join()
        if err is not None:
            raise RunFailed(f"trainer rank {self.rank}: its restore point could not be written to {self.directory}: "
                            f"{err} (set ASYNCRL_RESTORE_POINTS_DIR to a larger host directory)") from err

    def after_step(self, state: LearnerState, group: dist.ProcessGroup | None) -> int:
        """Every rank after each step, together: agree on the committed step and on whether every rank is idle;
        if so, snapshot this step. Returns the committed step (-1: none yet)."""
        if self._failed is not None:
            self.wait()
        committed, idle = _lowest([self._written, 1 if self.idle() else 0], group)
        if idle:
            self.start(state)
        return committed

    def commit_now(self, state: LearnerState, group: dist.ProcessGroup | None) -> int:
        """Every rank, together: snapshot `state` and wait until every rank wrote it (the first restore point)."""
        self.start(state)
        self.wait()
        return _lowest([self._written], group)[0]

    def pin(self, step: int) -> None:
        """Keep the file of `step` (taken already) until another step is pinned, however many are written after it:
        trainer rank 0's books are kept for that step (a version boundary), so that a restart of the whole trainer
        group finds every rank's file of it (`asyncrl.rpc.restart`)."""
        if step != self.latest:
            raise ValueError(f"trainer rank {self.rank}: step {step} pinned, but the newest restore point taken is of "
                             f"step {self.latest}")
        self.pinned = step

    def regroup(self, world: int) -> None:
        """This rank now belongs to a group of `world` ranks (a shrink): its next restore points go to that group's
        directory; the files of the old group's stay for a restore (`restore`'s `world`)."""
        self._join()  # a write under way finishes first; a failed one no longer matters
        self.world, self.directory = world, self.base / f"world{world}"

    def restore(self, state: LearnerState, step: int, world: int | None = None) -> None:
        """Put `state` (this rank's learner, possibly freshly built) back to its shard at `step`, from the files of a
        group of `world` ranks (None: this rank's group); from a larger group (a shrink), every one of its ranks'
        files is read and re-sliced for this rank (`ShardSnapshot.load_resharded`)."""
        self._join()  # a write under way finishes first (it may prune older files); a failed one no longer matters
        world = self.world if world is None else world
        directory = self.base / f"world{world}"
        paths = [directory / f"rank{r}-s{step}.snap" for r in ([self.rank] if world == self.world else range(world))]
        missing = [p.name for p in paths if not p.exists()]
        if missing:
            raise RunFailed(f"trainer rank {self.rank}: no restore point of step {step} in {directory} "
                            f"({', '.join(missing)})")
        snapshot = self._snapshot_of(state)
        if world == self.world:
            snapshot.load_packed(*read_packed(paths[0]))
        else:
            snapshot.load_resharded([read_packed(p) for p in paths], rank=self.rank, world=self.world)
        snapshot.restore(state)
        self._written = max(self._written, step)
        if world == self.world:  # this group's file of `step` exists: it can be pinned as it is
            self.latest = max(self.latest, step)


def _lowest(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """Each of `values`' minimum over the ranks of `group` (this rank's own without a group)."""
    agreed = torch.tensor(values, dtype=torch.int64)
    if group is not None:
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in agreed]


def refusal(*, recoveries: int, max_recoveries: int, committed: int, at_step: int,
            last_fault_at: int | None) -> str | None:
    """Why a trainer-group fault is not recovered from (None: it is). `recoveries`: made so far; `committed`: the step
    every rank holds a restore point of (-1: none yet); `at_step`: the learner's step when the fault came;
    `last_fault_at`: the previous fault's."""
    if recoveries >= max_recoveries:
        return f"--trainer.max-recoveries {max_recoveries} spent"
    if committed < 0:
        return "no restore point was committed yet"
    if last_fault_at == at_step:
        return f"a second fault before another step was trained (both at step {at_step})"
    return None


@dataclasses.dataclass
class Recovery:
    """One recovery, for the run's summary."""

    generation: int
    why: str
    step: int
    version: int
    seconds: float
    restarted: bool = False
    """Every process of the run was started again (trainer rank 0 died: `asyncrl.rpc.restart`), rather than the
    trainer group re-formed around rank 0."""


def _drop_learner(state: LearnerState) -> None:
    """Release `state`'s models and optimizers (their sharded tensors hold the broken group)."""
    for field in ("policy", "optimizer", "scheduler", "reference", "critic", "critic_optimizer", "critic_scheduler",
                  "moe", "group"):
        setattr(state, field, None)


class Failover:
    """Rank 0's part (module docstring): knows the committed step, notices a posted fault, and re-forms the group."""

    def __init__(self, spec: RunSpec, store: RunStore, points: RestorePoints, *, device: str, build):
        self.spec, self.store, self.points, self.device = spec, store, points, device
        self.build = build  # (spec, device, group, initial_weights=, reference=) -> a LearnerState over `group`
        self.generation = 0
        self.committed = -1  # the step every rank's restore point holds (-1: none yet)
        self.committed_world = spec.num_trainers  # the size of the group whose files hold it
        self.recoveries: list[Recovery] = []
        self.faults = 0  # taken on, each recovered or still being recovered from
        self._last_fault_at: int | None = None
        self._started, self._version, self._whys = 0.0, 0, []  # of the recovery under way (its faults; []: none)
        # how long a broken command waits for the launcher's word: it names a hung follower after the agent timeout
        self.wait_s = spec.async_.agent_timeout_s + 10.0

    def posted(self) -> dict | None:
        """The fault the launcher posted for a generation this rank has not joined yet, or None."""
        fault = self.store.trainer_fault()
        return fault if fault is not None and fault["generation"] > self.generation else None

    def await_fault(self, err: BaseException) -> dict:
        """After a trainer-group command broke with `err`: the launcher's fault, once posted; `err` is raised when
        none comes within `wait_s` (a failure of rank 0's own), or at once when no fault is posted yet and `err` is
        not a collective's error (RuntimeError, OSError) but, say, a ValueError."""
        if isinstance(err, RunFailed):
            raise err  # a reason of rank 0's own, stated in full (a restore point that could not be written)
        if self.posted() is None and not isinstance(err, (RuntimeError, OSError)):
            raise err  # not how a peer's death shows (a collective's error): a fault of rank 0's own, said at once
        deadline = time.monotonic() + self.wait_s
        while (fault := self.posted()) is None:
            if time.monotonic() > deadline:
                raise err
            time.sleep(0.1)
        log.warning("trainer group command broke (%s): %s", str(err).splitlines()[0][:200] if str(err) else
                    type(err).__name__, fault["why"])
        return fault

    @contextlib.contextmanager
    def watching(self):
        """Around a command on NCCL: a fault posted meanwhile aborts the trainer group's communicators, so that a
        collective waiting on a dead peer fails now rather than at its timeout (on gloo the peer's exit does that)."""
        if trainer_backend(self.spec) != "nccl":
            yield
            return
        done, aborted = threading.Event(), threading.Event()

        def watch() -> None:
            while not done.wait(0.2):
                if self.posted() is not None:
                    log.warning("a trainer-group fault was posted during a command: aborting its communicators")
                    aborted.set()
                    abort_communicators()
                    return

        watcher = threading.Thread(target=watch, name="failover-watch", daemon=True)
        watcher.start()
        try:
            yield
            # NCCL returns before its kernels end: a collective waiting on a dead peer would hang whatever uses its
            # result next (a publication's broadcast to an agent), outside this watch. Wait for them here; aborted
            # kernels end with garbage, so the command counts as broken and is given again.
            torch.cuda.current_stream().synchronize()
            if aborted.is_set():
                raise RuntimeError("the trainer group was aborted during the command (a posted fault)")
        finally:
            done.set()
            watcher.join()

    def after_step(self, state: LearnerState, group: dist.ProcessGroup | None) -> None:
        """Rank 0 after each step (the followers do the same): `RestorePoints.after_step`."""
        committed = self.points.after_step(state, group)
        if committed != self.committed:  # a newer step, in this group's files (after a shrink: the old group's until)
            self.committed, self.committed_world = committed, self.spec.num_trainers

    def commit_now(self, state: LearnerState, group: dist.ProcessGroup | None) -> None:
        self.committed, self.committed_world = self.points.commit_now(state, group), self.spec.num_trainers

    def keep_books(self, state: LearnerState, books: dict) -> None:
        """Rank 0 at a version boundary whose restore point every rank took and pinned: its `books` beside them
        (`asyncrl.rpc.restart`)."""
        write_books(self.points.directory, step=state.step, version=state.version, books=books,
                    recoveries=[dataclasses.asdict(r) for r in self.recoveries])

    def restarted(self, restart: Restart, record: dict) -> None:
        """A restarted rank 0 (`asyncrl.rpc.restart`): the run's recoveries so far, from the books `record`, and the
        restart's generation; its step is the committed one (every rank restored it)."""
        known = {f.name for f in dataclasses.fields(Recovery)}
        self.recoveries = [Recovery(**{k: v for k, v in r.items() if k in known}) for r in record["recoveries"]]
        self.faults = len(self.recoveries) + 1
        self.generation = restart.generation
        self.committed, self.committed_world = restart.step, self.spec.num_trainers
        self._last_fault_at = restart.step  # a follower's fault before another step is trained is not recovered

    def record_restart(self, restart: Restart, state: LearnerState) -> Recovery:
        """The restart is over (every rank restored, the agents live): recorded as a recovery."""
        done = Recovery(restart.generation, restart.why, state.step, state.version,
                        time.monotonic() - restart.detected_at, restarted=True)
        self.recoveries.append(done)
        log.warning("trainer rank 0 restarted as generation %d in %.1f s (step %d, version %d): %s", done.generation,
                    done.seconds, done.step, done.version, restart.why)
        return done

    def take_on(self, state: LearnerState, fault: dict) -> None:
        """Accept `fault` (RunFailed when it is not recovered from: `refusal`) and move to its generation. A fault
        during a recovery (a follower started again that died or hung before the group was ready) restarts that
        recovery: it counts against --trainer.max-recoveries, and no step was trained in between."""
        why = str(fault["why"])
        recovering = bool(self._whys)
        refused = refusal(recoveries=self.faults, max_recoveries=self.spec.trainer.max_recoveries,
                          committed=self.committed, at_step=state.step,
                          last_fault_at=None if recovering else self._last_fault_at)
        if refused is not None:
            raise RunFailed(f"{'; then '.join([*self._whys, why])}; not recovered: {refused} (resume from the last "
                            "checkpoint with --resume)")
        if not recovering:
            self._started, self._version, self._last_fault_at = time.monotonic(), state.version, state.step
        self.faults += 1
        self._whys.append(why)
        self.generation = int(fault["generation"])
        enter_generation(self.generation)
        devices = fault.get("trainer_devices")
        if devices and list(devices) != self.spec.trainer_devices:  # a shrink: the launcher left a device out
            self.spec = dataclasses.replace(self.spec, trainer_devices=list(devices))
        log.warning("%s: trainer group generation %d re-forms with %d rank(s); back to step %d", why, self.generation,
                    self.spec.num_trainers, self.committed)

    def rebuild(self, state: LearnerState, commands) -> dist.ProcessGroup:
        """Join the taken-on generation's group and rebuild `state` in place at the committed step (its version
        kept). `commands(spec)` makes the commands group (every rank in the same order). Returns it, on which the
        caller has the followers restore theirs (a "restore" command), then calls `recovered`. Raises Abandoned when
        a newer generation is called while the group assembles (`asyncrl.rpc.reform`)."""
        reference = None if self.spec.lora.enabled else state.reference  # unsharded and never trained: kept
        _drop_learner(state)
        began = time.monotonic()
        reform_trainer_group(self.store.raw, generation=self.generation, rank=0, world_size=self.spec.num_trainers,
                             backend=trainer_backend(self.spec), timeout_s=self.spec.async_.sync_timeout_s,
                             startup_timeout_s=self.spec.startup_timeout_s,
                             abandoned=lambda: self.posted() is not None)
        group = commands(self.spec)
        joined = time.monotonic()
        fresh = self.build(self.spec, self.device, dist.group.WORLD, initial_weights=False, reference=reference)
        for field in dataclasses.fields(LearnerState):
            setattr(state, field.name, getattr(fresh, field.name))
        built = time.monotonic()
        self.points.regroup(self.spec.num_trainers)
        self.points.restore(state, self.committed, world=self.committed_world)
        log.warning("trainer rank 0: group joined in %.1f s, learner built in %.1f s, step %d restored in %.1f s",
                    joined - began, built - joined, self.committed, time.monotonic() - built)
        state.version = self._version  # publications since the committed step happened: the counter never goes back
        return group

    def recovered(self, state: LearnerState) -> Recovery:
        """Every rank restored and the steps since were trained again: the recovery is over (recorded)."""
        done = Recovery(self.generation, "; then ".join(self._whys), state.step, state.version,
                        time.monotonic() - self._started)
        self.recoveries.append(done)
        self._whys = []
        log.warning("trainer group generation %d ready in %.1f s (step %d, version %d)", done.generation, done.seconds,
                    done.step, done.version)
        return done
