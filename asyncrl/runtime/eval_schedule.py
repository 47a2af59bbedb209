"""When held-out evaluations run during training (`--eval.*`): the controller's collaborator that opens an
evaluation when one falls due, settles the ones the agents finished, and waits for the last ones at the end.
What an evaluation is (prompts pinned to a version, leased to agents holding it) is the board's business
(`asyncrl.runtime.evaluation`).

    schedule = EvalSchedule(board, roster, resumed=extra.get("evals"), version=state.version)
    schedule.start(version)                     # --eval.at-start, on a fresh run
    rows = schedule.after_publication(version)  # the evaluations that ended (their metrics), then the one due
    schedule.finish(version, publish=..., stop=stop, timeout_s=..., record=...)   # the end of training

An evaluation is of weights an agent holds: one due while another runs, or before any live agent holds the
version (they were finishing the last one: an agent keeps its weights while an evaluation of its version
runs), waits for the first publication after which neither holds. A resumed run evaluates the checkpoint's
version again when its evaluation was open at the checkpoint; an open one of an older version is lost (its
weights are gone), and said so.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

from asyncrl.runtime.evaluation import EvalBoard
from asyncrl.runtime.lifecycle import StopRequest

__all__ = ["EvalSchedule", "AgentVersions"]

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How often the end of training looks at the board (and republishes, bringing agents to the last version)."""


class AgentVersions(Protocol):
    """What the schedule reads of the roster (`asyncrl.runtime.roster.Roster`)."""

    fatal: BaseException | None
    """Set when the run cannot go on (no agent left): raised while waiting."""

    def live(self) -> list[str]: ...

    def live_versions(self) -> set[int]: ...


class EvalSchedule:
    def __init__(self, board: EvalBoard, agents: AgentVersions, *, resumed: dict | None = None, version: int = 0):
        """`resumed`: the schedule a checkpoint kept (`state_dict`), restored with the run at `version`."""
        self.board, self.agents = board, agents
        self._postponed: str | None = None  # an evaluation fell due while another ran: the reason it was due
        for open_version in board.load_state_dict(resumed) if resumed is not None else []:
            if open_version == version:  # the checkpoint's weights: run it again
                self.open(open_version, "resumed")
            else:
                log.warning("the evaluation of version %d was running at the checkpoint; its weights are gone, "
                            "so it is not run again", open_version)

    def state_dict(self) -> dict:
        """What a checkpoint keeps (the board's schedule)."""
        return self.board.state_dict()

    def start(self, version: int) -> None:
        """The evaluation of the initial weights (`--eval.at-start`), on a run that starts at version 0."""
        if self.board.config.at_start and version == 0:
            self.open(0, "start")

    def open(self, version: int, reason: str) -> None:
        """Open an evaluation of `version`, or postpone it (see the module docstring)."""
        if self.board.busy() or version not in self.agents.live_versions():
            if self._postponed is None:
                log.info("an evaluation fell due at version %d (%s) while the agents finish the last one: it "
                         "starts at the first version they all can take", version, reason)
            self._postponed = reason
            return
        self._postponed = None
        if self.board.schedule(version, reason):
            log.info("evaluating version %d on %d held-out prompts (%s)", version, len(self.board.prompts), reason)

    def ended(self) -> list[dict]:
        """The metrics of each evaluation that ended since the last call, oldest first (a log line each)."""
        outcomes = self.board.settle(self.agents.live_versions())
        for outcome in outcomes:
            log.info(outcome.line())
        return [outcome.metrics() for outcome in outcomes]

    def after_publication(self, version: int) -> list[dict]:
        """Once `version` is published: the evaluations that ended (`ended`), then the one due at `version`
        (every `--eval.every-versions`), or the one postponed, is opened."""
        rows = self.ended()
        due = self.board.due(version)
        if due or self._postponed is not None:
            self.open(version, "every" if due else self._postponed)
        return rows

    def finish(self, version: int, *, publish: Callable[[int], object], stop: StopRequest, timeout_s: float,
               record: Callable[[list[dict]], None]) -> None:
        """At the end of training (the agents still run; no training prompt is admitted any more): wait for the
        open evaluations, then, with `--eval.at-end`, bring a live agent to the last `version` (`publish`
        republishes it) and evaluate it. Each wait ends early on a stop request or after `timeout_s`; `record`
        gets the metrics of the evaluations that ended, as they end."""
        self._wait(stop, timeout_s, record)
        if self.board.config.at_end:
            self._bring_agents_to(version, publish, timeout_s)
            self.open(version, "end")
            self._wait(stop, timeout_s, record)

    def _check(self) -> None:
        if self.agents.fatal is not None:
            raise self.agents.fatal

    def _wait(self, stop: StopRequest, timeout_s: float, record: Callable[[list[dict]], None]) -> None:
        deadline = time.monotonic() + timeout_s
        while self.board.busy():
            self._check()
            if stop.is_set() or time.monotonic() > deadline:
                log.warning("the run ends with an evaluation unfinished (%s)", stop.reason if stop.is_set()
                            else f"not done within {timeout_s:.0f} s")
                break
            time.sleep(POLL_S)
            rows = self.ended()
            if rows:
                record(rows)

    def _bring_agents_to(self, version: int, publish: Callable[[int], object], timeout_s: float) -> None:
        """Publish `version` again until a live agent holds it (agents that were finishing an evaluation took an
        older one in the background)."""
        deadline = time.monotonic() + timeout_s
        while version not in self.agents.live_versions() and self.agents.live() and time.monotonic() < deadline:
            self._check()
            publish(version)
            time.sleep(POLL_S)
