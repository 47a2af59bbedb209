"""SyncRunner: a publication waits for every agent's weight sync, except a live agent that has gone silent
(five heartbeats): its sync is left to finish in the background and it gets no further sync until then; and an
agent finishing an evaluation of its weights, whose sync the next publication waits for."""

from __future__ import annotations

import threading

from asyncrl.rpc.param_server import SyncRunner, late_after
from tests.timing import limit


class FakeRoster:
    agent_timeout_s = 10.0

    def __init__(self, silent: dict[str, float]):
        self.silent = silent
        self.held: dict[str, int] = {}  # the version each agent's last ended sync brought it

    def synced(self, name: str, version: int) -> None:
        self.held[name] = version

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


def test_a_joiner_is_started_without_waiting_for_its_answer(caplog):
    """The start of a joiner that got its weights is sent, not awaited: an agent whose host dropped off just after
    its sync cannot hold the training loop for the RPC timeout (it did, for 300 s, in a namespace test under load);
    its answer, or the error in its place, is logged when it comes."""
    import logging
    import types

    import torch

    from asyncrl.rpc.param_server import CollectivePublisher

    answers: list[torch.futures.Future] = []

    class Server:
        def rpc_async(self, timeout):
            return self

        def start(self):
            answers.append(torch.futures.Future())
            return answers[-1]

    fleet = types.SimpleNamespace(get=lambda name: types.SimpleNamespace(server=Server()) if name == "agent1" else None)
    publisher = CollectivePublisher(fleet, FakeRoster({}), partial_rollout=True, timeout=300.0, bucket_mb=1,
                                    dtype=torch.float32, weights_fn=lambda state, dtype: [])
    with caplog.at_level(logging.INFO, logger="asyncrl.rpc.param_server"):
        publisher._start("agent1")
        publisher._start("gone")  # no longer in the fleet: nothing to send
        assert len(answers) == 1 and not answers[0].done()  # returned before the agent answered
        answers[0].set_exception(RuntimeError("connection reset"))
    assert "agent agent1 did not start: RuntimeError('connection reset')" in caplog.text


def test_a_sync_deferred_by_an_evaluation_is_recorded_when_it_ends_and_the_next_publication_waits_for_it():
    roster = FakeRoster({"agent0": 0.0})
    roster.evaluating_now = {"agent0"}
    runner = SyncRunner(roster, late_after_s=5.0, poll_s=0.001)
    results, late = runner.run({"agent0": lambda: 0.3}, version=1)
    assert results == [] and late == 0 and runner.deferred == {"agent0"} and roster.held == {}
    threading.Timer(0.2, lambda: setattr(roster, "evaluating_now", set())).start()
    runner.wait_deferred()  # the next publication's first step
    assert roster.held == {"agent0": 1}  # at once, not at the next settlement: it takes training prompts again
    assert runner.busy() == set()
    results, late = runner.run({"agent0": lambda: 0.1}, version=2)
    assert [(r.name, r.version) for r in results] == [("agent0", 2), ("agent0", 1)]  # the old one settles too
    assert runner.deferred == set() and roster.held == {"agent0": 2}
