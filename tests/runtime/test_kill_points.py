"""Failover drills' kill points (`ASYNCRL_FAULT`): the value's format and its checks (named before any spawn), and
where each phase sits, in one process: a training step reaches forward, backward, norm and step in that order at
the learner's version; a publication and a checkpoint reach theirs; another rank or version passes through.
(Two killed runs are in tests/rpc/test_supervision.py.)"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from asyncrl.learner import train_step
from asyncrl.rpc.commands import TrainerGroup
from asyncrl.runtime import kill_points
from asyncrl.runtime.kill_points import ENV, GENERATION_ENV, PHASES, KillPoint, check_kill_point_env, parse_kill_point
from tests.dist_helpers import build, sample_groups


class Killed(Exception):
    pass


@pytest.fixture
def drill(monkeypatch):
    """`arm(text)`: sets the drill; a kill raises `Killed` instead of ending the test process."""
    def _exit(code):
        raise Killed(code)

    monkeypatch.setattr(kill_points.os, "_exit", _exit)
    return lambda text: monkeypatch.setenv(ENV, text)


def test_the_format_and_its_refusals(monkeypatch):
    assert parse_kill_point(" trainer:2:version:15:phase:norm ") == KillPoint(2, 15, "norm")
    assert parse_kill_point("trainer:1:version:0:phase:join:hang") == KillPoint(1, 0, "join", hang=True)
    for bad in ("trainer:1:version:2", "trainer:1:version:2:phase:sleep", "agent:1:version:2:phase:step",
                "trainer:-1:version:2:phase:step", "trainer:1:version:2:phase:step:stall"):
        with pytest.raises(ValueError, match=r"ASYNCRL_FAULT=.*expected trainer:RANK:version:VERSION:phase:PHASE"):
            parse_kill_point(bad)
    monkeypatch.delenv(ENV, raising=False)
    assert check_kill_point_env(2) == []
    monkeypatch.setenv(ENV, "trainer:1:version:0:phase:step,trainer:2:version:0:phase:step")
    with pytest.raises(ValueError, match=r"trainer rank 2 does not exist in a run of 2 trainer rank\(s\) "
                                         r"\(--placement.trainer-devices\)"):
        check_kill_point_env(2)
    monkeypatch.setenv(ENV, "trainer:1:version:0:phase:step,trainer:1:version:4:phase:norm")
    assert check_kill_point_env(2) == [KillPoint(1, 0, "step"), KillPoint(1, 4, "norm")]


def test_the_kth_point_of_a_list_applies_to_the_trainer_groups_kth_generation(drill, monkeypatch):
    drill("trainer:0:version:3:phase:publish,trainer:0:version:5:phase:publish")
    monkeypatch.setenv(GENERATION_ENV, "1")
    kill_points.kill_point("publish", 0, 3)  # generation 0's point: passes through
    with pytest.raises(Killed):
        kill_points.kill_point("publish", 0, 5)
    monkeypatch.setenv(GENERATION_ENV, "2")  # no point for generation 2
    kill_points.kill_point("publish", 0, 5)


def test_a_hang_point_stops_the_process_instead_of_ending_it(drill, monkeypatch):
    drill("trainer:1:version:0:phase:join:hang")
    sent = []
    monkeypatch.setattr(kill_points.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    kill_points.kill_point("join", 1, 0)  # returns once the process is continued (here: at once)
    assert sent == [(os.getpid(), signal.SIGSTOP)]


@pytest.mark.parametrize("phase", ["forward", "backward", "norm", "step"])
def test_each_learner_phase_is_reached_at_the_learners_version(drill, phase):
    state = build("grpo")
    state.version = 3
    groups = sample_groups(2, seed=0, n=2)
    drill(f"trainer:0:version:2:phase:{phase}")  # another version: passes through
    state, _ = train_step(state, groups)
    drill(f"trainer:1:version:3:phase:{phase}")  # another rank: passes through
    state, _ = train_step(state, groups)
    before = {n: p.detach().clone() for n, p in state.policy.named_parameters()}
    drill(f"trainer:0:version:3:phase:{phase}")
    with pytest.raises(Killed):
        train_step(state, groups)
    assert all(p.detach().equal(before[n]) for n, p in state.policy.named_parameters())  # before its first update


@pytest.mark.parametrize("phase", ["publish", "checkpoint"])
def test_publication_and_checkpoint_points(drill, phase, tmp_path):
    state = build("grpo")
    trainers = TrainerGroup(None)
    drill(f"trainer:0:version:0:phase:{phase}")
    with pytest.raises(Killed):
        if phase == "publish":
            trainers.weights(state, torch.float32)
        else:
            trainers.checkpoint(str(tmp_path), state, {}, keep=1)
    assert not list(tmp_path.glob("checkpoints/*"))


def test_every_phase_is_documented():
    assert all(f"{p} (" in kill_points.__doc__ for p in PHASES)
