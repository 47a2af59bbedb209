"""SampleQueue and Ledger (asyncrl.runtime.queue), without a model: admission under verl's budget, the carry-over at
a new version, oldest-first streaming, the lag cap (drop / wait), re-admission after an agent failure,
late submissions, the ledger's once-only endings, checkpoint round trip, and a random event simulation."""

from __future__ import annotations

import collections
import copy
import pickle
import random
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.algos.staleness import verl_max_required_samples
from asyncrl.runtime.queue import Ledger, QueueTimeout, SampleQueue, Task
from asyncrl.types import Completion, Group
from tests.rpc.helpers import make_prompt, source
from tests.timing import limit


def make_queue(max_required: int = 6, **kw) -> SampleQueue:
    return SampleQueue(source(), max_required_samples=max_required, **kw)


def group_of(task: Task, versions: list[int] | None = None) -> Group:
    """A finished group for `task`; its single completion has one token per entry of `versions` (default: two
    tokens at the admitted version)."""
    versions = [task.admitted_version] * 2 if versions is None else versions
    completion = Completion([4] * len(versions), [-1.0] * len(versions), list(versions), "length")
    return Group(prompt_id=task.prompt_id, prompt_ids=list(task.prompt.prompt_ids), completions=[completion],
                 rewards=[0.5], data_source="toy", admitted_version=task.admitted_version)


def outstanding(q: SampleQueue) -> int:
    s = q.ledger.summary()
    return s["in_flight"] + s["pending"] + s["queued"]


# ------------------------------------------------------------------------------------------- admission
@pytest.mark.parametrize("mini, require, s, trigger", [(2, 1, 0.0, 1), (4, 1, 0.5, 2), (3, 2, 0.25, 3), (2, 2, 1.0, 1),
                                                       (5, 1, 0.3, 1)])
def test_admission_never_exceeds_the_verl_window(mini, require, s, trigger):
    w = verl_max_required_samples(mini, require, s, trigger)
    q = make_queue(w)
    got = q.request("a0", 3) + q.request("a1", 10 * w) + q.request("a0", 5)
    assert len(got) == w
    assert [t.prompt_id for t in got] == list(range(w))
    assert q.budget.staleness_samples == w == q.peak_staleness_samples
    assert q.request("a2", 1) == []
    # finishing and training does not refund the window: only a new version does
    for t in got[:2]:
        q.submit(q.ledger.agent[t.prompt_id], group_of(t))
    q.trained(q.take(2, timeout=1))
    assert q.request("a0", 10) == []
    q.new_version(1)
    assert q.budget.staleness_samples == w - 2  # carried: everything still in flight
    fresh = q.request("a0", 10)
    assert len(fresh) == 2 and all(t.admitted_version == 1 for t in fresh)
    assert q.budget.staleness_samples == w and q.peak_staleness_samples == w


@given(st.lists(st.integers(0, 9), min_size=1, max_size=30), st.integers(1, 12))
def test_admission_in_any_request_sizes_fills_exactly_the_window(sizes, w):
    q = make_queue(w)
    total = 0
    for i, n in enumerate(sizes):
        got = q.request(f"a{i % 3}", n)
        assert len(got) <= n
        total += len(got)
        assert total <= w and q.budget.staleness_samples == total
    assert total == min(sum(sizes), w)


def test_new_version_carry_over_is_in_flight_plus_pending_plus_queued():
    q = make_queue(10)
    a = q.request("a0", 4)
    b = q.request("a1", 4)
    for t in a[:3]:
        q.submit("a0", group_of(t))          # 3 queued
    q.trained(q.take(1, timeout=1))          # 1 trained -> 2 queued
    q.agent_failed("a1")                     # 4 pending (re-admission)
    # in flight: a[3]; pending: b (4); queued: 2
    assert q.ledger.summary() == {"admitted": 8, "in_flight": 1, "pending": 4, "queued": 2, "trained": 1,
                                  "dropped": 0}
    q.new_version(1)
    assert q.version == 1
    assert q.budget.staleness_samples == 1 + 4 + 2 == outstanding(q)
    # the window now has room for exactly the rest
    got = q.request("a0", 100)
    assert len(got) == 4 + 3  # re-admitted first (outside the budget), then 3 new ones
    assert [t.prompt_id for t in got[:4]] == [t.prompt_id for t in b]
    assert q.budget.staleness_samples == 10


