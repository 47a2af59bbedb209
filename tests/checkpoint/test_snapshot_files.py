"""Restore points in host shared memory: a packed snapshot written to a file, read back into a fresh learner after
the first learner (and its snapshot object) are gone, restores the boundary and takes the same step bitwise; each
rank keeps its newest steps; an interrupted write leaves no file the listing shows; foreign, truncated and
unsafe inputs are refused with the path."""

from __future__ import annotations

import gc

import pytest
import torch

from asyncrl.checkpoint.snapshot import ShardSnapshot
from asyncrl.checkpoint.snapshot_files import held_snapshots, read_packed, snapshot_directory, write_packed
from asyncrl.learner import train_step
from tests.dist_helpers import build, max_diff, sample_groups, weights


def test_a_restore_point_outlives_its_learner_and_restores_a_fresh_one(tmp_path):
    first, second = sample_groups(3, seed=0, n=3), sample_groups(3, seed=1, n=3, first_id=100)
    state, _ = train_step(build("ppo"), first)
    snapshot = ShardSnapshot(state)
    snapshot.take(state)
    path = write_packed(tmp_path, rank=1, step=state.step, packed=snapshot.packed())
    state, _ = train_step(state, second)
    want = {"policy": weights(state.policy), "critic": weights(state.critic)}
    del state, snapshot
    gc.collect()
    fresh = build("ppo", seed=4)
    restored = ShardSnapshot(fresh)
    restored.load_packed(*read_packed(path))
    restored.restore(fresh)
    fresh, _ = train_step(fresh, second)
    assert max_diff(weights(fresh.policy), want["policy"]) == 0
    assert max_diff(weights(fresh.critic), want["critic"]) == 0


def test_each_rank_keeps_its_newest_steps_and_half_written_files_are_not_listed(tmp_path):
    state = build("grpo")
    snapshot = ShardSnapshot(state)
    snapshot.take(state)
    packed = snapshot.packed()
    for step in range(4):
        for rank in (0, 1):
            write_packed(tmp_path, rank=rank, step=step, packed=packed, keep=2)
    (tmp_path / "rank0-v4.tmp").write_bytes(b"ASRLSNAP")  # a write that died before its rename
    assert [(r, v) for r, v, _ in held_snapshots(tmp_path)] == [(0, 2), (0, 3), (1, 2), (1, 3)]
    text, flat = read_packed(tmp_path / "rank1-s3.snap")
    assert text == packed[0] and flat.equal(packed[1])


def test_foreign_and_truncated_files_and_odd_run_ids_are_refused(tmp_path):
    (tmp_path / "x.snap").write_bytes(b"PK\x03\x04 not ours")
    with pytest.raises(ValueError, match=r"x.snap: not an asyncrl snapshot file"):
        read_packed(tmp_path / "x.snap")
    state = build("grpo")
    snapshot = ShardSnapshot(state)
    snapshot.take(state)
    path = write_packed(tmp_path, rank=0, step=0, packed=snapshot.packed())
    whole = path.read_bytes()
    for cut in (40, len(whole) - 3):  # in the header's JSON; in the tensor bytes
        path.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=r"rank0-s0.snap: truncated"):
            read_packed(path)
    assert snapshot_directory("run_1.a-b").name == "asyncrl-run_1.a-b"
    with pytest.raises(ValueError, match="must be letters"):
        snapshot_directory("../etc")


def test_a_file_written_and_read_in_many_chunks_on_threads_is_the_same_file(tmp_path):
    """Shards of several GB move in chunks on threads of their own: with 7-byte chunks every part spans several and
    the parts' boundaries fall inside chunks of the file; the file is byte for byte the one-chunk file."""
    state = build("ppo")
    snapshot = ShardSnapshot(state)
    snapshot.take(state)
    text, parts = snapshot.packed_parts()
    one = write_packed(tmp_path / "one", rank=0, step=1, packed=(text, parts))
    many = write_packed(tmp_path / "many", rank=0, step=1, packed=(text, parts), chunk_bytes=7)
    assert many.read_bytes() == one.read_bytes()
    read_text, flat = read_packed(many, chunk_bytes=5)
    assert read_text == text and flat.equal(torch.cat([p.reshape(-1) for p in parts]))
