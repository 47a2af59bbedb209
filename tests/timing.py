"""Time limits of the test suite, derived from one setting.

The suite must pass on a busy machine (a 2-core CI box, or one running `stress` beside it). Every deadline a
test sets is a multiple of a base value that is already generous on an idle 2-core machine, scaled by
`ASYNCRL_TEST_TIME_SCALE` (default 1; raise it on a slower or overloaded machine). Tests assert behaviour —
what happened and in which order — never speed: a deadline only turns a hang into a failure.

Two kinds of values:
* `limit(s)`: how long a whole run, worker or wait may take before the test calls it hung;
* `agent_timeout(s)`: the run's `agent_timeout_s` in tests that watch an agent being declared dead. A
  healthy agent heartbeats every second, so a timeout of 10 s only fires for an agent that really stopped,
  even when the machine is oversubscribed; the detection bound the tests check is this timeout plus a margin
  (`detection_margin`).
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("ASYNCRL_TEST_TIME_SCALE", "1"))


def limit(seconds: float) -> float:
    """A hang guard: `seconds` (generous on an idle 2-core machine) times the suite's scale."""
    return seconds * SCALE


def agent_timeout(seconds: float = 10.0) -> float:
    return seconds * SCALE


def detection_margin() -> float:
    """What a test allows beyond agent_timeout_s for a silent agent to be named: one liveness check
    (≤ 1 s), one heartbeat period (≤ 1 s) and scheduling delays on a busy machine."""
    return 5.0 * SCALE
