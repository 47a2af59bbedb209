"""Trainer failover inside a running job: a trainer follower that dies or hangs costs the run seconds, not its
steps since the last checkpoint (`--trainer.max-recoveries N`; 0, the default, ends the run as before).

    asyncrl train cpu-demo --placement.trainer-devices cpu cpu cpu --trainer.max-recoveries 2

1. Restore points. After every training step each trainer rank writes its shard (weights, optimizer moments,
   schedules, counters, RNG: `ShardSnapshot`) to the run's directory in host shared memory (/dev/shm), and the ranks
   then meet at a barrier: only a step every rank has written is committed. A rank keeps its newest two files, so a
   death while writing leaves the committed one whole (`RestorePoints`).
2. Detection (the launcher, `asyncrl.rpc.supervise`). A follower's exit is seen at once; a stopped or hung one when
   its heartbeat has been silent for `--async-training.agent-timeout-s`. The launcher then ends every other follower
   as well (on gloo a survivor blocked in a collective with a live peer is freed only by that peer's exit), posts the
   fault to the run's store with the trainer group's next generation, and starts followers 1..T−1 again.
3. Rank 0 (the head: queue, roster, agents and their weight channels stay up) finds its command broken or the fault
   posted, and `Failover.recover`s: it leaves the broken group, joins the new generation's over a store prefix of
   its own (`asyncrl.rpc.reform`), rebuilds its learner, restores the committed step, tells the new followers to
   restore theirs from their files, and gives the command again. A step broken mid-way is thus trained again on
   the same groups from the same boundary: no group is trained twice, the version counter never goes back, and
   the ledger is unchanged. Each recovery is in the run's metrics (`trainer/recoveries`) and summary.

Limits: rank 0's own death still ends the run (resume from a checkpoint); the launcher is this machine's
(`--placement.launcher rpc`), the placement is split (not colocated); a second fault before another step is
committed, or more than `--trainer.max-recoveries` faults, end the run with the reason. Cost: a host copy of every
rank's shard a step (16 bytes a trained parameter over the ranks, twice: the newest two are kept) and the time to
write it (docs/faults.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import time

import torch.distributed as dist

from asyncrl.checkpoint.snapshot import ShardSnapshot
from asyncrl.checkpoint.snapshot_files import read_packed, write_packed
from asyncrl.learner import LearnerState
from asyncrl.rpc.reform import abort_trainer_groups, reform_trainer_group
from asyncrl.rpc.spec import RunSpec
from asyncrl.rpc.store import RunStore
from asyncrl.runtime.kill_points import GENERATION_ENV
from asyncrl.runtime.lifecycle import RunFailed

__all__ = ["RestorePoints", "Failover", "Recovery", "refusal", "trainer_backend", "enter_generation"]

log = logging.getLogger(__name__)


def trainer_backend(spec: RunSpec) -> str:
    """The trainer group's backend: NCCL when every trainer rank is a GPU, else gloo."""
    return "nccl" if all(d.startswith("cuda") for d in spec.trainer_devices) else "gloo"


def enter_generation(generation: int) -> None:
    """This trainer process now belongs to the trainer group's generation `generation` (a failover drill's kill
    points are per generation: `asyncrl.runtime.kill_points`)."""
    os.environ[GENERATION_ENV] = str(generation)


class RestorePoints:
    """One trainer rank's restore points: files of its packed shard snapshot in the run's directory, one per
    committed step (the newest two are kept)."""

    def __init__(self, directory: str | os.PathLike, rank: int):
        self.directory, self.rank = pathlib.Path(directory), rank
        self._snapshot: ShardSnapshot | None = None
        self._of: int | None = None  # id() of the policy the snapshot's buffers were built for

    def _snapshot_of(self, state: LearnerState) -> ShardSnapshot:
        if self._snapshot is None or self._of != id(state.policy):
            self._snapshot, self._of = ShardSnapshot(state), id(state.policy)
        return self._snapshot

    def write(self, state: LearnerState) -> pathlib.Path:
        """Write this rank's shard at `state.step` (after a step: the device's copies are waited for)."""
        snapshot = self._snapshot_of(state)
        snapshot.take(state)
        return write_packed(self.directory, rank=self.rank, step=state.step, packed=snapshot.packed())

    def restore(self, state: LearnerState, step: int) -> None:
        """Put `state` (this rank's learner, possibly freshly built) back to its shard at `step`."""
        path = self.directory / f"rank{self.rank}-s{step}.snap"
        if not path.exists():
            raise RunFailed(f"trainer rank {self.rank}: no restore point of step {step} in {self.directory}")
        snapshot = self._snapshot_of(state)
        snapshot.load_packed(*read_packed(path))
        snapshot.restore(state)


