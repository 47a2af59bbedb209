"""Model-free drafts for speculative decoding: a row's next tokens, guessed from what followed its last few tokens
elsewhere in its pool.

A pool gathers the sequences of one prompt: the prompt itself and the samples generated for it, the n siblings
of a GRPO group (which share the prompt and much of their reasoning) and, kept after their requests finish, up
to `max_sequences` recent responses to it. A row's draft is what followed the latest earlier occurrence of its
longest recurring suffix (`max_match` tokens down to `min_match`) in any sequence of its pool, its own included
(a repeated phrase, a number copied from the prompt). The drafts are only proposals: the engine keeps a drafted
token only where the row's own sampling draws it (`asyncrl.policies.speculation`), so a wrong or colliding draft
costs a step's extra positions, never a token.

Sequences are indexed lazily, when a row of their pool asks for a draft, each position once; a pool nobody
drafts from costs nothing. Memory is bounded by `max_pools` × `max_sequences` sequences of the engine's length.

    drafts = DraftIndex(min_match=2, max_match=4)
    drafts.propose(key, prompt, completions, own=i, limit=4)   # -> list[int], possibly empty
"""

from __future__ import annotations

import collections
from typing import Hashable, Protocol, Sequence

__all__ = ["Drafter", "DraftIndex"]

_PROMPT = -1
"""The document number of a pool's prompt; its samples are 0, 1, ..."""


class Drafter(Protocol):
    """What the engine asks for drafts (`DraftIndex`; a test passes a fake that knows the answers)."""

    def propose(self, key: Hashable, prompt: Sequence[int], completions: Sequence[list[int]], own: int,
                limit: int) -> list[int]: ...


class _Pool:
    """One prompt's sequences and the index of their suffixes: suffix -> (document, end) of its latest occurrence
    that some token follows (positions count from the prompt's start: a sample's document is prompt + sample)."""

    def __init__(self, prompt: Sequence[int], min_match: int, max_match: int):
        self.prompt = list(prompt)
        self.min_match, self.max_match = min_match, max_match
        self.docs: list[list[int]] = []  # the samples' token lists, held by reference (they grow)
        self.ids: dict[int, int] = {}  # id(token list) -> document number
        self.indexed: list[int] = []  # per document: the next end position to index
        self.seen: dict[tuple[int, ...], tuple[int, int]] = {}
        self._index(_PROMPT, self.min_match, len(self.prompt))

    def track(self, completion: list[int], max_sequences: int) -> int:
        """The document number of `completion` (a sample's token list), adding it if new; beyond `max_sequences`
        the oldest documents are forgotten (and the index rebuilt without them)."""
        doc = self.ids.get(id(completion))
        if doc is not None and self.docs[doc] is completion:
            return doc
        if len(self.docs) >= max_sequences:
            self._forget(len(self.docs) - max_sequences + 1)
        self.docs.append(completion)
        self.ids[id(completion)] = len(self.docs) - 1
        self.indexed.append(len(self.prompt))  # the suffix ending at the prompt's end: its sample's first token
        return len(self.docs) - 1

    def _forget(self, count: int) -> None:
        kept = self.docs[count:]
        self.docs, self.ids, self.indexed = [], {}, []
        self.seen = {}
        self._index(_PROMPT, self.min_match, len(self.prompt))
        for completion in kept:
            self.docs.append(completion)
            self.ids[id(completion)] = len(self.docs) - 1
            self.indexed.append(len(self.prompt))

    def catch_up(self) -> None:
        """Index every document's suffixes that some token now follows."""
        for doc, completion in enumerate(self.docs):
            stop = len(self.prompt) + len(completion)  # the last end followed by a token is stop - 1
            if self.indexed[doc] < stop:
                self._index(doc, self.indexed[doc], stop)
                self.indexed[doc] = stop

    def _index(self, doc: int, first_end: int, stop: int) -> None:
        """Record the suffixes ending at positions first_end .. stop - 1 of `doc` (latest wins)."""
        base = max(first_end - self.max_match, 0)
        tokens = self.slice(doc, base, stop)
        for end in range(first_end, stop):
            for length in range(self.min_match, min(self.max_match, end) + 1):
                self.seen[tuple(tokens[end - base - length:end - base])] = (doc, end)

    def slice(self, doc: int, start: int, stop: int) -> list[int]:
        """Positions start .. stop - 1 of `doc` (the prompt, or prompt + a sample), without building it whole."""
        p = len(self.prompt)
        if doc == _PROMPT or stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.docs[doc][start - p:stop - p]
        return self.prompt[start:] + self.docs[doc][:stop - p]


class DraftIndex:
    """Drafts over pools of sequences, one pool per prompt key, least recently used pools forgotten first."""

    def __init__(self, *, min_match: int = 2, max_match: int = 4, max_pools: int = 32, max_sequences: int = 16):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"DraftIndex: need 1 <= min_match <= max_match, got {min_match} and {max_match}")
        if max_pools < 1 or max_sequences < 1:
            raise ValueError(f"DraftIndex: max_pools and max_sequences must be >= 1, got {max_pools}, {max_sequences}")
        self.min_match, self.max_match = min_match, max_match
        self.max_pools, self.max_sequences = max_pools, max_sequences
        self._pools: collections.OrderedDict[Hashable, _Pool] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._pools)

    def propose(self, key: Hashable, prompt: Sequence[int], completions: Sequence[list[int]], own: int,
                limit: int) -> list[int]:
        """Up to `limit` tokens to follow `prompt` + `completions[own]` (possibly none).

        key: the prompt's pool (a hash of its tokens; a collision only makes worse drafts); the pool keeps its
          first caller's prompt.
        completions: the token lists of the request's samples, held by reference and indexed as they grow; they
          stay in the pool (recent responses) after the request ends.
        """
        if limit < 1:
            return []
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(prompt, self.min_match, self.max_match)
            while len(self._pools) > self.max_pools:
                self._pools.popitem(last=False)
        else:
            self._pools.move_to_end(key)
        for completion in completions:
            pool.track(completion, self.max_sequences)
        pool.catch_up()
        completion = completions[own]
        for length in range(self.max_match, self.min_match - 1, -1):
            suffix = _suffix(prompt, completion, length)
            hit = None if suffix is None else pool.seen.get(suffix)
            if hit is not None:
                doc, end = hit
                return pool.slice(doc, end, end + limit)
        return []


def _suffix(prompt: Sequence[int], completion: Sequence[int], length: int) -> tuple[int, ...] | None:
    """The last `length` tokens of prompt + completion (None: the sequence is shorter)."""
    if len(completion) >= length:
        return tuple(completion[len(completion) - length:])
    head = length - len(completion)
    if head > len(prompt):
        return None
    return tuple(prompt[len(prompt) - head:]) + tuple(completion)
