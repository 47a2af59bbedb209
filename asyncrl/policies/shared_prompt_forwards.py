"""The forwards that fill a `SharedPromptKVCache` (`--rollout.kv-layout shared-prompt`): prefilling admitted requests'
prompts, and recomputing every running row's K/V after a weight update or a wake-up.

    forwards = SharedPromptForwards(cache, prefill, extend, stats, budget)   # the engine's own forwards
    last = forwards.prefill(requests)       # [requests, hidden]: each prompt's last hidden state
    forwards.recompute(running)             # prompt slots once each, then each row's own part

`prefill(prompts, slots)` writes whole prompts into prompt slots; `extend(tokens, rows, starts)` continues rows'
sequences from their positions `starts` (reading what is cached before) and returns each row's last hidden state.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable, Sequence, TypeVar

import torch
from torch import Tensor

from asyncrl.policies.shared_prompt_cache import SharedPromptKVCache

__all__ = ["SharedPromptForwards", "budgeted"]

T = TypeVar("T")


def budgeted(items: Sequence[T], width: Callable[[T], int], budget: int) -> Iterable[list[T]]:
    """`items` in runs whose padded size (the widest item's `width` × the run's length) fits `budget` (a lone item
    always makes a run)."""
    batch, widest = [], 0
    for item in items:
        if batch and max(widest, width(item)) * (len(batch) + 1) > budget:
            yield batch
            batch, widest = [], 0
        batch.append(item)
        widest = max(widest, width(item))
    if batch:
        yield batch


class SharedPromptForwards:
    """Prefill and recompute over shared prompts (module docstring); `budget`: padded tokens a forward may take."""

    def __init__(self, cache: SharedPromptKVCache, prefill: Callable[[list[list[int]], list[int]], Tensor],
                 extend: Callable[[list[list[int]], list[int], list[int]], Tensor], stats: collections.Counter,
                 budget: int):
        self.cache, self._prefill, self._extend, self.stats, self.budget = cache, prefill, extend, stats, budget

    def prefill(self, requests: list) -> Tensor:
        """Prefill the prompt slots of the requests that share no other's prefix (each request's `prompt_slot`,
        opened at admission), bind every request's samples, then run each request's other prompt tokens (a sharer's
        past its parent's share, a long prompt's past its slot) over its first sample's row, copying what lands in
        that row's own slot to its siblings'. Each request's last hidden state."""
        cache, last = self.cache, [None] * len(requests)
        roots = [i for i, r in enumerate(requests) if cache.parent(r.prompt_slot) is None]
        if roots:
            prompts = [requests[i].prompt_ids[:cache.max_prompt_len] for i in roots]
            hidden = self._prefill(prompts, [requests[i].prompt_slot for i in roots])
            for j, i in enumerate(roots):
                last[i] = hidden[j, len(prompts[j]) - 1]
            self.stats["prefill_tokens"] += sum(map(len, prompts))
        for request in requests:
            cache.bind([s.slot for s in request.samples], request.prompt_slot)
        rest = [i for i, r in enumerate(requests) if len(r.prompt_ids) > cache.prefilled(r.prompt_slot)]
        if rest:
            done = [cache.prefilled(requests[i].prompt_slot) for i in rest]
            hidden = self._extend([requests[i].prompt_ids[d:] for i, d in zip(rest, done)],
                                  [requests[i].samples[0].slot for i in rest], done)
            for j, i in enumerate(rest):
                last[i], request = hidden[j], requests[i]
                if len(request.prompt_ids) > cache.prompt_end(request.prompt_slot) and request.params.n > 1:
                    cache.copy_slot(request.samples[0].slot, [s.slot for s in request.samples[1:]],
                                    len(request.prompt_ids))
        self.stats["shared_prefix_tokens"] += sum((cache.parent(r.prompt_slot) or (0, 0))[1] for r in requests)
        return torch.stack(last)

    def recompute(self, running: list) -> None:
        """The K/V of every running sample (all but its newest token): each open prompt slot from its tokens (a
        sharer's past its parent's share), then each row's own part (a prompt's spill, then its responses)."""
        cache = self.cache
        for batch in budgeted(list(cache.roots().items()), lambda item: len(item[1]), self.budget):
            self._prefill([list(tokens) for _, tokens in batch], [slot for slot, _ in batch])
        for batch in budgeted(list(cache.sharing().items()), lambda item: len(item[1][1]), self.budget):
            self._extend([list(tokens) for _, (_, tokens) in batch], [row for _, (row, _) in batch],
                         [cache.parent(slot)[1] for slot, _ in batch])
        end = {id(s): cache.start_of(s.slot) for s in running}
        own = {id(s): s.request.prompt_ids[end[id(s)]:] + s.completion.token_ids[:-1] for s in running}
        for batch in budgeted([s for s in running if own[id(s)]], lambda s: len(own[id(s)]), self.budget):
            self._extend([own[id(s)] for s in batch], [s.slot for s in batch], [end[id(s)] for s in batch])
