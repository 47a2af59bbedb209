"""HeldSessions: finished sessions' K/V, kept for their episodes' next turns (the embedded engine's sessions).

The held sessions occupy a contiguous block of slots at the top of the KV cache; running sequences occupy
slots 0..running-1 at the bottom; the slots between are free. A held session is a cache entry, not a
reservation: the least recently used one is dropped when running sequences need its slot.
"""

from __future__ import annotations

import collections
import dataclasses

from torch import Tensor

from asyncrl.policies.kv_cache import KVCache

__all__ = ["Held", "HeldSessions"]


@dataclasses.dataclass(eq=False)
class Held:
    """A finished session's K/V, kept in `slot` for positions 0..len(tokens)-2 (the last token has none yet)."""

    slot: int
    tokens: list[int]

    @property
    def cached(self) -> int:
        return len(self.tokens) - 1


class HeldSessions:
    def __init__(self, cache: KVCache, num_slots: int, stats: collections.Counter):
        self.cache, self.num_slots, self.stats = cache, num_slots, stats
        self._held: collections.OrderedDict[str, Held] = collections.OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._held)

    @property
    def bottom(self) -> int:
        """The held block's lowest slot (num_slots when nothing is held)."""
        return self.num_slots - len(self._held)

    def free(self, running: int) -> int:
        """Slots neither running nor held."""
        return self.bottom - running

    def continued(self, name: str, prompt_ids: list[int]) -> Held | None:
        """The held session `name` when `prompt_ids` extends its whole sequence."""
        held = self._held.get(name)
        if held is None or len(prompt_ids) < len(held.tokens) or prompt_ids[:len(held.tokens)] != held.tokens:
            return None
        return held

    def make_room(self, n: int, running: int, keep: Held | None = None) -> bool:
        """Drop least recently used sessions (never `keep`) until n slots are free (a continued session may
        bring its own slot: when it is the block's bottom, the running slots can grow into it); False when
        even that cannot make room."""
        while True:
            own = 1 if keep is not None and keep.slot == self.bottom else 0
            if self.free(running) + own >= n:
                return True
            if not self.evict(keep):
                return False

    def drop(self, name: str) -> None:
        """Forget a session; keep the block contiguous (its bottom session moves into the freed slot)."""
        held = self._held.pop(name)
        lowest = self.bottom - 1  # the block's bottom slot before the drop
        if held.slot != lowest:
            mover = next(h for h in self._held.values() if h.slot == lowest)
            self.cache.copy_slot(lowest, held.slot, mover.cached)  # also what a shared cache's rows read
            mover.slot = held.slot
        self.cache.release_row(lowest)

    def evict(self, keep: Held | None = None) -> bool:
        """Drop the least recently used session other than `keep` (False: none): what running sequences do when
        they need what it holds (a slot, or a shared cache's prompt slot)."""
        victim = next((name for name, h in self._held.items() if h is not keep), None)
        if victim is not None:
            self.drop(victim)
            self.stats["sessions_evicted"] += 1
        return victim is not None

    def end(self, names) -> None:
        """Free these sessions (unknown names are ignored)."""
        for name in names:
            if name in self._held:
                self.drop(name)

    def clear(self) -> None:
        for held in self._held.values():
            self.cache.release_row(held.slot)
        self._held.clear()

    def to_bottom(self, held: Held, running: int) -> None:
        """With no free slot, swap `held` with the block's bottom session, so that it can turn into the next
        running slot where it is (instead of evicting another session to move into a free one)."""
        if held.slot == self.bottom or self.free(running) > 0:
            return
        other = next(h for h in self._held.values() if h.slot == self.bottom)
        self.cache.swap_slots(held.slot, self.bottom, held.cached, other.cached)
        held.slot, other.slot = self.bottom, held.slot

    def take(self, name: str, slot: int) -> int:
        """Move session `name` into running slot `slot` (a free slot, or its own when it is the block's
        bottom: `make_room` saw to that); return how many positions it has cached."""
        held = self._held[name]
        if held.slot == slot:  # it was the block's bottom: the block just shrinks
            del self._held[name]
        else:
            self.cache.copy_slot(held.slot, slot, held.cached)
            self.drop(name)
        return held.cached

    def hold(self, name: str, tokens: list[int], running: int, *, slot: int | None = None,
             kv: tuple[Tensor, Tensor] | None = None) -> bool:
        """Keep the K/V of `tokens` (all but the last) under `name` at the top of the cache: from running slot
        `slot` into a free one (False when none is free), or from `kv`, a copy, once that slot was released
        (evicting least recently used sessions when it must). True when there is nothing to keep."""
        if name in self._held:
            self.drop(name)
        if not self.cache.allocated:
            return True
        if kv is None and self.free(running) < 1:
            return False
        if kv is not None and not self.make_room(1, running):
            return True
        top = self.bottom - 1
        if kv is None:
            self.cache.copy_slot(slot, top, len(tokens) - 1)
        else:
            self.cache.write_slot(top, kv)
        self._held[name] = Held(top, tokens)
        return True
