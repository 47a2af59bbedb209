"""Re-forming the trainer group after a rank died (trainer failover): every member of the new group leaves the old
one and joins generation g's, over a store prefix of its own, so nothing of the dead group's keys is reused.

    dist.init_process_group(backend, store=trainer_store(store, 0), ...)        # the run's first group
    ... a peer dies: a collective raises on every survivor ...
    reform_trainer_group(store, generation=1, rank=r, world_size=n, backend="gloo", timeout_s=60)
    state = build_learner_state(...)             # the learner again, sharded over the new group
    ShardSnapshot(state).load_packed(...)        # ... and restored to the last version boundary

How survivors learn of a death (gloo, torch 2.13, measured in tests/rpc/test_trainer_reform.py): a rank waiting on
the dead one fails at once (its connection closes); a rank waiting on a live survivor whose own collective failed
waits out the group's timeout, since a live process's gloo connections stay open (the process group's abort and
shutdown do not close them; only the process's exit does). Fast detection on CPU therefore needs either a short
trainer-group timeout or survivors that exit and restart from restore points kept outside the process.

The members may be the survivors and a replacement (a spare, or a restarted process) with the same ranks, so the
learner's layout is unchanged and a replacement's shard comes from the replica its ring successor holds
(`asyncrl.checkpoint.snapshot`); tests/rpc/test_trainer_reform.py runs that with three gloo ranks and a spare.
"""

from __future__ import annotations

import datetime
import gc
import logging
import time
from typing import Callable

import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["trainer_store", "join_trainer_group", "reform_trainer_group", "abort_trainer_groups",
           "abort_communicators", "Abandoned"]

log = logging.getLogger(__name__)


def trainer_store(store: dist.Store, generation: int) -> dist.PrefixStore:
    """The trainer group's store prefix in generation `generation` (0: the run's first group)."""
    if generation < 0:
        raise ValueError(f"trainer_store: generation {generation} must be >= 0")
    return dist.PrefixStore("asyncrl/trainers" if generation == 0 else f"asyncrl/trainers/gen{generation}", store)


def abort_communicators() -> None:
    """Abort every process group of this process (from any thread): an NCCL collective under way, or the next one,
    fails instead of waiting for a dead peer. `abort_trainer_groups` still follows, on the thread that re-forms."""
    try:
        distributed_c10d._abort_process_group()
    except Exception as err:  # noqa: BLE001 - the group is broken by the death being recovered from
        log.warning("aborting the broken trainer group: %s", err)


def abort_trainer_groups() -> None:
    """Abort every process group of this process (the trainer group and the groups made from it) and forget them,
    so that a new generation can be joined. The caller drops its learner first (its sharded tensors hold the old
    group). On gloo this does not close the old connections (module docstring)."""
    abort_communicators()
    gc.collect()  # what still refers to the old groups (a dropped learner) goes now


class Abandoned(Exception):
    """A generation's group stopped forming: a newer generation was called while its members assembled."""


def _assemble(store: dist.Store, generation: int, rank: int, world_size: int, timeout_s: float,
              abandoned: Callable[[], bool] | None, poll_s: float = 0.05) -> None:
    """Every member of generation `generation` says it is here before any joins the group: the join itself (the
    backend's rendezvous) cannot be interrupted, and a member that died before it would hold the others there
    until the timeout. This wait can: `abandoned()` true raises Abandoned."""
    here = dist.PrefixStore(f"asyncrl/trainers/gen{generation}/here", store)
    here.set(str(rank), "1")
    members = [str(r) for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not here.check(members):
        if abandoned is not None and abandoned():
            raise Abandoned(f"trainer group generation {generation}: a newer generation was called while it formed")
        if time.monotonic() > deadline:
            missing = [m for m in members if not here.check([m])]
            raise TimeoutError(f"trainer group generation {generation}: rank(s) {', '.join(missing)} did not come "
                               f"within {timeout_s:g} s (--startup-timeout-s)")
        time.sleep(poll_s)


def join_trainer_group(store: dist.Store, *, generation: int, rank: int, world_size: int, backend: str,
                       timeout: datetime.timedelta, startup_timeout_s: float,
                       abandoned: Callable[[], bool] | None = None) -> None:
    """Join generation `generation`'s trainer group as `rank` of `world_size` (`timeout`: its collectives'). A
    re-formed generation (> 0) assembles first (`_assemble`, within `startup_timeout_s`; `abandoned`: whether a
    newer generation was called meanwhile)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"join_trainer_group: rank {rank} outside a group of {world_size}")
    if generation:
        _assemble(store, generation, rank, world_size, startup_timeout_s, abandoned)
    dist.init_process_group(backend, store=trainer_store(store, generation), rank=rank, world_size=world_size,
                            timeout=timeout)
    if generation:
        log.info("trainer group generation %d: rank %d of %d", generation, rank, world_size)


def reform_trainer_group(store: dist.Store, *, generation: int, rank: int, world_size: int, backend: str,
                         timeout_s: float, startup_timeout_s: float | None = None,
                         abandoned: Callable[[], bool] | None = None) -> None:
    """Leave this process's trainer group (aborted; a replacement has none yet) and join generation
    `generation`'s as `rank` of `world_size` (`join_trainer_group`; `timeout_s`: its collectives', and the
    assembly's unless `startup_timeout_s` is given); returns once every member joined."""
    if dist.is_initialized():
        abort_trainer_groups()
    join_trainer_group(store, generation=generation, rank=rank, world_size=world_size, backend=backend,
                       timeout=datetime.timedelta(seconds=timeout_s),
                       startup_timeout_s=timeout_s if startup_timeout_s is None else startup_timeout_s,
                       abandoned=abandoned)
