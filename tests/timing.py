"""Time limits of the test suite, derived from two settings.

The suite must pass on a busy machine (a 2-core CI box, or one running `stress` beside it). Every deadline a
test sets is a multiple of a base value that is already generous on an idle 2-core machine with the suite in
one process, scaled by

* `ASYNCRL_TEST_TIME_SCALE` (default 1; raise it on a slower or overloaded machine), and
* the number of pytest-xdist workers (`PYTEST_XDIST_WORKER_COUNT`, which xdist sets in each worker before it
  imports a test module, and which the processes a test starts inherit): with N workers on the machine each
  test gets about 1/N of it. Worker processes importing torch at the same time while another worker's test
  holds the cores took a test past a guard sized for one process (commit 4f6ef76 reverted `-n 2` for that);
  a guard scaled by the worker count allows for it.

Tests assert behaviour — what happened and in which order — never speed: a deadline only turns a hang into a
failure.

Three kinds of values:
* `limit(s)`: how long a whole run, worker or wait may take before the test calls it hung (pyproject's
  per-test `timeout` goes through it too, in tests/conftest.py);
* `agent_timeout(s)`: the run's `agent_timeout_s` in tests that watch an agent being declared dead. A
  healthy agent heartbeats every second, so a timeout of 10 s only fires for an agent that really stopped,
  even when the machine is oversubscribed. The tests wait for it to pass, so it follows the machine's scale
  but not the worker count;
* `detection_margin()`: what a test allows beyond agent_timeout_s for a silent agent to be named (a bound,
  scaled like `limit`).
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("ASYNCRL_TEST_TIME_SCALE", "1"))
WORKERS = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))


def limit(seconds: float) -> float:
    """A hang guard: `seconds` (generous on an idle 2-core machine running one test at a time) times the
    suite's scale and the number of xdist workers sharing the machine."""
    return seconds * SCALE * WORKERS


def agent_timeout(seconds: float = 10.0) -> float:
    return seconds * SCALE


def detection_margin() -> float:
    """What a test allows beyond agent_timeout_s for a silent agent to be named: one liveness check
    (≤ 1 s), one heartbeat period (≤ 1 s) and scheduling delays on a busy machine."""
    return 5.0 * SCALE * WORKERS
