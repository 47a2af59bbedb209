"""The run's log seam (`asyncrl.runtime.run_log`): `QuietLog` keeps only the wall clock, continued across a
resume; the command line's `Tracker` is a `RunLog` (tests/tracking/test_tracker.py)."""

from __future__ import annotations

import inspect

from asyncrl.runtime.run_log import QuietLog, RunLog
from asyncrl.tracking import Tracker


def test_a_quiet_log_keeps_the_wall_clock_from_its_creation_and_from_a_resume():
    now = iter([100.0, 103.5, 110.0, 112.0]).__next__
    log = QuietLog(clock=now)  # created at 100
    assert log.wall_s() == 3.5
    log.resume(version=4, wall_s=60.0)  # at 110, the checkpoint was written 60 s into the run
    assert log.wall_s() == 62.0
    log({"a": 1.0}, 5)
    log.log_samples([], {"training/global_step": 1})
    log.close()


def test_the_tracker_has_every_method_of_the_protocol():
    wanted = {name for name, _ in inspect.getmembers(RunLog, inspect.isfunction)} - set(dir(object))
    assert wanted == {"__call__", "log_samples", "wall_s", "resume", "close"}
    for name in wanted:
        ours = inspect.signature(getattr(RunLog, name)).parameters
        theirs = inspect.signature(getattr(Tracker, name)).parameters
        assert list(theirs)[:len(ours)] == list(ours), name
