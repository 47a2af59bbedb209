"""The pieces of a restart after trainer rank 0's death, in one process (`asyncrl.rpc.restart`): the version
boundary a restart goes on from (rank 0's books and every rank's restore point of one step), the pinned file that
keeps that boundary through later steps, and what a file that is not rank 0's books says. Launched runs that
restart are in tests/rpc/test_trainer_failover.py."""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.checkpoint.snapshot_files import write_packed
from asyncrl.learner import train_step
from asyncrl.rpc.failover import RestorePoints
from asyncrl.rpc.restart import RestorablePoint, StoppedWatch, newest_restorable, read_books, restart_refusal, write_books
from tests.dist_helpers import build, sample_groups

BOOKS = {"queue": {"queue": [], "unfinished": []}, "run": {"window_steps": 0, "wall_s": 1.5}}


def _snap(directory, rank: int, step: int, **kw) -> None:
    write_packed(directory, rank=rank, step=step, packed=('{"lengths": [4]}', torch.zeros(4, dtype=torch.uint8)), **kw)


def test_the_newest_boundary_with_books_and_every_ranks_file_is_the_one_a_restart_takes(tmp_path):
    world = tmp_path / "world3"
    for step in (4, 6, 8):
        write_books(world, step=step, version=step // 2, books=BOOKS, recoveries=[])
    for rank in range(3):
        _snap(world, rank, 4, keep=9)
        _snap(world, rank, 6, keep=9)
    _snap(world, 0, 8, keep=9)  # ranks 1 and 2 still writing step 8: not a boundary to go on from
    _snap(world, 1, 9, keep=9)  # a step without books (not a version boundary)
    point = newest_restorable(tmp_path, world=3)
    assert point.step == 6 and point.books == world / "books-s6.json"
    assert read_books(point.books) == {"step": 6, "version": 3, "books": BOOKS, "recoveries": []}
    assert newest_restorable(tmp_path, world=2) is None  # no group of two wrote any
    (world / "books-s6.json").unlink()
    assert newest_restorable(tmp_path, world=3).step == 4


def test_books_keep_the_newest_three_and_are_written_whole(tmp_path):
    for step in range(1, 6):
        write_books(tmp_path, step=step, version=step, books=BOOKS, recoveries=[{"generation": 1}])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["books-s3.json", "books-s4.json", "books-s5.json"]


@pytest.mark.parametrize("text", ["{not json", json.dumps({"step": 1}), json.dumps([1, 2]),
                                  json.dumps({"step": 1, "version": 1, "books": {"run": {}}, "recoveries": []})])
def test_a_file_that_is_not_rank_0s_books_is_refused_naming_it(tmp_path, text):
    path = tmp_path / "books-s1.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"books-s1.json: not a trainer rank 0 books file"):
        read_books(path)


def test_a_pinned_step_outlives_the_newest_two_until_another_is_pinned(tmp_path):
    for step in (1, 2, 3, 4):
        _snap(tmp_path, 0, step, pinned=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-s2.snap", "rank0-s3.snap", "rank0-s4.snap"]
    _snap(tmp_path, 0, 5, pinned=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0-s4.snap", "rank0-s5.snap"]


def test_restore_points_pin_the_step_they_took_and_keep_it_through_later_steps(tmp_path):
    state = build("grpo")
    points = RestorePoints(tmp_path, rank=0, world=1)
    with pytest.raises(ValueError, match="step 0 pinned, but the newest restore point taken is of step -1"):
        points.pin(0)
    boundary = None
    for i in range(4):
        state, _ = train_step(state, sample_groups(4, seed=i, n=3, first_id=100 * i))
        points.after_step(state, None)
        points.wait()
        if i == 0:
            boundary = state.step
            points.pin(boundary)
    steps = sorted(int(p.name.split("-s")[1].split(".")[0]) for p in (tmp_path / "world1").glob("*.snap"))
    assert steps == [boundary, state.step - 1, state.step]
    fresh = RestorePoints(tmp_path, rank=0, world=1)
    fresh.restore(build("grpo", seed=3), boundary)
    assert fresh.latest == boundary  # a restored step can be pinned again without being taken again
    fresh.pin(boundary)


def test_rank_0s_death_is_survived_with_failover_a_recovery_left_and_a_boundary_kept():
    point = RestorablePoint(6, None)
    assert restart_refusal(max_recoveries=2, recoveries_left=1, stopping=False, point=point) is None
    assert restart_refusal(max_recoveries=0, recoveries_left=0, stopping=False, point=None) == (
        "without --trainer.max-recoveries trainer rank 0's death ends the run: resume from its last checkpoint with "
        "--resume")
    assert restart_refusal(max_recoveries=2, recoveries_left=0, stopping=False, point=point) == (
        "--trainer.max-recoveries 2 spent: resume from its last checkpoint with --resume")
    assert restart_refusal(max_recoveries=2, recoveries_left=2, stopping=True, point=point) == "the run was stopping"
    assert restart_refusal(max_recoveries=2, recoveries_left=2, stopping=False, point=None).startswith(
        "no version boundary has a restore point on every trainer rank yet")


def test_a_stopped_rank_0_counts_as_dead_only_once_stopped_past_the_timeout_without_a_break():
    now, stopped = [100.0], {7: True}
    watch = StoppedWatch(10.0, stopped=lambda pid: stopped[pid], clock=lambda: now[0])
    assert watch.why(7) is None  # first seen stopped
    now[0] = 109.0
    assert watch.why(7) is None
    stopped[7] = False  # continued (SIGCONT): the count starts over
    assert watch.why(7) is None
    stopped[7], now[0] = True, 112.0
    assert watch.why(7) is None
    now[0] = 122.5
    assert watch.why(7) == "trainer rank 0 (pid 7) is stopped (SIGSTOP) for 10 s (--async-training.agent-timeout-s 10)"
    watch.reset()
    assert watch.why(7) is None
