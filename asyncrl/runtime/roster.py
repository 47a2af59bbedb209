"""The roster: which rollout agents are in the run, which are alive, and the door they talk to.

    roster = Roster(queue, agent_timeout_s=120, on_removed=fleet.discard)
    roster.add("agent0", live=True); roster.start()        # liveness is checked on the roster's own thread

Every agent call (`request`, `submit`, `heartbeat`, `agent_failed`) comes through here, from RPC threads or,
in-process, from agent threads. A member is

  joining   admitted, waiting for its first weights (it becomes live at the next publication);
  live      generating; silent for longer than `agent_timeout_s` it is declared dead;
  dead      declared dead (silent, its loop raised, its weight sync failed): its in-flight prompts go back to
            the queue for the others, and it is *fenced*: every later call from it raises `Fenced`, and a late
            submission is refused and counted (`fully_async/count/fenced_submissions`), so nothing it delivers
            after its prompts were re-admitted can be trained twice;
  left      it asked to leave (or the run ended): fenced like a dead one.

The liveness check runs on its own thread every `check_every_s`, whatever the trainer is doing (training,
publishing, waiting for samples), so a hung agent is named within `agent_timeout_s` plus one check period.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Literal

from asyncrl.runtime.evaluation import EvalBoard, EvalTask
from asyncrl.runtime.lifecycle import RunFailed
from asyncrl.runtime.queue import SampleQueue, Task
from asyncrl.envs.metrics import EnvTally
from asyncrl.runtime.reward_tally import RewardTally
from asyncrl.types import Group

__all__ = ["Roster", "Fenced", "FENCED_EXIT", "Member"]

log = logging.getLogger(__name__)

Status = Literal["joining", "live", "dead", "left"]


FENCED_EXIT = 75
"""Exit status of an agent process the run declared dead while it lived (a network partition, a long stall): it
was fenced out, and a keeper (torchrun's, or `asyncrl agent`'s own) may start it again to join anew. An agent that
fails otherwise exits with 1; one the run ended, with 0."""


class Fenced(RuntimeError):
    """A call from an agent the run declared dead or that left: refused."""


@dataclasses.dataclass
class Member:
    name: str
    status: Status
    last_heard: float
    device: str = ""
    pid: int | None = None
    why: str = ""
    first_version: int | None = None  # the weight version it started generating with
    last_version: int | None = None  # the last version it received
    submitted: int = 0  # groups accepted from it

    def report(self) -> dict:
        return {"status": self.status, "device": self.device, "pid": self.pid, "why": self.why,
                "first_version": self.first_version, "last_version": self.last_version, "submitted": self.submitted}


class Roster:
    def __init__(self, queue: SampleQueue, *, agent_timeout_s: float, allow_empty: bool = False,
                 on_removed: Callable[[str, str, str], None] | None = None, check_every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, evals: EvalBoard | None = None, eval_slots: int = 0):
        self.queue, self.agent_timeout_s, self.allow_empty = queue, agent_timeout_s, allow_empty
        self.evals, self.eval_slots = evals, eval_slots  # held-out evaluations; prompts an agent may hold of them
        self.on_removed = on_removed
        self.check_every_s = check_every_s if check_every_s is not None else min(1.0, agent_timeout_s / 10)
        self.clock = clock
        self.members: dict[str, Member] = {}
        self.rewards = RewardTally()  # what the reward functions did, counted as groups arrive
        self.envs = EnvTally()  # what multi-turn episodes did
        self.lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.fatal: BaseException | None = None  # set when no agent is left; raised by the trainer loop
        self.changed = threading.Condition(self.lock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------------------------- membership
    def add(self, name: str, *, live: bool = False, device: str = "", pid: int | None = None) -> None:
        with self.changed:
            if name in self.members:
                raise ValueError(f"agent {name!r} is already in the roster")
            self.members[name] = Member(name, "live" if live else "joining", self.clock(), device, pid)
            self.counts["joined"] += 1
            self.changed.notify_all()

    def activate(self, name: str) -> bool:
        """A joining agent got its first weights: it may take prompts. False when it died meanwhile."""
        with self.changed:
            member = self.members.get(name)
            if member is None or member.status != "joining":
                return False
            member.status, member.last_heard = "live", self.clock()
            self.changed.notify_all()
            return True

    def synced(self, name: str, version: int) -> None:
        """`name` holds the weights of `version` (a publication reached it, or it started with them). An older
        version said later (a sync's end is said where it ends and again where the trainer settles it) changes
        nothing: versions only grow."""
        with self.lock:
            member = self.members.get(name)
            if member is not None:
                member.first_version = version if member.first_version is None else member.first_version
                member.last_version = version if member.last_version is None else max(member.last_version, version)

    def report(self) -> dict[str, dict]:
        """Every agent that was in the run: status, why it left, versions it held, groups it delivered."""
        with self.lock:
            return {name: m.report() for name, m in self.members.items()}

    def _with(self, status: Status) -> list[str]:
        with self.lock:
            return [m.name for m in self.members.values() if m.status == status]

    def live(self) -> list[str]:
        return self._with("live")

    def joining(self) -> list[str]:
        return self._with("joining")

    def dead(self) -> list[str]:
        return self._with("dead")

    def is_live(self, name: str) -> bool:
        with self.lock:
            member = self.members.get(name)
            return member is not None and member.status == "live"

    def status(self, name: str) -> Status | None:
        with self.lock:
            member = self.members.get(name)
            return member.status if member is not None else None

    def silent_for(self, name: str) -> float:
        """Seconds since `name` was last heard from."""
        with self.lock:
            member = self.members.get(name)
            return self.clock() - member.last_heard if member is not None else float("inf")

    def live_versions(self) -> set[int]:
        """The weight versions the live agents hold."""
        with self.lock:
            return {m.last_version for m in self.members.values() if m.status == "live" and m.last_version is not None}

    def evaluating(self, name: str) -> bool:
        """An evaluation of the version `name` holds still has prompts to generate: the agent keeps its weights
        (and takes evaluation prompts) until it ends."""
        if self.evals is None:
            return False
        with self.lock:
            member = self.members.get(name)
            version = member.last_version if member is not None and member.status == "live" else None
        return version is not None and self.evals.open_for(version)

    def name_of(self, pid: int) -> str | None:
        """The agent whose process is `pid` (the newest one, pids can be reused)."""
        with self.lock:
            found = [m.name for m in self.members.values() if m.pid == pid]
            return found[-1] if found else None

    def pid(self, name: str) -> int | None:
        with self.lock:
            member = self.members.get(name)
            return member.pid if member is not None else None

    # ------------------------------------------------------------------------- leaving the run
    def declare_dead(self, name: str, why: str) -> bool:
        """Fence `name`, put its in-flight prompts back for the others, tell the transport. False when it was
        already out."""
        return self._remove(name, "dead", why)

    def leave(self, name: str, why: str = "left", *, readmit: bool = True) -> bool:
        """An agent leaves (asked to, or the run ended): fenced; its unfinished prompts go to the others
        (`readmit`), or stay where they are for the end of the run's books."""
        return self._remove(name, "left", why, readmit=readmit)

    def _remove(self, name: str, status: Status, why: str, *, readmit: bool = True) -> bool:
        with self.changed:
            member = self.members.get(name)
            if member is None or member.status in ("dead", "left"):
                return False
            member.status, member.why = status, why
            self.counts[status] += 1
            empty = not any(m.status in ("live", "joining") for m in self.members.values())
            self.changed.notify_all()
        ids = self.queue.agent_failed(name) if readmit else []
        if self.evals is not None:
            self.evals.agent_failed(name)  # its evaluation prompts go to agents holding the same version
        if status == "dead":
            log.error("rollout agent %s is dead (%s); re-admitting its %d in-flight prompts to the others",
                      name, why, len(ids))
        elif readmit:
            log.info("rollout agent %s left (%s); re-admitting its %d unfinished prompts", name, why, len(ids))
        if self.on_removed is not None:
            self.on_removed(name, status, why)
        if empty and status == "dead" and not self.allow_empty and self.fatal is None:
            self.fatal = RunFailed(f"every rollout agent is dead (last: {name}, {why}); the run cannot continue")
        return True

    # ---------------------------------------------------------------------- agent-facing calls
    def _heard(self, agent: str, what: str) -> None:
        with self.lock:
            member = self.members.get(agent)
            if member is None or member.status in ("dead", "left"):
                self.counts[f"fenced_{what}"] += 1
                state = "unknown" if member is None else f"{member.status} ({member.why})"
                raise Fenced(f"agent {agent} is {state}; its {what} are refused")
            member.last_heard = self.clock()

    def request(self, agent: str, n: int) -> list[Task | EvalTask]:
        """Up to n prompts: evaluation prompts of the version the agent holds first (while it holds fewer than
        `eval_slots` of them), then training prompts within the staleness budget.

        An agent whose weights are older than the newest publication gets no training prompt: the budget
        stamps what it admits with the newest version, so a prompt sampled under older weights would carry a
        lag the budget never allowed. Such an agent is one a publication has not reached yet (it will in a
        moment), or one that keeps its weights for an evaluation of them: that one takes evaluation prompts
        with all the slots it asks for, so that the evaluation ends and it catches up."""
        self._heard(agent, "requests")
        if not self.is_live(agent):
            return []  # joining: no prompts before the first weights
        with self.lock:
            version = self.members[agent].last_version
        behind = version is not None and version < self.queue.version
        out: list[Task | EvalTask] = []
        if self.evals is not None:
            room = n if behind else min(n, self.eval_slots - self.evals.holds(agent))
            if room > 0:
                out += self.evals.lease(agent, version, room)
        if behind or n - len(out) <= 0:
            return out
        live = len(self.live())
        # fair share of a version's admissions among the live agents (first come would let one take it all)
        share = -(-self.queue.budget.max_required_samples // live) if live > 1 else None
        return out + self.queue.request(agent, n - len(out), share=share)

    def submit(self, agent: str, group: Group) -> None:
        self._heard(agent, "submissions")
        self.queue.submit(agent, group)
        self.rewards.add(group.info.rewards)
        self.envs.add(group.info.env)
        with self.lock:
            self.members[agent].submitted += 1

    def submit_eval(self, agent: str, task: EvalTask, completions: list, rewards: list[float]) -> None:
        """An evaluation prompt's samples and rewards (refused, and counted, when they carry another version)."""
        self._heard(agent, "submissions")
        if self.evals is None or not self.evals.submit(agent, task, completions, rewards):
            with self.lock:
                self.counts["eval_refused"] += 1

    def heartbeat(self, agent: str) -> None:
        self._heard(agent, "heartbeats")

    def agent_failed(self, agent: str, why: str) -> None:
        """An agent whose loop raised says so: dead now, not after agent_timeout_s of silence."""
        self.declare_dead(agent, why)

    # ----------------------------------------------------------------------------- liveness
    def check(self) -> list[str]:
        """Declare dead every live agent silent for longer than agent_timeout_s; return their names."""
        now = self.clock()
        with self.lock:
            silent = [(m.name, now - m.last_heard) for m in self.members.values()
                      if m.status == "live" and now - m.last_heard > self.agent_timeout_s]
        for name, quiet in silent:
            self.declare_dead(name, f"silent for {quiet:.1f} s (agent_timeout_s={self.agent_timeout_s:g})")
        return [name for name, _ in silent]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="roster-liveness", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.check_every_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch must go on
                log.exception("liveness check failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)

    def wait_for_change(self, timeout: float) -> None:
        with self.changed:
            self.changed.wait(timeout)

    def metrics(self) -> dict:
        with self.lock:
            by_status = collections.Counter(m.status for m in self.members.values())
            counts = dict(self.counts)
        return {"fully_async/agents/live": by_status["live"], "fully_async/agents/joining": by_status["joining"],
                "fully_async/dead_agents": by_status["dead"], "fully_async/agents/left": by_status["left"],
                "fully_async/count/fenced_submissions": counts.get("fenced_submissions", 0),
                "fully_async/count/agents_joined": counts.get("joined", 0), **self.rewards.window(),
                **self.envs.window()}
