"""Where a run's metrics go: the `RunLog` seam between the run loop and a tracker.

The launchers hand one `RunLog` to the process that trains (rank 0, or the in-process run) beside the
`RunSpec`, never inside it; `asyncrl.tracking.Tracker` is the one the command line builds.

    log(metrics, version)              # one row per version (and one per evaluation that ends apart)
    log.log_samples(groups, metrics)   # a few of a learner step's completions
    log.wall_s()                       # the run's wall clock, continued across a resume
    log.resume(version, wall_s)        # a resumed run goes on from its checkpoint's version and clock
    log.close()                        # by the process that logged, once the run has ended

`QuietLog` logs nothing and keeps the wall clock: the log of a run built without one.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

from asyncrl.types import Group

__all__ = ["RunLog", "QuietLog"]


class RunLog(Protocol):
    """The run's metrics sink, as the controller and the launchers use it."""

    def __call__(self, metrics: dict, step: int) -> None:
        """Log one row of `metrics` at version `step`."""

    def log_samples(self, groups: Sequence[Group], metrics: dict | None = None) -> None:
        """Keep a few completions of one learner step on `groups` (`metrics`: the step's)."""

    def wall_s(self) -> float:
        """Seconds since the run started, continued across resumes."""

    def resume(self, version: int, wall_s: float) -> None:
        """The run goes on from its checkpoint at `version`, written `wall_s` seconds into the run."""

    def close(self) -> None:
        """Flush and close what the log opened; closing twice is harmless."""


class QuietLog:
    """A `RunLog` that keeps no rows: only the run's wall clock (from its creation, or from a resume)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._start = clock()

    def __call__(self, metrics: dict, step: int) -> None:
        return None

    def log_samples(self, groups: Sequence[Group], metrics: dict | None = None) -> None:
        return None

    def wall_s(self) -> float:
        return self._clock() - self._start

    def resume(self, version: int, wall_s: float) -> None:
        self._start = self._clock() - wall_s

    def close(self) -> None:
        return None