def test_a_filtered_group_gives_its_charge_back_to_the_window():
    """DAPO's dynamic sampling drops groups whose rewards are all equal; they are never trained, so each gives its
    admission back. Charging them would exhaust the window and starve the trainer until the take timeout."""
    q = make_queue(4)
    tasks = q.request("a0", 10)
    assert len(tasks) == 4 and not q.budget.can_admit
    for t in tasks:
        q.submit("a0", group_of(t))
    for g in q.take(3, timeout=1):
        q.drop(g, "filtered")
    assert q.budget.staleness_samples == 1 and len(q.request("a0", 10)) == 3
    q.drop(q.take(1, timeout=1)[0], "stale")  # other drops keep their charge (they ran under this window)
    assert q.budget.staleness_samples == 4 and q.ledger.counts["dropped/filtered"] == 3


def test_closed_queue_admits_nothing_new_but_hands_back_readmitted_prompts():
    q = make_queue(4)
    tasks = q.request("a0", 2)
    q.agent_failed("a0")
    q.close()
    got = q.request("a1", 10)
    assert [t.prompt_id for t in got] == [t.prompt_id for t in tasks]
    assert q.next_id == 2


def test_invalid_arguments_fail_loud():
    with pytest.raises(ValueError, match="max_required_samples"):
        make_queue(0)
    with pytest.raises(ValueError, match="lag_policy"):
        make_queue(4, lag_policy="skip")


# ------------------------------------------------------------------------------------------- streaming
def test_take_returns_oldest_version_first_then_arrival_order():
    q = make_queue(20)
    tasks = q.request("a0", 6)
    # arrival order with these oldest token versions (partial rollouts span versions)
    versions = [[2, 2], [0, 1], [1, 1], [0, 0], [2, 3], [1, 2]]
    q.version = 3
    for t, v in zip(tasks, versions):
        q.submit("a0", group_of(t, v))
    first = q.take(3, timeout=1)
    assert [g.prompt_id for g in first] == [1, 3, 2]  # versions 0, 0 (arrival order), then 1
    rest = q.take(3, timeout=1)
    assert [g.min_version for g in rest] == [1, 2, 2]
    assert [g.prompt_id for g in rest] == [5, 0, 4]
    # a later arrival at an old version still goes first
    more = q.request("a0", 2)
    q.submit("a0", group_of(more[0], [3]))
    q.submit("a0", group_of(more[1], [0, 3]))
    assert [g.prompt_id for g in q.take(2, timeout=1)] == [more[1].prompt_id, more[0].prompt_id]


def test_take_blocks_until_enough_groups_then_times_out_cleanly():
    q = make_queue(8)
    tasks = q.request("a0", 3)
    q.submit("a0", group_of(tasks[0]))
    start = time.monotonic()
    with pytest.raises(QueueTimeout, match=r"waited \d+\.\d s for 2 groups, have 1 \(in flight 2\)") as err:
        q.take(2, timeout=0.3)  # the time it really waited, not the timeout rounded ("waited 0 s")
    assert (err.value.have, err.value.in_flight) == (1, 2)
    assert 0.25 < time.monotonic() - start < limit(3)
    assert len(q.queue) == 1 and q.ledger.state[0] == "queued"  # nothing lost by the timeout

    def later():
        time.sleep(0.2)
        q.submit("a0", group_of(tasks[1]))

    threading.Thread(target=later).start()
    got = q.take(2, timeout=limit(10))
    assert sorted(g.prompt_id for g in got) == [0, 1]


def test_lag_cap_drop_marks_groups_dropped_stale():
    q = make_queue(20, max_version_lag=1, lag_policy="drop")
    tasks = q.request("a0", 5)
    q.version = 3
    versions = [[0, 0], [1, 3], [2, 2], [3, 3], [1, 2]]  # lags at version 3: 3, 2, 1, 0, 2
    for t, v in zip(tasks, versions):
        q.submit("a0", group_of(t, v))
    got = q.take(2, timeout=1)
    assert [g.prompt_id for g in got] == [2, 3]
    assert all(q.version - g.min_version <= 1 for g in got)
    for pid in (0, 1, 4):
        assert q.ledger.state[pid] == "dropped" and q.ledger.dropped[pid] == "stale"
    assert q.ledger.counts["dropped/stale"] == 3
    assert q.queue == []
    # a drop happens at dequeue only, never to in-flight work: a group over the cap waiting for more groups
    more = q.request("a0", 2)
    q.submit("a0", group_of(more[0], [3]))
    q.new_version(5)  # now lag 2 > 1
    with pytest.raises(QueueTimeout):
        q.take(1, timeout=0.05)
    assert q.ledger.dropped[more[0].prompt_id] == "stale"
    assert q.ledger.state[more[1].prompt_id] == "in_flight"


