"""The roster (asyncrl.runtime.roster): membership, liveness on its own clock, fencing of agents declared dead, and
the books it keeps per agent. A fake clock makes the liveness rules exact; one test runs the real thread."""

from __future__ import annotations

import time

import pytest

from asyncrl.runtime.queue import SampleQueue
from asyncrl.runtime.roster import Fenced, Roster
from asyncrl.types import Completion, Group, GroupInfo, Prompt
from tests.timing import limit


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Source:
    def __init__(self):
        self.index = 0

    def next(self) -> Prompt:
        self.index += 1
        return Prompt([1, 2, self.index % 50], data_source="toy", index=self.index)

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


def group_for(task, agent: str = "") -> Group:
    c = Completion([5, 6], [-0.1, -0.2], [0, 0], "stop")
    return Group(task.prompt_id, task.prompt.prompt_ids, [c], [1.0], admitted_version=task.admitted_version,
                 info=GroupInfo(agent=agent))


def make(timeout: float = 10.0, **kw):
    clock = FakeClock()
    removed = []
    queue = SampleQueue(Source(), max_required_samples=8)
    roster = Roster(queue, agent_timeout_s=timeout, clock=clock,
                    on_removed=lambda name, status, why: removed.append((name, status, why)), **kw)
    return roster, queue, clock, removed


def test_a_silent_agent_is_declared_dead_exactly_after_the_timeout():
    roster, queue, clock, removed = make(timeout=10.0)
    roster.add("a", live=True)
    roster.add("b", live=True)
    clock.advance(6.0)
    roster.heartbeat("a")
    assert roster.check() == []  # b has been silent 6 s
    clock.advance(4.0)
    assert roster.check() == []  # exactly at the timeout: not yet
    clock.advance(0.5)
    assert roster.check() == ["b"]  # 10.5 s > 10 s
    assert roster.live() == ["a"] and roster.dead() == ["b"]
    assert removed == [("b", "dead", "silent for 10.5 s (agent_timeout_s=10)")]
    assert roster.check() == []  # declared once


def test_a_dead_agent_is_fenced_and_its_prompts_go_to_the_others():
    roster, queue, clock, removed = make()
    roster.add("a", live=True)
    roster.add("b", live=True)
    held = roster.request("b", 2)
    assert [t.prompt_id for t in held] == [0, 1]
    assert roster.declare_dead("b", "test")
    assert not roster.declare_dead("b", "again")  # once
    # its prompts are back for re-admission, same ids, and go to the live agent first
    assert [t.prompt_id for t in roster.request("a", 2)] == [0, 1]
    # everything from b is refused from now on; its late delivery never reaches the queue
    for call in (lambda: roster.request("b", 1), lambda: roster.heartbeat("b"),
                 lambda: roster.submit("b", group_for(held[0], "b"))):
        with pytest.raises(Fenced, match="agent b is dead \\(test\\)"):
            call()
    assert roster.counts["fenced_submissions"] == 1 and roster.counts["fenced_requests"] == 1
    assert queue.queue == [] and queue.ledger.state[0] == "in_flight" and queue.ledger.agent[0] == "a"
    roster.submit("a", group_for(held[0], "a"))
    assert queue.ledger.state[0] == "queued"
    assert roster.metrics()["fully_async/count/fenced_submissions"] == 1


def test_an_unknown_agent_is_refused():
    roster, *_ = make()
    with pytest.raises(Fenced, match="unknown"):
        roster.heartbeat("ghost")


def test_a_joining_agent_gets_no_prompts_before_its_weights_and_is_not_watched():
    roster, queue, clock, removed = make(timeout=10.0)
    roster.add("a", live=True)
    roster.add("new")
    assert roster.joining() == ["new"] and roster.request("new", 4) == []
    clock.advance(60.0)
    roster.heartbeat("a")
    assert roster.check() == []  # waiting for a publication is not silence
    assert roster.activate("new") and roster.live() == ["a", "new"]
    assert len(roster.request("new", 4)) == 4  # budget 8, two live agents: a share of ceil(8 / 2) = 4
    assert roster.request("new", 4) == []
    assert not roster.activate("new")  # only a joining agent can be activated


def test_the_last_agent_dying_is_fatal_unless_restarts_may_bring_one_back():
    roster, *_ = make()
    roster.add("a", live=True)
    roster.declare_dead("a", "crashed")
    assert isinstance(roster.fatal, RuntimeError) and "every rollout agent is dead (last: a, crashed)" in str(roster.fatal)
    roster, *_ = make(allow_empty=True)
    roster.add("a", live=True)
    roster.declare_dead("a", "crashed")
    assert roster.fatal is None
    roster, *_ = make()
    roster.add("a", live=True)
    roster.leave("a", "run ended", readmit=False)  # leaving is not dying
    assert roster.fatal is None


def test_leaving_readmits_unfinished_prompts_unless_the_run_ends():
    roster, queue, clock, removed = make()
    roster.add("a", live=True)
    roster.add("b", live=True)
    roster.request("a", 2)
    roster.request("b", 2)
    roster.leave("a", "SIGTERM received")
    assert [queue.ledger.state[p] for p in (0, 1)] == ["pending", "pending"]
    roster.leave("b", "run ended", readmit=False)
    assert [queue.ledger.state[p] for p in (2, 3)] == ["in_flight", "in_flight"]  # the end of the run drops them
    assert [r[:2] for r in removed] == [("a", "left"), ("b", "left")]
    with pytest.raises(Fenced, match="left"):
        roster.request("a", 1)


def test_the_report_tells_each_agents_versions_and_deliveries():
    roster, queue, clock, removed = make()
    roster.add("a", live=True, device="cpu", pid=11)
    roster.synced("a", 0)
    task = roster.request("a", 1)[0]
    roster.submit("a", group_for(task, "a"))
    roster.synced("a", 1)
    roster.synced("a", 2)
    report = roster.report()["a"]
    assert report == {"status": "live", "device": "cpu", "pid": 11, "why": "", "first_version": 0,
                      "last_version": 2, "submitted": 1}


def test_the_liveness_thread_declares_a_silent_agent_dead_whatever_the_trainer_does():
    queue = SampleQueue(Source(), max_required_samples=8)
    roster = Roster(queue, agent_timeout_s=0.5, check_every_s=0.05)
    roster.add("a", live=True)
    roster.start()
    try:
        deadline = time.monotonic() + limit(10)
        while roster.is_live("a") and time.monotonic() < deadline:
            time.sleep(0.05)  # nobody calls check(): the roster's own thread does
        assert roster.dead() == ["a"]
    finally:
        roster.stop()


def test_an_agent_a_publication_has_not_reached_gets_no_training_prompts_until_it_has():
    roster, queue, clock, removed = make()
    roster.add("a", live=True)
    roster.synced("a", 0)
    queue.new_version(1)
    assert roster.request("a", 4) == []  # sampled under version 0, they would be stamped 1
    roster.synced("a", 1)
    assert [t.admitted_version for t in roster.request("a", 4)] == [1] * 4
    roster.synced("a", 0)  # an older sync settled later: the agent still holds 1
    assert roster.report()["a"]["last_version"] == 1
