"""SyncRunner: a publication waits for every agent's weight sync, except a live agent that has gone silent
(five heartbeats): its sync is left to finish in the background and it gets no further sync until then."""

from __future__ import annotations

import threading

from asyncrl.rpc.param_server import SyncRunner, late_after
from tests.timing import limit


class FakeRoster:
    def __init__(self, silent: dict[str, float]):
        self.silent = silent

    def status(self, name: str) -> str:
        return "live"

    def silent_for(self, name: str) -> float:
        return self.silent[name]

    def evaluating(self, name: str) -> bool:
        return name in self.evaluating_now

    evaluating_now: set[str] = frozenset()


def test_a_silent_agent_is_left_behind_and_its_sync_settles_later():
    release = threading.Event()
    roster = FakeRoster({"agent0": 0.0, "agent1": 0.0})
    runner = SyncRunner(roster, late_after_s=late_after(10.0), poll_s=0.001)
    calls = []

    def hung() -> float:
        calls.append("agent1")
        release.wait()
        return 2.0

    roster.silent["agent1"] = 6.0  # heartbeats stopped 6 s ago: past five heartbeats
    results, late = runner.run({"agent0": lambda: 0.5, "agent1": hung}, version=3)
    assert late == 1 and [r.name for r in results] == ["agent0"] and results[0].seconds == 0.5
    assert runner.busy() == {"agent1"}  # no new sync to it while the old one runs
    release.set()
    assert runner.unfinished["agent1"].done.wait(limit(5))
    roster.silent["agent1"] = 0.0
    results, late = runner.run({"agent0": lambda: 0.1}, version=4)
    assert late == 0 and {r.name: r.version for r in results} == {"agent0": 4, "agent1": 3}
    assert runner.busy() == set() and calls == ["agent1"]


def test_a_sync_of_an_agent_that_heartbeats_is_waited_for():
    roster = FakeRoster({"agent0": 0.0})
    slow = threading.Event()
    threading.Timer(0.2, slow.set).start()
    results, late = SyncRunner(roster, late_after_s=5.0, poll_s=0.001).run(
        {"agent0": lambda: float(slow.wait(limit(5)))}, version=1)
    assert late == 0 and results[0].seconds == 1.0 and results[0].error is None
    assert late_after(120.0) == 5.0 and late_after(3.0) == 3.0


def test_an_agent_finishing_an_evaluation_syncs_after_it_without_holding_the_publication():
    """An evaluation of the version an agent holds is open: the publication does not wait for that agent, whose
    sync starts only once the evaluation has ended (its evaluated tokens all carry the old version)."""
    roster = FakeRoster({"agent0": 0.0, "agent1": 0.0})
    roster.evaluating_now = {"agent1"}
    runner = SyncRunner(roster, late_after_s=late_after(10.0), poll_s=0.001)
    started = threading.Event()

    def sync() -> float:
        started.set()
        return 1.0

    results, late = runner.run({"agent0": lambda: 0.5, "agent1": sync}, version=4)
    assert late == 0 and [r.name for r in results] == ["agent0"] and runner.busy() == {"agent1"}
    assert not started.wait(0.05)  # held back while the evaluation runs
    roster.evaluating_now = set()
    assert started.wait(limit(5)) and runner.unfinished["agent1"].done.wait(limit(5))
    results, _ = runner.run({}, version=5)
    assert [(r.name, r.version, r.seconds) for r in results] == [("agent1", 4, 1.0)]
