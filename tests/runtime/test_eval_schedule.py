"""When evaluations run (`asyncrl.runtime.eval_schedule`): opened when due and only at a version a live agent
holds, one due while another runs postponed to the next publication, the resumed schedule, and the end of
training (wait, bring an agent to the last version, evaluate it). A fake roster stands in for the agents; the
board is the real one. In real runs: tests/rpc/test_eval_run.py."""

from __future__ import annotations

import logging

import pytest

from asyncrl.config.evaluation import EvalConfig
from asyncrl.runtime.eval_schedule import EvalSchedule
from asyncrl.runtime.evaluation import EvalBoard
from asyncrl.runtime.lifecycle import RunFailed, StopRequest
from asyncrl.types import Completion, Prompt


class Agents:
    """The roster as the schedule reads it: the versions the live agents hold."""

    def __init__(self, *versions: int):
        self.versions = list(versions)
        self.fatal: BaseException | None = None

    def live(self) -> list[str]:
        return [f"agent{i}" for i in range(len(self.versions))]

    def live_versions(self) -> set[int]:
        return set(self.versions)


def board(k: int = 2, **cfg) -> EvalBoard:
    prompts = [Prompt([1, 2, i], data_source="sums", ground_truth=str(i), index=i) for i in range(k)]
    return EvalBoard(prompts, EvalConfig(**{"every_versions": 2, "n": 2, "temperature": 1.0, **cfg}), seed=5,
                     max_new_tokens=16)


def answer_all(b: EvalBoard, version: int, agent: str = "agent0") -> None:
    """An agent at `version` evaluates every prompt of the open evaluation of that version."""
    for task in b.lease(agent, version, len(b.prompts)):
        assert b.submit(agent, task, [Completion([3, 4], [0.0, 0.0], [version] * 2, "stop")] * 2, [1.0, 0.0])


class Evaluators(Agents):
    """Agents that evaluate every open prompt of the version they hold whenever the schedule looks at them."""

    def __init__(self, b: EvalBoard, *versions: int):
        super().__init__(*versions)
        self.board = b

    def live_versions(self) -> set[int]:
        for i, version in enumerate(self.versions):
            answer_all(self.board, version, f"agent{i}")
        return super().live_versions()


def test_an_evaluation_opens_at_the_start_and_every_k_versions_and_ends_in_a_row():
    b, agents = board(at_start=True), Agents(0)
    schedule = EvalSchedule(b, agents)
    schedule.start(0)
    assert b.scheduled == [0]
    answer_all(b, 0)
    agents.versions = [1]
    assert [row["val/version"] for row in schedule.after_publication(1)] == [0]  # not due at 1: none opened
    assert b.scheduled == [0] and not b.busy()
    agents.versions = [2]
    assert schedule.after_publication(2) == [] and b.scheduled == [0, 2]  # due at 2
    assert schedule.ended() == []  # still open


def test_no_start_evaluation_when_off_or_resumed_past_version_0():
    b = board(at_start=False)
    EvalSchedule(b, Agents(0)).start(0)
    b2 = board(at_start=True)
    EvalSchedule(b2, Agents(3)).start(3)
    assert b.scheduled == b2.scheduled == []


def test_one_due_while_another_runs_opens_at_the_next_publication(caplog):
    b, agents = board(), Agents(2)
    schedule = EvalSchedule(b, agents)
    assert schedule.after_publication(2) == [] and b.scheduled == [2]
    agents.versions = [2, 4]  # one agent finishes version 2's prompts, the other took 4
    with caplog.at_level(logging.INFO, logger="asyncrl.runtime.eval_schedule"):
        schedule.after_publication(4)  # due, but version 2's evaluation is open: postponed
    assert b.scheduled == [2]
    assert "an evaluation fell due at version 4 (every) while the agents finish the last one" in caplog.text
    answer_all(b, 2)
    agents.versions = [5]
    [row] = schedule.after_publication(5)  # not due at 5, but the postponed one opens at 5
    assert row["val/version"] == 2 and b.scheduled == [2, 5]
    assert b.open_for(5)


def test_a_version_no_live_agent_holds_is_not_evaluated_yet():
    b = board()
    EvalSchedule(b, Agents(1)).open(2, "every")  # the agents still hold version 1
    assert b.scheduled == []


def test_a_resume_runs_the_open_evaluation_of_its_version_again_and_names_an_older_one_lost(caplog):
    b = board()
    with caplog.at_level(logging.WARNING, logger="asyncrl.runtime.eval_schedule"):
        EvalSchedule(b, Agents(4), resumed={"reported": [0], "open": [2, 4]}, version=4)
    assert b.scheduled == [0, 4] and b.open_for(4)  # 0 reported already: never again; 4 re-run
    assert "the evaluation of version 2 was running at the checkpoint; its weights are gone" in caplog.text
    fresh = board()
    EvalSchedule(fresh, Agents(0), resumed=None)
    assert fresh.scheduled == []


def test_the_end_waits_for_the_open_one_then_brings_an_agent_to_the_last_version_and_evaluates_it():
    b = board(at_end=True)
    agents = Evaluators(b, 4)
    schedule = EvalSchedule(b, agents)
    schedule.open(4, "every")  # its agent evaluates it; the end's needs an agent at version 6
    published, recorded = [], []

    def publish(version):
        published.append(version)
        agents.versions = [version]

    schedule.finish(6, publish=publish, stop=StopRequest(), timeout_s=30, record=recorded.append)
    assert published == [6]
    assert [[row["val/version"] for row in rows] for rows in recorded] == [[4], [6]]
    assert [rows[0]["val/complete"] for rows in recorded] == [1.0, 1.0] and not b.busy()


def test_the_end_stops_waiting_on_a_stop_request_or_its_timeout_and_raises_the_rosters_fatal_error(caplog):
    b, agents = board(at_end=False), Agents(2)
    schedule = EvalSchedule(b, agents)
    schedule.open(2, "every")
    stop = StopRequest()
    stop.set("SIGTERM")
    with caplog.at_level(logging.WARNING, logger="asyncrl.runtime.eval_schedule"):
        schedule.finish(2, publish=lambda v: None, stop=stop, timeout_s=30, record=lambda rows: None)
        schedule.finish(2, publish=lambda v: None, stop=StopRequest(), timeout_s=0.0, record=lambda rows: None)
    assert "the run ends with an evaluation unfinished (SIGTERM)" in caplog.text
    assert "the run ends with an evaluation unfinished (not done within 0 s)" in caplog.text
    agents.fatal = RunFailed("every rollout agent is dead")
    with pytest.raises(RunFailed, match="every rollout agent is dead"):
        schedule.finish(2, publish=lambda v: None, stop=StopRequest(), timeout_s=30, record=lambda rows: None)
    assert b.busy()  # nobody evaluated it


def test_the_schedule_a_checkpoint_keeps_is_the_boards():
    b = board()
    schedule = EvalSchedule(b, Agents(2))
    schedule.open(2, "every")
    assert schedule.state_dict() == b.state_dict() == {"reported": [], "open": [2]}
