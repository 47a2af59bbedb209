"""Trainer rank 0's death, survived: the launcher starts the run's processes again, in place, from the newest version
boundary every trainer rank holds a restore point of (`--trainer.max-recoveries`, the rpc launcher).

Rank 0 holds the run's head (the queue, the roster, the agents' channels, the store): when it dies nothing of that
can be re-formed around it, unlike a follower's death (`asyncrl.rpc.failover`). So at every version boundary rank 0
makes sure every rank has taken a restore point of that step, has each rank keep that file (`RestorePoints.pin`) and
writes its books beside them (`write_books`: the queue, the ledger, the evaluations' state, the run's clock and the
recoveries so far, as a checkpoint's extra holds them, in JSON). When rank 0 exits without a result, the launcher ends
every other process, finds the newest boundary whose books and every rank's file exist (`newest_restorable`), and
starts every trainer rank and agent again as the trainer group's next generation; the new rank 0 restores that step
on every rank and the books, publishes the boundary's weights as the version they were, and the run goes on as a
resumed one would: the versions after the boundary are trained again, the ledger balances and the recovery is in the
summary (`Restart`).

    books = write_books(points.directory, step=12, version=6, books=extra, recoveries=[])
    point = newest_restorable(restore_points_dir, world=3)        # the launcher, after rank 0 died
    Restart(generation=2, why="trainer rank 0 exited with code -9", step=point.step, books=str(point.books), ...)

What it costs: one restore point a version boundary is kept past the newest two on every rank (host memory: a third
file of each shard), a synchronous restore point at a boundary only when the ranks were still writing the previous
one, and rank 0's books written once a version (their size is the queue's: the queued groups' tokens and log-probs).
Agents that joined from outside the launcher (`asyncrl agent --join`) lose the run's store with rank 0 and exit;
start them again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import time

from asyncrl.runtime.lifecycle import is_stopped

__all__ = ["Restart", "RestorablePoint", "write_books", "read_books", "newest_restorable", "restart_refusal",
           "StoppedWatch"]

_BOOKS = re.compile(r"books-s(\d+)\.json")
_SNAP = re.compile(r"rank(\d+)-s(\d+)\.snap")


@dataclasses.dataclass(frozen=True)
class Restart:
    """What the launcher tells the new trainer rank 0 of a restart."""

    generation: int
    """The trainer group's generation every new rank joins (one more than the dead group's)."""
    why: str
    """What ended the dead rank 0 (`trainer rank 0 exited with code -9`)."""
    step: int
    """The learner step of the boundary to go on from."""
    books: str
    """The file of rank 0's books at that step."""
    detected_at: float
    """`time.monotonic()` when the launcher found rank 0 dead (one clock on one machine): the recovery's start."""


@dataclasses.dataclass(frozen=True)
class RestorablePoint:
    step: int
    books: pathlib.Path


def write_books(directory: str | os.PathLike, *, step: int, version: int, books: dict, recoveries: list[dict],
                keep: int = 3) -> pathlib.Path:
    """Write rank 0's `books` (JSON-able: the queue's `state_dict` and the run's counters) of learner `step` at
    `version` into `directory` (a trainer group's restore points), renamed into place once complete; the newest
    `keep` files are kept. `recoveries`: the run's recoveries so far (`dataclasses.asdict` of each). Returns the
    file."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    final = directory / f"books-s{step}.json"
    tmp = final.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "version": version, "books": books, "recoveries": recoveries}))
    os.replace(tmp, final)
    held = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _BOOKS.fullmatch(p.name)))
    for _, old in held[:-keep]:
        old.unlink(missing_ok=True)
    return final


def read_books(path: str | os.PathLike) -> dict:
    """`write_books`' record back: {"step", "version", "books", "recoveries"}; ValueError naming the file when it
    is not one."""
    path = pathlib.Path(path)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a trainer rank 0 books file ({err})") from None
    if not isinstance(record, dict) or not {"step", "version", "books", "recoveries"} <= record.keys() \
            or not isinstance(record["books"], dict) or "queue" not in record["books"]:
        raise ValueError(f"{path}: not a trainer rank 0 books file (fields {sorted(record)[:8]})")
    return record


def newest_restorable(base: str | os.PathLike, world: int) -> RestorablePoint | None:
    """The newest step of a group of `world` ranks (its files in `base`/world{world}) whose books and every rank's
    restore point are complete, or None."""
    directory = pathlib.Path(base) / f"world{world}"
    if not directory.is_dir():
        return None
    books, files = {}, {}
    for p in directory.iterdir():
        if m := _BOOKS.fullmatch(p.name):
            books[int(m.group(1))] = p
        elif m := _SNAP.fullmatch(p.name):
            files.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    for step in sorted(books, reverse=True):
        if files.get(step, set()) >= set(range(world)):
            return RestorablePoint(step, books[step])
    return None


def restart_refusal(*, max_recoveries: int, recoveries_left: int, stopping: bool,
                    point: RestorablePoint | None) -> str | None:
    """Why trainer rank 0's death is not survived (the run then ends), or None: the run starts again from `point`.
    `recoveries_left`: of --trainer.max-recoveries; `stopping`: a signal or a limit is ending the run."""
    if not max_recoveries:
        return ("without --trainer.max-recoveries trainer rank 0's death ends the run: resume from its last checkpoint "
                "with --resume")
    if recoveries_left <= 0:
        return f"--trainer.max-recoveries {max_recoveries} spent: resume from its last checkpoint with --resume"
    if stopping:
        return "the run was stopping"
    if point is None:
        return ("no version boundary has a restore point on every trainer rank yet: resume from its last checkpoint "
                "with --resume")
    return None


class StoppedWatch:
    """Trainer rank 0 stopped as a whole (SIGSTOP, or a debugger) as the launcher reads it: its store, the agents'
    RPC and the run's loop stop with it, so after `timeout_s` (--async-training.agent-timeout-s) it counts as dead."""

    def __init__(self, timeout_s: float, *, stopped=is_stopped, clock=time.monotonic):
        """`stopped(pid)`: whether the process is stopped (Linux's /proc state); `clock`: seconds, monotonic."""
        self.timeout_s, self._stopped, self._clock = timeout_s, stopped, clock
        self._since: float | None = None

    def why(self, pid: int) -> str | None:
        """What to say of process `pid` once it has been stopped past the timeout; None while it runs (or not yet)."""
        if not self._stopped(pid):
            self._since = None
            return None
        now = self._clock()
        if self._since is None:
            self._since = now
        if now - self._since <= self.timeout_s:
            return None
        return (f"trainer rank 0 (pid {pid}) is stopped (SIGSTOP) for {now - self._since:.0f} s "
                f"(--async-training.agent-timeout-s {self.timeout_s:g})")

    def reset(self) -> None:
        self._since = None