def refusal(*, recoveries: int, max_recoveries: int, committed: int | None, last_fault_at: int | None) -> str | None:
    """Why a trainer-group fault is not recovered from (None: it is). `recoveries`: made so far; `committed`: the step
    every rank holds a restore point of (None: none yet); `last_fault_at`: the committed step of the previous fault."""
    if recoveries >= max_recoveries:
        return f"--trainer.max-recoveries {max_recoveries} spent"
    if committed is None:
        return "no restore point was committed yet"
    if last_fault_at == committed:
        return f"a second fault before another step was committed (both at step {committed})"
    return None


@dataclasses.dataclass
class Recovery:
    """One recovery, for the run's summary."""

    generation: int
    why: str
    step: int
    version: int
    seconds: float


def _drop_learner(state: LearnerState) -> None:
    """Release `state`'s models and optimizers (their sharded tensors hold the broken group)."""
    for field in ("policy", "optimizer", "scheduler", "reference", "critic", "critic_optimizer", "critic_scheduler",
                  "moe", "group"):
        setattr(state, field, None)


class Failover:
    """Rank 0's part (module docstring): knows the committed step, notices a posted fault, and re-forms the group."""

    def __init__(self, spec: RunSpec, store: RunStore, points: RestorePoints, *, device: str, build):
        self.spec, self.store, self.points, self.device = spec, store, points, device
        self.build = build  # (spec, device, group) -> a fresh LearnerState over `group`
        self.generation = 0
        self.committed: int | None = None
        self.recoveries: list[Recovery] = []
        self._last_fault_at: int | None = None
        self._started, self._why = 0.0, ""  # of the recovery under way
        # how long a broken command waits for the launcher's word: it names a hung follower after the agent timeout
        self.wait_s = spec.async_.agent_timeout_s + 10.0

    def posted(self) -> dict | None:
        """The fault the launcher posted for a generation this rank has not joined yet, or None."""
        fault = self.store.trainer_fault()
        return fault if fault is not None and fault["generation"] > self.generation else None

    def await_fault(self, err: BaseException) -> dict:
        """After a trainer-group command broke with `err`: the launcher's fault, once posted; `err` is raised when
        none comes within `wait_s` (a failure of rank 0's own)."""
        deadline = time.monotonic() + self.wait_s
        while (fault := self.posted()) is None:
            if time.monotonic() > deadline:
                raise err
            time.sleep(0.1)
        log.warning("trainer group command broke (%s): %s", str(err).splitlines()[0][:200] if str(err) else
                    type(err).__name__, fault["why"])
        return fault

    def commit(self, state: LearnerState, group: dist.ProcessGroup | None) -> None:
        """Rank 0: its restore point of `state.step`, then the barrier with the followers (who wrote theirs)."""
        self.points.write(state)
        if group is not None:
            dist.barrier(group=group)
        self.committed = state.step

    def recover(self, state: LearnerState, fault: dict, commands) -> dist.ProcessGroup:
        """Join the new generation's group and rebuild `state` in place at the committed step (its version kept).
        `commands(spec)` makes the commands group (every rank in the same order). Returns the new commands group, on
        which the caller has the followers restore theirs (a "restore" command), then calls `recovered`. Raises
        RunFailed when the fault is not recovered from (`refusal`)."""
        why = str(fault["why"])
        refused = refusal(recoveries=len(self.recoveries), max_recoveries=self.spec.trainer.max_recoveries,
                          committed=self.committed, last_fault_at=self._last_fault_at)
        if refused is not None:
            raise RunFailed(f"{why}; not recovered: {refused} (resume from the last checkpoint with --resume)")
        self._started, version = time.monotonic(), state.version
        self.generation = int(fault["generation"])
        enter_generation(self.generation)
        log.warning("%s: trainer group generation %d re-forms; back to step %d", why, self.generation, self.committed)
        _drop_learner(state)
        abort_trainer_groups()
        reform_trainer_group(self.store.raw, generation=self.generation, rank=0, world_size=self.spec.num_trainers,
                             backend=trainer_backend(self.spec), timeout_s=self.spec.startup_timeout_s)
        group = commands(self.spec)
        fresh = self.build(self.spec, self.device, dist.group.WORLD)
        for field in dataclasses.fields(LearnerState):
            setattr(state, field.name, getattr(fresh, field.name))
        self.points.restore(state, self.committed)
        state.version = version  # publications since the committed step happened: the counter never goes back
        self._why = why
        return group

    def recovered(self, state: LearnerState) -> Recovery:
        """Every rank restored: the recovery is over (recorded)."""
        self._last_fault_at = self.committed
        done = Recovery(self.generation, self._why, state.step, state.version, time.monotonic() - self._started)
        self.recoveries.append(done)
        log.warning("trainer group generation %d ready in %.1f s (step %d, version %d)", done.generation, done.seconds,
                    done.step, done.version)
        return done
