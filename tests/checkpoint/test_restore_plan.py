"""`plan_restore`: with ring replication any single death, and any deaths no two of which are ring neighbours,
restore at the snapshot's version from live ranks only (a shard's own rank when alive); neighbours dying together
lose a shard, which the refusal names; mixed versions (a death during a snapshot) fall back to the newest boundary
every shard has."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from asyncrl.checkpoint.restore_plan import Held, NoRestore, RestorePlan, plan_restore, ring_holdings


def _neighbours(dead: set[int], world: int) -> bool:
    return world > 1 and any((r + 1) % world in dead and (r + 1) % world != r for r in dead)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9).flatmap(lambda w: st.tuples(st.just(w), st.sets(st.integers(0, w - 1), max_size=w))),
       st.integers(0, 50))
def test_ring_replicas_survive_any_deaths_without_two_neighbours(case, version):
    world, dead = case
    plan = plan_restore(world, dead, ring_holdings(world, version))
    recoverable = len(dead) < world and not _neighbours(dead, world) and (world > 1 or not dead)
    assert isinstance(plan, RestorePlan) == recoverable, (world, dead, plan)
    if recoverable:
        assert plan.version == version and sorted(plan.sources) == list(range(world))
        for shard, source in plan.sources.items():
            assert source not in dead
            assert source == shard if shard not in dead else source == (shard + 1) % world
    else:
        assert plan.lost and all(s in dead for s in plan.lost)
        assert "resume from the last checkpoint" in plan.reason


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 8), st.data())
def test_without_replicas_only_a_death_free_group_restores(world, data):
    dead = data.draw(st.sets(st.integers(0, world - 1), max_size=world))
    plan = plan_restore(world, dead, ring_holdings(world, 3, replicate=False))
    assert isinstance(plan, RestorePlan) == (not dead)
    if dead:
        assert set(plan.lost) == dead


def test_a_death_during_a_snapshot_goes_back_to_the_boundary_every_shard_has():
    """Rank 1 finished version 5's snapshot (its shard and rank 0's replica; every rank keeps version 4's until its
    own is done); rank 2 died before its own, and rank 0 had not finished."""
    held = ring_holdings(3, 4) + [h for h in ring_holdings(3, 5) if h.rank == 1]
    assert plan_restore(3, {2}, held) == RestorePlan(4, {0: 0, 1: 1, 2: 0})  # rank 0 holds 2's replica at 4
    assert plan_restore(3, set(), held) == RestorePlan(4, {0: 0, 1: 1, 2: 2})  # 5 lacks shard 2 everywhere
    done = held + [h for h in ring_holdings(3, 5) if h.rank in (0, 2)]
    assert plan_restore(3, {2}, done) == RestorePlan(5, {0: 0, 1: 1, 2: 0})


def test_refusals_name_the_lost_shards():
    plan = plan_restore(4, {1, 2}, ring_holdings(4, 7))
    assert plan == NoRestore(plan.reason, (1,))
    assert "trainer rank(s) 1 at version 7" in plan.reason
    assert isinstance(plan_restore(2, {0, 1}, ring_holdings(2, 0)), NoRestore)
    with pytest.raises(ValueError, match="must lie in 0..2"):
        plan_restore(3, {3}, [])