def test_lag_policy_wait_never_drops_and_gates_publication():
    q = make_queue(20, max_version_lag=1, lag_policy="wait")
    assert q.lag_gate_open(5)  # nothing outstanding
    early = q.request("a0", 1)[0]  # admitted at version 0
    q.new_version(1)
    late = q.request("a0", 1)[0]  # admitted at version 1
    assert q.oldest_version() == 0
    assert q.lag_gate_open(1) and not q.lag_gate_open(2)  # publishing 2 would put `early` at lag 2
    q.submit("a0", group_of(early, [0, 1]))  # queued groups count too (by their oldest token)
    assert not q.lag_gate_open(2)
    q.version = 4
    got = q.take(1, timeout=1)  # over the cap, but "wait" never drops
    assert got[0].prompt_id == early.prompt_id and q.ledger.counts["dropped/stale"] == 0
    q.trained(got)
    assert q.oldest_version() == 1 and q.lag_gate_open(2) and not q.lag_gate_open(3)
    q.submit("a0", group_of(late))
    q.trained(q.take(1, timeout=1))
    assert q.oldest_version() is None and q.lag_gate_open(100)
    # the gate is always open without a cap or with the drop policy
    for kw in ({}, {"max_version_lag": 0, "lag_policy": "drop"}):
        other = make_queue(4, **kw)
        other.request("a0", 1)
        assert other.lag_gate_open(50)


# --------------------------------------------------------------------------------------- agent failures

def test_a_drift_cap_gates_publication_like_wait_and_the_tighter_cap_wins():
    q = make_queue(20, max_version_lag=3, lag_policy="drop")  # a drop cap never gates
    early = q.request("a0", 1)[0]  # admitted at version 0
    assert q.lag_gate_open(3)
    q.set_drift_cap(2)
    assert q.lag_gate_open(2) and not q.lag_gate_open(3)
    q.set_drift_cap(None)
    assert q.lag_gate_open(3)
    held = make_queue(20, max_version_lag=3, lag_policy="wait")
    held.request("a0", 1)
    held.set_drift_cap(1)
    assert held.lag_gate_open(1) and not held.lag_gate_open(2)  # the drift cap is the tighter
    held.set_drift_cap(5)
    assert held.lag_gate_open(3) and not held.lag_gate_open(4)  # the wait cap is
    with pytest.raises(ValueError, match="drift cap must be >= 1"):
        q.set_drift_cap(0)
    q.submit("a0", group_of(early))
    q.trained(q.take(1, timeout=1))
    assert q.lag_gate_open(100)

def test_agent_failed_readmits_with_the_same_id_and_seed():
    q = make_queue(6, seed=7)
    mine = q.request("a0", 3)
    theirs = q.request("a1", 2)
    q.submit("a0", group_of(mine[0]))
    q.new_version(1)
    ids = q.agent_failed("a0")
    assert sorted(ids) == [mine[1].prompt_id, mine[2].prompt_id]  # the queued one stays queued
    assert all(q.ledger.state[pid] == "pending" for pid in ids)
    assert q.ledger.state[theirs[0].prompt_id] == "in_flight"
    staleness = q.budget.staleness_samples
    again = q.request("a1", 2)
    assert [t.prompt_id for t in again] == ids
    for old, new in zip(mine[1:], again):
        assert new.seed == old.seed and new.prompt == old.prompt
        assert new.admitted_version == 1  # restarted under the current weights
    assert q.budget.staleness_samples == staleness  # charged once, when first admitted
    assert all(q.ledger.agent[pid] == "a1" and q.ledger.state[pid] == "in_flight" for pid in ids)
    assert q.ledger.counts["readmitted"] == 2 and q.ledger.counts["admissions"] == 5 + 2
    # seeds are distinct per id and depend on the queue seed
    seeds = [t.seed for t in mine + theirs]
    assert len(set(seeds)) == len(seeds)
    assert make_queue(6, seed=8).request("a0", 1)[0].seed != mine[0].seed


