"""Trainer failover, the group's part: three gloo trainer ranks (FSDP2, PPO with its critic) train a step, snapshot
their shards at the version boundary and pass each snapshot to the ring successor; rank 2 dies; the survivors' next
collective raises; they and a spare re-form the group as generation 1 (`reform_trainer_group`) with the same ranks,
rebuild the learner, restore the boundary (the spare from rank 0's replica of shard 2), and take the step again. Its
weights equal, bitwise, those the whole group made of that step before the death (it took the step once, then
went back to the boundary). Then ranks 0 and 1 shrink to a group of two (generation 2), reshard the boundary and take
the step again, as one process does. (`asyncrl train` recovers with restarted followers instead:
tests/rpc/test_trainer_failover.py.)

Detection on gloo: rank 2 dies while the others wait in the step; rank 1, waiting on it, fails at once (the
connection closes); rank 0, waiting on rank 1, fails only at the group's timeout, because a live process's gloo
connections stay open after its collective failed (neither abort nor shutdown closes them in torch 2.13; only its
exit does). The test allows that bound."""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from asyncrl.checkpoint.snapshot import ShardSnapshot, all_gather_packed, exchange_in_ring, transfer_packed
from asyncrl.learner import train_step
from asyncrl.rpc.reform import abort_trainer_groups, reform_trainer_group, trainer_store
from tests.dist_helpers import build, max_diff, sample_groups, weights
from tests.run_helpers import free_ports
from tests.timing import limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORLD = 3
SPARE = WORLD  # the spare's process index: it takes the dead rank's place
STEP_TIMEOUT_S = 10  # the first group's collective timeout: a survivor waiting on a live peer waits it out


def _batches():
    return sample_groups(4, seed=0, n=3), sample_groups(4, seed=0, n=3, first_id=100)


