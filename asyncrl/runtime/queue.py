"""The sample queue: admission under the staleness budget, streaming of finished groups, and the ledger
that accounts for every prompt id from admission to trained or dropped.

Life of a prompt id here:
  `request(agent, n)`   admits up to n prompts within the verl budget (re-admitted ones first), stamps each
                        with the current version and a seed, records it *in flight* on that agent;
  `submit(agent, g)`    the finished group is *queued*;
  `take(n)`             hands the trainer the n oldest queued groups (by weight version); with
                        `max_version_lag` and `lag_policy="drop"`, groups over the cap are *dropped("stale")*;
  `trained(groups)`     ends them; `drop(group, reason)` ends one otherwise (e.g. "filtered");
  `agent_failed(agent)` puts its in-flight prompts back for re-admission (same id, same seed).
`new_version(v)` restarts the budget window at (in flight + queued), verl's carry-over rule.

Thread-safe: RPC handler threads (agents) and the trainer thread share it under one lock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Literal

from asyncrl.algos.staleness import VerlBudget, verl_admit, verl_on_new_version, verl_release
from asyncrl.data.sources import PromptSource
from asyncrl.tools.seeding import derive_seed
from asyncrl.types import Completion, Group, GroupInfo, Prompt

__all__ = ["Task", "Ledger", "SampleQueue", "QueueTimeout"]


class QueueTimeout(TimeoutError):
    """The trainer waited longer than its timeout for groups (every agent idle, dead or too slow). `have`: the
    groups queued then; `in_flight`: the prompts agents held then."""

    def __init__(self, message: str, *, have: int = 0, in_flight: int = 0):
        super().__init__(message)
        self.have, self.in_flight = have, in_flight


@dataclasses.dataclass
class Task:
    """An admitted prompt, as handed to an agent."""

    prompt_id: int
    prompt: Prompt
    admitted_version: int
    seed: int


class Ledger:
    """Where every prompt id is: in_flight(agent) → queued → trained | dropped(reason). Each id ends once."""

    def __init__(self):
        self.state: dict[int, str] = {}
        self.agent: dict[int, str] = {}
        self.dropped: dict[int, str] = {}
        self.counts = collections.Counter()
        self.in_flight = collections.Counter()  # agent -> prompts it holds now

    def _move(self, pid: int, expect: tuple[str, ...], to: str) -> None:
        now = self.state.get(pid)
        if now not in expect:
            raise RuntimeError(f"prompt {pid}: cannot go from {now!r} to {to!r} (expected {' or '.join(map(str, expect))}); "
                               "a prompt was delivered twice or after it ended")
        if now == "in_flight":
            self.in_flight[self.agent[pid]] -= 1
        self.state[pid] = to

    def admit(self, pid: int, agent: str) -> None:
        self._move(pid, (None, "pending"), "in_flight")
        self.agent[pid] = agent
        self.in_flight[agent] += 1
        self.counts["admissions"] += 1

    def pending(self, pid: int) -> None:  # back from a failed agent, waiting for re-admission
        self._move(pid, ("in_flight",), "pending")
        self.counts["readmitted"] += 1

    def queued(self, pid: int) -> None:
        self._move(pid, ("in_flight",), "queued")

    def trained(self, pid: int) -> None:
        self._move(pid, ("queued",), "trained")
        self.counts["trained"] += 1

    def drop(self, pid: int, reason: str) -> None:
        self._move(pid, ("queued", "in_flight", "pending"), "dropped")
        self.dropped[pid] = reason
        self.counts[f"dropped/{reason}"] += 1

    def ids(self, state: str) -> list[int]:
        return [pid for pid, s in self.state.items() if s == state]

    def summary(self) -> dict[str, int]:
        """Prompts per state, and per drop reason (`dropped/<reason>`)."""
        by_state = collections.Counter(self.state.values())
        reasons = collections.Counter(self.dropped.values())
        return {"admitted": len(self.state), **{k: by_state.get(k, 0) for k in
                                                ("in_flight", "pending", "queued", "trained", "dropped")},
                **{f"dropped/{reason}": n for reason, n in sorted(reasons.items())}}


class SampleQueue:
    """Admission control, the queue of finished groups, and the ledger (one lock for all three)."""

    def __init__(self, source: PromptSource, *, max_required_samples: int, version: int = 0, seed: int = 0,
                 max_version_lag: int | None = None, lag_policy: Literal["drop", "wait"] = "drop"):
        if max_required_samples < 1:
            raise ValueError(f"SampleQueue: max_required_samples must be >= 1, got {max_required_samples}")
        if lag_policy not in ("drop", "wait"):
            raise ValueError(f"SampleQueue: lag_policy={lag_policy!r} is not 'drop' or 'wait'")
        self.source, self.seed = source, seed
        self.budget = VerlBudget(max_required_samples)
        self.version = version
        self.max_version_lag, self.lag_policy = max_version_lag, lag_policy
        self.drift_cap: int | None = None  # the drift budget's lag cap (`set_drift_cap`), held like lag_policy wait
        self.ledger = Ledger()
        self.next_id = 0
        self.tasks: dict[int, Task] = {}  # admitted, not yet finished (in flight or pending re-admission)
        self.readmit: collections.deque[int] = collections.deque()
        self.queue: list[Group] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.peak_staleness_samples = 0
        self.closed = False

    # ----------------------------------------------------------------------------------- agents
    def request(self, agent: str, n: int, *, share: int | None = None) -> list[Task]:
        """Admit up to `n` prompts for `agent` within the budget (re-admitted prompts first, outside it:
        they were charged when first admitted). `share` caps what the agent may hold at once, so that one
        agent cannot take a whole version's budget while the others idle."""
        with self.lock:
            if share is not None:
                n = min(n, share - self.ledger.in_flight[agent])
            out: list[Task] = []
            while self.readmit and len(out) < n:
                task = self.tasks[self.readmit.popleft()]
                task = dataclasses.replace(task, admitted_version=self.version)
                self.tasks[task.prompt_id] = task
                self.ledger.admit(task.prompt_id, agent)
                out.append(task)
            while len(out) < n and self.budget.can_admit and not self.closed:
                pid = self.next_id
                self.next_id += 1
                task = Task(pid, self.source.next(), self.version, seed=derive_seed(self.seed, pid))
                self.budget = verl_admit(self.budget)
                self.peak_staleness_samples = max(self.peak_staleness_samples, self.budget.staleness_samples)
                self.tasks[pid] = task
                self.ledger.admit(pid, agent)
                out.append(task)
            return out

    def submit(self, agent: str, group: Group) -> None:
        """A finished group from `agent`."""
        with self.changed:
            if self.ledger.agent.get(group.prompt_id) != agent or self.ledger.state.get(group.prompt_id) != "in_flight":
                # a late answer from an agent declared dead (its prompt was re-admitted elsewhere): ignore
                self.ledger.counts["late_submissions"] += 1
                return
            self.ledger.queued(group.prompt_id)
            self.tasks.pop(group.prompt_id, None)
            self.queue.append(group)
            self.changed.notify_all()

    def agent_failed(self, agent: str) -> list[int]:
        """Put every prompt in flight on `agent` back for re-admission; return their ids."""
        with self.changed:
            ids = [pid for pid in self.ledger.ids("in_flight") if self.ledger.agent.get(pid) == agent]
            for pid in ids:
                self.ledger.pending(pid)
                self.readmit.append(pid)
            self.changed.notify_all()
            return ids

    # ----------------------------------------------------------------------------------- trainer
    def take(self, n: int, *, timeout: float, should_stop=lambda: False) -> list[Group]:
        """The `n` oldest queued groups (by min token version, then arrival). Blocks until there are n;
        drops groups over `max_version_lag` when lag_policy is "drop". Raises QueueTimeout."""
        start = time.monotonic()
        deadline = start + timeout
        with self.changed:
            while True:
                self._drop_stale()
                if len(self.queue) >= n:
                    self.queue.sort(key=lambda g: g.min_version)  # stable: arrival order within a version
                    out, self.queue = self.queue[:n], self.queue[n:]
                    return out
                left = deadline - time.monotonic()
                if left <= 0 or should_stop():
                    in_flight = len(self.ledger.ids("in_flight"))
                    raise QueueTimeout(f"waited {time.monotonic() - start:.1f} s for {n} groups, have "
                                       f"{len(self.queue)} (in flight {in_flight}); agents may be dead, idle on an "
                                       "exhausted budget, or slower than the timeout",
                                       have=len(self.queue), in_flight=in_flight)
                self.changed.wait(min(left, 0.5))

    def _drop_stale(self) -> None:
        if self.max_version_lag is None or self.lag_policy != "drop":
            return
        keep = []
        for g in self.queue:
            if self.version - g.min_version > self.max_version_lag:
                self.ledger.drop(g.prompt_id, "stale")
            else:
                keep.append(g)
        self.queue = keep

    def put_back(self, groups: list[Group]) -> None:
        """Return groups taken but not trained (a step abandoned at a stop) to the queue."""
        with self.changed:
            self.queue = list(groups) + self.queue
            self.changed.notify_all()

    def trained(self, groups: list[Group]) -> None:
        with self.lock:
            for g in groups:
                self.ledger.trained(g.prompt_id)

    def drop(self, group: Group, reason: str) -> None:
        with self.changed:
            self.ledger.drop(group.prompt_id, reason)
            if reason == "filtered":  # never trained: its charge goes back to the window, or dynamic sampling
                # (which may drop most groups) would exhaust the budget and starve the trainer until the timeout
                self.budget = verl_release(self.budget)
                self.changed.notify_all()

    def oldest_version(self) -> int | None:
        """Oldest version among queued groups and in-flight prompts (None when there are none)."""
        with self.lock:
            versions = [g.min_version for g in self.queue] + [t.admitted_version for t in self.tasks.values()]
            return min(versions) if versions else None

    def set_drift_cap(self, cap: int | None) -> None:
        """The drift budget's lag cap (`asyncrl.algos.drift_lag_cap`; None: none), held at publication as
        lag_policy "wait" holds `max_version_lag`."""
        if cap is not None and cap < 1:
            raise ValueError(f"SampleQueue: a drift cap must be >= 1 (a cap of 0 could never publish), got {cap}")
        with self.lock:
            self.drift_cap = cap

    def lag_gate_open(self, next_version: int) -> bool:
        """May the trainer publish `next_version` without pushing queued or in-flight work over a held cap
        (`max_version_lag` with lag_policy "wait", the drift cap)?"""
        caps = [cap for cap in (self.max_version_lag if self.lag_policy == "wait" else None, self.drift_cap)
                if cap is not None]
        if not caps:
            return True
        oldest = self.oldest_version()
        return oldest is None or next_version - oldest <= min(caps)

    def new_version(self, version: int) -> None:
        """A weight version was published: restart the budget window with the carry-over."""
        with self.changed:
            self.version = version
            in_flight = len(self.ledger.ids("in_flight")) + len(self.readmit)
            self.budget = verl_on_new_version(self.budget, in_flight=in_flight, queued=len(self.queue))
            self.changed.notify_all()

    def close(self) -> None:
        """Admit nothing more (end of run)."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def drop_unfinished(self, reason: str) -> dict:
        """Drop every prompt not trained yet (queued, in flight, pending) with `reason`; returns the ledger
        summary."""
        with self.lock:
            for pid in self.ledger.ids("queued") + self.ledger.ids("in_flight") + self.ledger.ids("pending"):
                self.ledger.drop(pid, reason)
            self.queue.clear()
            return self.ledger.summary()

    # ----------------------------------------------------------------------------------- state
    def metrics(self) -> dict:
        with self.lock:
            return {
                "fully_async/count/staleness_samples": self.budget.staleness_samples,
                "fully_async/static/max_required_samples": self.budget.max_required_samples,
                "fully_async/count/current_param_version": self.version,
                "fully_async/monitor/queue/mq_queue_size": len(self.queue),
                "fully_async/monitor/in_flight": len(self.ledger.ids("in_flight")),
                **{f"fully_async/count/{k}": v for k, v in self.ledger.counts.items()},
            }

    def state_dict(self) -> dict:
        """What a checkpoint needs, as JSON-able data: the cursor, queued groups, unfinished prompts (re-admitted
        on resume), counters and the ledger."""
        with self.lock:
            unfinished = [self.tasks[pid] for pid in sorted(self.tasks)]
            return {"source": self.source.state_dict(), "next_id": self.next_id, "version": self.version,
                    "budget": list(self.budget), "queue": [_group_json(g) for g in self.queue],
                    "unfinished": [dataclasses.asdict(t) for t in unfinished],
                    "ledger": {"state": _keys_str(self.ledger.state), "dropped": _keys_str(self.ledger.dropped),
                               "agent": _keys_str(self.ledger.agent), "counts": dict(self.ledger.counts)}}

    def load_state_dict(self, state: dict) -> None:
        with self.lock:
            self.source.load_state_dict(state["source"])
            self.next_id, self.version = state["next_id"], state["version"]
            self.budget = VerlBudget(*state["budget"])
            self.queue = [_group_from_json(g) for g in state["queue"]]
            ledger = state["ledger"]
            self.ledger.state, self.ledger.dropped = _keys_int(ledger["state"]), _keys_int(ledger["dropped"])
            self.ledger.agent = _keys_int(ledger.get("agent", {}))
            self.ledger.counts = collections.Counter(ledger["counts"])
            self.ledger.in_flight = collections.Counter()
            self.tasks, self.readmit = {}, collections.deque()
            for raw in state["unfinished"]:
                task = Task(raw["prompt_id"], Prompt(**raw["prompt"]), raw["admitted_version"], raw["seed"])
                self.tasks[task.prompt_id] = task
                self.ledger.state[task.prompt_id] = "pending"
                self.readmit.append(task.prompt_id)


def _keys_str(d: dict) -> dict:
    return {str(k): v for k, v in d.items()}


def _keys_int(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}


def _group_json(group: Group) -> dict:
    """A queued group as JSON-able data; MoE routes (`Completion.routes`) are left out: a resumed run's learner
    routes those samples itself."""
    return dataclasses.asdict(dataclasses.replace(
        group, completions=[dataclasses.replace(c, routes=None) for c in group.completions]))


def _group_from_json(raw: dict) -> Group:
    completions = [Completion(**c) for c in raw["completions"]]
    return Group(**{**raw, "completions": completions, "info": GroupInfo.from_json(raw.get("info") or {})})