def test_late_submission_from_a_dead_agent_is_ignored():
    q = make_queue(6)
    task = q.request("a0", 1)[0]
    q.agent_failed("a0")
    # before re-admission (pending) ...
    q.submit("a0", group_of(task))
    assert q.ledger.state[task.prompt_id] == "pending" and q.queue == []
    # ... and after it went to another agent
    again = q.request("a1", 1)[0]
    q.submit("a0", group_of(task))
    assert q.ledger.state[task.prompt_id] == "in_flight" and q.queue == []
    assert q.ledger.counts["late_submissions"] == 2
    q.submit("a1", group_of(again))
    assert q.ledger.state[task.prompt_id] == "queued"
    # a second submission of the same id (duplicate delivery) is ignored too
    q.submit("a1", group_of(again))
    assert len(q.queue) == 1 and q.ledger.counts["late_submissions"] == 3
    q.trained(q.take(1, timeout=1))
    assert q.ledger.summary()["trained"] == 1


def test_submission_of_an_unknown_id_is_ignored():
    q = make_queue(4)
    q.submit("a0", Group(prompt_id=99, prompt_ids=[5], completions=[Completion([4], [-1.0], [0], "stop")],
                         rewards=[1.0]))
    assert q.queue == [] and 99 not in q.ledger.state


# --------------------------------------------------------------------------------------------- ledger
def test_ledger_forbids_ending_a_prompt_twice():
    ledger = Ledger()
    ledger.admit(0, "a0")
    ledger.queued(0)
    ledger.trained(0)
    with pytest.raises(RuntimeError, match="prompt 0"):
        ledger.trained(0)
    with pytest.raises(RuntimeError, match="prompt 0"):
        ledger.drop(0, "stale")
    with pytest.raises(RuntimeError):
        ledger.admit(0, "a1")
    ledger.admit(1, "a0")
    ledger.drop(1, "run_end")
    for end in (ledger.trained, lambda pid: ledger.drop(pid, "filtered"), ledger.queued):
        with pytest.raises(RuntimeError, match="prompt 1"):
            end(1)
    with pytest.raises(RuntimeError):  # trained without having been queued
        ledger.admit(2, "a0")
        ledger.trained(2)
    assert ledger.summary() == {"admitted": 3, "in_flight": 1, "pending": 0, "queued": 0, "trained": 1,
                                "dropped": 1, "dropped/run_end": 1}


def test_queue_rejects_training_or_dropping_a_group_twice():
    q = make_queue(4)
    t = q.request("a0", 2)
    q.submit("a0", group_of(t[0]))
    q.submit("a0", group_of(t[1]))
    g0, g1 = q.take(2, timeout=1)
    q.trained([g0])
    with pytest.raises(RuntimeError):
        q.trained([g0])
    q.drop(g1, "filtered")
    with pytest.raises(RuntimeError):
        q.drop(g1, "filtered")
    with pytest.raises(RuntimeError):
        q.trained([g1])