def _member(index: int, port: int, out: str) -> None:
    """Rank 2 dies; a spare takes its place (generation 1), then the survivors go on as a group of two (generation
    2). Before the death the whole group takes the next step once (the reference) and goes back to the boundary."""
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=limit(60)))
        first, second = _batches()
        result: dict = {}
        if index < WORLD:
            dist.init_process_group("gloo", store=trainer_store(store, 0), rank=index, world_size=WORLD,
                                    timeout=timedelta(seconds=limit(STEP_TIMEOUT_S)))
            state, _ = train_step(build("ppo", sharded=True), first)
            snapshot = ShardSnapshot(state)
            snapshot.take(state)
            own = snapshot.packed()
            replica = exchange_in_ring(own, dist.group.WORLD)
            state, _ = train_step(state, second)  # what the whole group makes of the next step; then back to the
            result["whole"] = {"policy": weights(state.policy), "critic": weights(state.critic)}  # boundary
            snapshot.restore(state)
            if index == 2:  # dies once the others are in the next step (its collectives wait for it), its
                store.wait(["entered/0", "entered/1"])  # snapshot with rank 0
                time.sleep(1.0)
                store.set("died_at", repr(time.time()))
                os._exit(9)
            store.set(f"entered/{index}", "1")
            try:
                train_step(state, second)
            except Exception as err:  # noqa: BLE001 - what a survivor sees of the death
                result["error"] = f"{type(err).__name__}: {err}"[:300]
                result["detected_s"] = time.time() - float(store.get("died_at").decode())
            else:
                raise AssertionError(f"rank {index} trained a step without rank 2")
            del state, snapshot  # the learner holds the broken group: dropped, the group's connections can close
            abort_trainer_groups()  # at once: a survivor blocked on this one fails now too
        rank = 2 if index == SPARE else index  # generation 1: the spare takes rank 2's place
        reform_trainer_group(store, generation=1, rank=rank, world_size=WORLD, backend="gloo", timeout_s=limit(180))
        state = build("ppo", sharded=True, seed=5)  # the learner again, over the new group (other initial weights)
        snapshot = ShardSnapshot(state)
        if index == SPARE:
            snapshot.load_packed(*transfer_packed(dist.group.WORLD, None, to=None, source=0))
        else:
            if index == 0:  # rank 2's ring successor holds its shard
                transfer_packed(dist.group.WORLD, replica, to=2, source=None)
            snapshot.load_packed(*own)
        snapshot.restore(state)
        state, _ = train_step(state, second)
        result["spare"] = dict(policy=weights(state.policy), critic=weights(state.critic), version=snapshot.version)
        if index != SPARE:  # generation 2: ranks 0 and 1 alone, each with every shard of the boundary (rank 2's from
            del state, snapshot  # rank 0's replica), taking FSDP2's part of it for a group of two
            reform_trainer_group(store, generation=2, rank=index, world_size=WORLD - 1, backend="gloo",
                                 timeout_s=limit(180))
            state = build("ppo", sharded=True, seed=5)
            snapshot = ShardSnapshot(state)
            shards = all_gather_packed(dist.group.WORLD, {0: own, 2: replica} if index == 0 else {index: own})
            snapshot.load_resharded([shards[r] for r in range(WORLD)], rank=index, world=WORLD - 1)
            snapshot.restore(state)
            state, _ = train_step(state, second)
            result["shrink"] = dict(policy=weights(state.policy), critic=weights(state.critic),
                                    version=snapshot.version)
        torch.save(result, pathlib.Path(out) / f"member{index}.pt")
    except BaseException:
        (pathlib.Path(out) / f"error{index}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(out: pathlib.Path) -> dict[int, dict]:
    port = free_ports()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=limit(60)))
    ctx = multiprocessing.get_context("spawn")
    members = range(WORLD + 1)
    procs = [ctx.Process(target=_member, args=(i, port, str(out))) for i in members]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(limit(240))
        errors = "".join(f.read_text() for f in sorted(out.glob("error*.txt")))
        assert all(p.exitcode is not None for p in procs), f"members still running\n{errors}"
        expected = {i: (9 if i == 2 else 0) for i in members}
        assert {i: p.exitcode for i, p in zip(members, procs)} == expected, errors
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        del store
    return {i: torch.load(out / f"member{i}.pt") for i in members if i != 2}


def test_survivors_and_a_spare_reform_the_group_bitwise_then_shrink_to_two_ranks_as_one_process_does(tmp_path):
    """Generation 1, with a spare in rank 2's place: every rank retrains the step and its weights equal, bitwise,
    those the whole group made of it before the death. Generation 2, ranks 0 and 1 alone: each gets every rank's
    shard of the boundary, takes its new part (FSDP2's chunks for two ranks) and retrains the step; the weights equal
    one process's two steps within the rounding of another reduction order (the FSDP tests' 1e-5)."""
    failed = _run(tmp_path)
    assert sorted(failed) == [0, 1, SPARE]
    whole = failed[0]["whole"]
    assert max_diff(whole["policy"], failed[1]["whole"]["policy"]) == 0
    for index, got in failed.items():
        if index != SPARE:  # at once (waiting on the dead rank) or at the timeout (waiting on a live one)
            assert "error" in got, f"rank {index}'s collective did not fail when rank 2 died"
            assert got["detected_s"] < limit(STEP_TIMEOUT_S) + limit(10), got
        assert got["spare"]["version"] == 0
        for part in ("policy", "critic"):
            assert max_diff(got["spare"][part], whole[part]) == 0, (index, part)
    first, second = _batches()
    state, _ = train_step(build("ppo"), first)
    state, _ = train_step(state, second)
    for index in (0, 1):
        got = failed[index]["shrink"]
        assert got["version"] == 0
        for part, model in (("policy", state.policy), ("critic", state.critic)):
            assert max_diff(got[part], weights(model)) <= 1e-5, (index, part, max_diff(got[part], weights(model)))
