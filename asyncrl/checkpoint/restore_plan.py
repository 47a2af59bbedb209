"""Where a trainer group that lost ranks restores from: the newest version boundary at which every shard still has
a copy on a live rank, and which rank sends each shard (trainer failover).

Each rank keeps its own shard's snapshot (`asyncrl.checkpoint.snapshot.ShardSnapshot`) and, with replication on, a
copy of its ring predecessor's (rank r holds shard r and shard r − 1 mod N). One death then always leaves a copy of
every shard; two neighbours dying together lose the shard only they held, and the group must go back to its last
checkpoint instead.

    plan = plan_restore(world=4, dead={2}, held=[Held(rank=r, shard=s, version=v), ...])
    if isinstance(plan, NoRestore): ...        # plan.reason names the lost shards and the way out
    plan.version, plan.sources                 # {shard: the live rank that sends it}, its own holder first
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

__all__ = ["Held", "RestorePlan", "NoRestore", "plan_restore", "ring_holdings"]


@dataclasses.dataclass(frozen=True)
class Held:
    """Rank `rank` holds a copy of shard `shard` (the shard of trainer rank `shard`) at version boundary `version`."""

    rank: int
    shard: int
    version: int


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """Every survivor goes back to `version`; shard s comes from live rank `sources[s]` (s itself when alive)."""

    version: int
    sources: dict[int, int]


@dataclasses.dataclass(frozen=True)
class NoRestore:
    """No boundary has a live copy of every shard; `lost` are the shards missing at the newest boundary."""

    reason: str
    lost: tuple[int, ...]


def ring_holdings(world: int, version: int, *, replicate: bool = True) -> list[Held]:
    """What every rank holds after a snapshot at `version`: its own shard, and with `replicate` its predecessor's."""
    own = [Held(r, r, version) for r in range(world)]
    return own + ([Held(r, (r - 1) % world, version) for r in range(world)] if replicate and world > 1 else [])


def plan_restore(world: int, dead: Collection[int], held: Iterable[Held]) -> RestorePlan | NoRestore:
    """The newest boundary at which each of the `world` shards has a copy on a rank not in `dead`, and its sources.

    A shard's own rank is its source when alive (no transfer); otherwise the lowest live rank holding a copy."""
    if world < 1 or any(not 0 <= r < world for r in dead):
        raise ValueError(f"plan_restore: dead ranks {sorted(dead)} must lie in 0..{world - 1}")
    if len(set(dead)) >= world:
        return NoRestore(f"every trainer rank of {world} died: resume from the last checkpoint", tuple(range(world)))
    live = [h for h in held if h.rank not in dead and 0 <= h.shard < world]
    versions = sorted({h.version for h in live}, reverse=True)
    for version in versions:
        holders: dict[int, list[int]] = {}
        for h in live:
            if h.version == version:
                holders.setdefault(h.shard, []).append(h.rank)
        if len(holders) == world:
            return RestorePlan(version, {s: s if s in ranks else min(ranks) for s, ranks in sorted(holders.items())})
    newest = versions[0] if versions else None
    lost = tuple(s for s in range(world) if newest is None or not any(
        h.shard == s and h.version == newest for h in live))
    return NoRestore(f"no live copy of the shard of trainer rank(s) {', '.join(map(str, lost))}"
                     + (f" at version {newest}" if newest is not None else "")
                     + " (each rank's copy died with it and with the rank holding its replica): resume from the "
                     "last checkpoint", lost)