# ---------------------------------------------------------------------------------------- checkpoints
def test_state_dict_round_trip_restores_queued_and_readmits_unfinished():
    q = make_queue(8, seed=3, max_version_lag=2)
    tasks = q.request("a0", 4) + q.request("a1", 3)
    q.submit("a0", group_of(tasks[0]))
    q.submit("a1", group_of(tasks[5]))
    q.submit("a0", group_of(tasks[1]))
    q.trained(q.take(1, timeout=1))  # tasks[0]
    q.agent_failed("a1")  # tasks[4], tasks[6] pending
    q.new_version(1)
    state = pickle.loads(pickle.dumps(q.state_dict()))  # what a checkpoint stores must pickle

    r = make_queue(8, seed=3, max_version_lag=2)
    r.load_state_dict(state)
    assert r.version == 1 and r.next_id == 7 and r.source.index == 7
    assert tuple(r.budget) == tuple(q.budget)
    assert [g.prompt_id for g in r.queue] == [g.prompt_id for g in q.queue] == [5, 1]
    assert r.ledger.counts == q.ledger.counts
    unfinished = {2, 3, 4, 6}
    assert set(r.ledger.ids("pending")) == unfinished and r.ledger.ids("in_flight") == []
    assert r.ledger.ids("trained") == [0] and set(r.ledger.ids("queued")) == {1, 5}
    # unfinished prompts are re-admitted first, with their ids and seeds; new ids continue the count
    got = r.request("a2", 10)
    assert sorted(t.prompt_id for t in got[:4]) == sorted(unfinished)
    seeds = {t.prompt_id: t.seed for t in tasks}
    assert all(t.seed == seeds[t.prompt_id] and t.prompt == make_prompt(t.prompt_id) for t in got[:4])
    assert [t.prompt_id for t in got[4:]] == list(range(7, 7 + len(got) - 4))
    assert all(t.prompt == make_prompt(t.prompt_id) for t in got)  # the source cursor continued
    assert r.budget.staleness_samples <= r.budget.max_required_samples
    # the restored queue finishes the books
    for t in got:
        r.submit("a2", group_of(t))
    r.trained(r.take(len(r.queue), timeout=1))
    s = r.ledger.summary()
    assert s["admitted"] == s["trained"] == 7 + len(got) - 4
    # the original is untouched by the copy
    assert q.ledger.state[2] == "in_flight" and q.ledger.state[4] == "pending"


# ------------------------------------------------------------------------------------------ simulation
AGENTS = ("a0", "a1", "a2")


class _Simulation:
    """Random agents and a trainer driving one SampleQueue; `check()` is the invariant after every event."""

    def __init__(self, data):
        mini, require, trigger = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
        s = data.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]))
        self.cap = data.draw(st.sampled_from([None, 0, 1, 2]))
        self.policy = data.draw(st.sampled_from(["drop", "wait"])) if self.cap is not None else "drop"
        self.w = verl_max_required_samples(mini, require, s, trigger)
        self.q = make_queue(self.w, max_version_lag=self.cap, lag_policy=self.policy, seed=data.draw(st.integers(0, 5)))
        self.rng = random.Random(data.draw(st.integers(0, 2**16)))
        self.alive = list(AGENTS)
        self.holding: dict[str, list[Task]] = collections.defaultdict(list)
        self.dead_holding: list[tuple[str, Task]] = []
        self.first_seed: dict[int, int] = {}
        self.ended: list[tuple[int, str]] = []  # (id, how), as the simulation saw it

    def finished_group(self, task: Task) -> Group:
        # a partial rollout: tokens from the admission version up to the current one
        versions = sorted(self.rng.randint(task.admitted_version, self.q.version) for _ in range(self.rng.randint(1, 3)))
        return group_of(task, versions)

    def request(self) -> None:
        agent = self.rng.choice(self.alive)
        for task in self.q.request(agent, self.rng.randint(1, 4)):
            assert self.q.ledger.state[task.prompt_id] == "in_flight" and self.q.ledger.agent[task.prompt_id] == agent
            assert self.first_seed.setdefault(task.prompt_id, task.seed) == task.seed
            assert task.admitted_version == self.q.version
            self.holding[agent].append(task)

    def finish(self) -> None:
        busy = [a for a in self.alive if self.holding[a]]
        if busy:
            agent = self.rng.choice(busy)
            task = self.holding[agent].pop(self.rng.randrange(len(self.holding[agent])))
            self.q.submit(agent, self.finished_group(task))
            assert self.q.ledger.state[task.prompt_id] == "queued"

    def consume(self, n: int | None = None) -> None:
        q, before = self.q, set(self.q.ledger.ids("dropped"))
        try:
            groups = q.take(n or self.rng.randint(1, 3), timeout=0)
        except QueueTimeout:
            groups = []
        self.ended.extend((pid, "stale") for pid in set(q.ledger.ids("dropped")) - before)
        assert [g.min_version for g in groups] == sorted(g.min_version for g in groups)
        if self.cap is not None and self.policy == "drop":
            assert all(q.version - g.min_version <= self.cap for g in groups)
        keep = []
        for g in groups:
            if self.rng.random() < 0.15:
                q.drop(g, "filtered")
                self.ended.append((g.prompt_id, "filtered"))
            else:
                keep.append(g)
        q.trained(keep)
        self.ended.extend((g.prompt_id, "trained") for g in keep)

    def publish(self) -> None:
        nxt = self.q.version + 1
        if self.q.lag_gate_open(nxt):
            self.q.new_version(nxt)
        else:
            assert self.policy == "wait"
            self.q.new_version(self.q.version)  # the controller's held-back publication: a new window, same version
        assert self.q.budget.staleness_samples == outstanding(self.q)

    def fail(self) -> None:
        if len(self.alive) > 1:
            agent = self.rng.choice(self.alive)
            ids = self.q.agent_failed(agent)
            assert sorted(ids) == sorted(t.prompt_id for t in self.holding[agent])
            self.dead_holding.extend((agent, t) for t in self.holding.pop(agent, []))
            self.alive.remove(agent)

    def late(self) -> None:
        if self.dead_holding:
            agent, task = self.rng.choice(self.dead_holding)
            state, late = dict(self.q.ledger.state), self.q.ledger.counts["late_submissions"]
            self.q.submit(agent, self.finished_group(task))
            assert self.q.ledger.state == state and self.q.ledger.counts["late_submissions"] == late + 1

    def check(self) -> None:
        q = self.q
        assert q.budget.staleness_samples <= self.w
        assert q.peak_staleness_samples <= self.w
        summary = q.ledger.summary()
        assert summary["in_flight"] == sum(len(v) for a, v in self.holding.items() if a in self.alive)
        assert summary["queued"] == len(q.queue)
        assert summary["pending"] == len(q.readmit)
        assert set(q.tasks) == set(q.ledger.ids("in_flight")) | set(q.ledger.ids("pending"))

    def close_books(self) -> int:
        """Admit nothing new, let the live agents finish (re-admitted work included), train; return next_id."""
        q = self.q
        q.close()
        next_id = q.next_id
        for _ in range(10):
            for agent in self.alive:
                self.holding[agent].extend(q.request(agent, 100))
                for task in self.holding.pop(agent, []):
                    q.submit(agent, self.finished_group(task))
            if q.queue:
                self.consume(len(q.queue))
            self.check()
            if outstanding(q) == 0:
                break
        assert q.next_id == next_id
        return next_id


@given(st.data())
def test_random_event_simulation_keeps_budget_and_books(data):
    sim = _Simulation(data)
    events = {"request": sim.request, "finish": sim.finish, "consume": sim.consume, "publish": sim.publish,
              "fail": sim.fail, "late": sim.late}
    for _ in range(data.draw(st.integers(0, 60))):
        events[data.draw(st.sampled_from(["request", "finish", "finish", "consume", "publish", "fail", "late"]))]()
        sim.check()
    next_id = sim.close_books()
    q = sim.q
    summary = q.ledger.summary()
    assert summary["admitted"] == summary["trained"] + summary["dropped"] == next_id
    counted = collections.Counter(pid for pid, _ in sim.ended)
    assert set(counted) == set(range(next_id)) and set(counted.values()) <= {1}
    assert {pid for pid, how in sim.ended if how == "trained"} == set(q.ledger.ids("trained"))
    assert {pid: how for pid, how in sim.ended if how != "trained"} == q.ledger.dropped
    assert q.ledger.counts["trained"] == summary["trained"]
    if sim.cap is None or sim.policy == "wait":
        assert "stale" not in q.ledger.dropped.values()
    assert copy.deepcopy(q.state_dict())["unfinished"] == []


def test_a_checkpoint_leaves_moe_routes_out_and_the_restored_group_has_none():
    """Routes travel with a sample to the learner, never into a checkpoint (JSON-able, and a resumed learner routes
    those samples itself)."""
    import dataclasses
    import json

    import numpy as np
    q = make_queue(4)
    (t,) = q.request("a0", 1)
    group = group_of(t)
    routed = [dataclasses.replace(c, routes=np.zeros((3, 2, 2), dtype=np.int16)) for c in group.completions]
    q.submit("a0", dataclasses.replace(group, completions=routed))
    state = json.loads(json.dumps(q.state_dict()))
    assert q.queue[0].completions[0].routes is not None  # the live group keeps them
    r = make_queue(4)
    r.load_state_dict(state)
    assert [c.routes for c in r.queue[0].completions] == [None] * len(routed)
