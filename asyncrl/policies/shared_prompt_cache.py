"""A KV cache that stores each prompt once for all its samples (`--rollout.kv-layout shared-prompt`).

The per-slot `KVCache` copies a prompt's K/V into each of its n sample slots and a decode step reads it n times.
Here a request's prompt lives in a *prompt slot* of a pool `[layers, prompts, Hkv, max_prompt_len, D]`, and each
sample's slot of a second pool `[layers, slots, Hkv, max_len − max_prompt_len, D]` holds only its response
positions (and a prompt's tokens past max_prompt_len, which the engine writes into each sample's slot). Positions
stay the sequence's own everywhere (a row reads position p′ < P from its prompt slot and p′ ≥ P from its own slot
at p′ − P, P the positions its prompt slot holds), so the model, the samplers and the engine's bookkeeping
do not change: writes are routed by position, and reads see one logical sequence.

A GRPO group of n = 8 samples of a 2,048-token prompt with 512-token responses takes 2,048 + 8·512 positions
instead of 8·2,560: 3.3× fewer, so 3.3× the groups in the same memory. The decode attention
(`asyncrl.policies.shared_prompt_attention`) reads a prompt slot once for up to `READER_WIDTH` of its samples (on
CUDA; SDPA elsewhere gathers it per row) and merges that with each row's responses through their log-sum-exps.

With `share_prefix` a request whose prompt begins like a running one's reads that beginning from the running
one's prompt slot and keeps only its remainder in a prompt slot of its own: a row's prompt is then two *segments*
(a shared prefix, its own), and the shared slot stays open while any row reads it.

Tables on the device say where each row reads, so a step replays in a CUDA graph: each row's segments (`row_slots`,
`row_lens`), where its own slot begins (`row_start`), and per segment level the readers of the Triton kernel (a
prompt slot, the positions read and up to `READER_WIDTH` rows). The engine opens a prompt slot when it admits a
request (`match`, `open`), binds its samples' rows (`bind`), moves a row when its slot changes (`move_row`) and
releases rows as samples end (`release_row`); a prompt slot closes with its last reader.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from einops import rearrange
from torch import Tensor

from asyncrl.policies.decode_attention import DecodeAttention, sdpa_decode, verify_attention
from asyncrl.policies.engine_config import EngineConfig
from asyncrl.policies.kv_cache import KVCache, kv_storage
from asyncrl.policies.model import CausalLM
from asyncrl.policies.shared_prompt_attention import SharedPromptAttention, sdpa_shared_prompt, shared_prompt_attention

__all__ = ["SharedPromptKVCache", "READER_WIDTH", "SharedPromptTables", "build_kv_cache"]

READER_WIDTH = 8
"""Rows that share one read of a prompt slot in the Triton kernel (a group of n > 8 gets ceil(n / 8) readers)."""


@dataclasses.dataclass(frozen=True)
class SharedPromptTables:
    """Where decode rows read (device tensors, updated in place between steps). A row's prompt is one or two
    segments (`levels`): a prompt slot's first positions, then (a request sharing another request's prompt prefix)
    its own prompt slot; its own slot holds everything from `row_start` on.

    row_slots, row_lens: [slots, levels] the prompt slot of each segment of row b and the positions it reads there
      (0: none; a free row reads nothing).
    row_start: [slots] the positions row b's segments hold together (its own slot holds positions row_start.. ).
    reader_slot, reader_len: [levels, readers] the prompt slot a reader reads at that level and how many positions.
    reader_rows: [levels, readers, READER_WIDTH] the rows that share the read (−1: none).
    """

    row_slots: Tensor
    row_lens: Tensor
    row_start: Tensor
    reader_slot: Tensor
    reader_len: Tensor
    reader_rows: Tensor

    @property
    def levels(self) -> int:
        return self.row_slots.shape[1]


class SharedPromptKVCache(KVCache):
    """Prompt K/V once per request, response K/V per sample (module docstring). `k`, `v` are the response pool;
    `prompt_k`, `prompt_v` the prompt pool; `max_len` the longest sequence, `max_prompt_len` a prompt slot's size.

    share_prefix: with N > 0 a request whose prompt starts with N or more tokens of a running request's prompt slot
    reads those from it, and only its own remainder goes to a prompt slot of its own (a common system prompt, a long
    instruction: `match`)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, *, max_prompt_len: int, num_prompts: int,
                 share_prefix: int = 0, attention: SharedPromptAttention = sdpa_shared_prompt,
                 storage: torch.dtype | None = None):
        if not 0 < max_prompt_len < max_len:
            raise ValueError(f"--rollout.max-prompt-length {max_prompt_len} must lie in [1, {max_len}) "
                             "(the longest sequence; the rest is the responses' room)")
        if num_prompts < 1:
            raise ValueError(f"--rollout.max-prompts {num_prompts} must be >= 1")
        self.max_prompt_len, self.response_len, self.num_prompts = max_prompt_len, max_len - max_prompt_len, num_prompts
        self.share_prefix = share_prefix
        self.prompt_shape = (num_layers, num_prompts, num_kv_heads, max_prompt_len, head_dim)
        levels = 2 if share_prefix > 0 else 1
        readers = num_prompts + num_slots // READER_WIDTH + 1  # a reader per prompt, and one per 8 samples beyond
        dev = torch.device(device)
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=dev)  # noqa: E731
        self.tables = SharedPromptTables(
            row_slots=zeros(num_slots, levels), row_lens=zeros(num_slots, levels), row_start=zeros(num_slots),
            reader_slot=zeros(levels, readers), reader_len=zeros(levels, readers),
            reader_rows=torch.full((levels, readers, READER_WIDTH), -1, dtype=torch.long, device=dev))
        self._free = list(range(num_prompts - 1, -1, -1))  # prompt slots, the lowest popped first
        self._tokens: dict[int, tuple[int, ...]] = {}  # an open prompt slot's tokens
        self._parent: dict[int, tuple[int, int]] = {}  # a sharing prompt slot's (root slot, positions read there)
        self._version: dict[int, int] = {}  # the weight version an open prompt slot's K/V was computed with
        self._users: dict[int, list[int]] = {}  # the rows that read an open prompt slot
        self._segments: list[tuple[tuple[int, int], ...]] = [()] * num_slots  # each row's (slot, positions)
        self._dirty = False  # the host's tables changed since they were last written to the device
        self._readers_over: int | None = None  # the rows the device's readers cover
        self.prompt_k: Tensor | None = None
        self.prompt_v: Tensor | None = None
        super().__init__(num_layers, num_slots, num_kv_heads, max_len - max_prompt_len, head_dim, dtype, device,
                         attention=attention, storage=storage)  # the response pool: `shape`, `k`, `v`
        self.max_len = self.attend_len = max_len

    # ---------------------------------------------------------------- memory
    @property
    def nbytes(self) -> int:
        positions = self.shape[1] * self.shape[3] + self.prompt_shape[1] * self.prompt_shape[3]
        per_position = 2 * self.shape[0] * self.shape[2] * self.shape[4] * torch.finfo(self.storage).bits // 8
        return positions * per_position

    def allocate(self) -> None:
        if self.k is not None:
            return
        make = lambda shape: torch.zeros(shape, dtype=self.storage, device=self.device)  # noqa: E731
        self.k, self.v = make(self.shape), make(self.shape)
        self.prompt_k, self.prompt_v = make(self.prompt_shape), make(self.prompt_shape)

    def free(self) -> None:
        self.k = self.v = self.prompt_k = self.prompt_v = None

    # ---------------------------------------------------------------- prompt slots and rows
    @property
    def free_prompts(self) -> int:
        return len(self._free)

    def match(self, prompt: list[int], version: int) -> tuple[int, int] | None:
        """(root slot, positions) of the open prompt slot (itself sharing none, its K/V computed with weight
        `version`: a new request never reads K/V of older weights) whose tokens begin `prompt` longest, when that is
        at least `share_prefix` positions (at most all but the prompt's last token, whose logits its own forward
        gives); None otherwise or with sharing off."""
        if self.share_prefix < 1 or len(prompt) <= self.share_prefix:
            return None
        head = tuple(prompt[:self.share_prefix])
        best = None
        for slot, tokens in self._tokens.items():
            if slot in self._parent or self._version[slot] != version or tokens[:self.share_prefix] != head:
                continue
            common = len(os.path.commonprefix([tokens, tuple(prompt[:len(prompt) - 1])]))
            if best is None or common > best[1]:
                best = (slot, common)
        return best

    def open(self, tokens: list[int], parent: tuple[int, int] | None = None, version: int = 0) -> int:
        """A prompt slot for `tokens` (a prompt, or with `parent` = (root, positions) the rest of one after the
        root's first positions), which holds their first `max_prompt_len` (the rest goes to each sample's slot), to
        be computed with weight `version`; ValueError when none is free."""
        if not tokens:
            raise ValueError("an empty prompt has nothing to share")
        if not self._free:
            raise ValueError(f"all {self.num_prompts} prompt slots are in use (--rollout.max-prompts)")
        slot = self._free.pop()
        self._tokens[slot], self._users[slot] = tuple(tokens[:self.max_prompt_len]), []
        self._version[slot] = version
        if parent is not None:
            self._parent[slot] = parent
        return slot

    def parent(self, slot: int) -> tuple[int, int] | None:
        return self._parent.get(slot)

    def stamp(self, version: int) -> None:
        """Every open prompt slot's K/V is now of weight `version` (recomputed with it)."""
        self._version = dict.fromkeys(self._tokens, version)

    def prompt_end(self, slot: int) -> int:
        """Positions a row bound to prompt slot `slot` reads from prompt slots (its own slot's first position)."""
        return sum(length for _, length in self._segments_of(slot))

    def prefilled(self, slot: int) -> int:
        """Positions of such a row that exist before its request's own forward: a root's, or its parent's share."""
        parent = self._parent.get(slot)
        return parent[1] if parent is not None else len(self._tokens[slot])

    def roots(self) -> dict[int, tuple[int, ...]]:
        """Open prompt slots that share no other's prefix, with their tokens (to recompute them)."""
        return {slot: tokens for slot, tokens in self._tokens.items() if slot not in self._parent}

    def sharing(self) -> dict[int, tuple[int, tuple[int, ...]]]:
        """Open prompt slots that share a root's prefix: their first row and their tokens."""
        return {slot: (self._users[slot][0], tokens) for slot, tokens in self._tokens.items() if slot in self._parent}

    def _segments_of(self, slot: int) -> tuple[tuple[int, int], ...]:
        own = (slot, len(self._tokens[slot]))
        parent = self._parent.get(slot)
        return (own,) if parent is None else (parent, own)

    def bind(self, rows: list[int], prompt: int) -> None:
        """Rows (sample slots) now read prompt slot `prompt` (and its parent's share)."""
        self._bind(rows, self._segments_of(prompt))

    def _bind(self, rows, segments: tuple[tuple[int, int], ...]) -> None:
        for row in rows:
            self.release_row(row)
            self._segments[row] = segments
            for slot, _ in segments:
                self._users[slot].append(row)
        self._dirty = True

    def start_of(self, row: int) -> int:
        """Positions row `row` reads from prompt slots: its own slot holds positions from here on."""
        return sum(length for _, length in self._segments[row])

    def move_row(self, src: int, dst: int, written: int) -> None:
        """Row `src`'s sequence now lives in row `dst`: its first `written` positions' own part is copied."""
        self.copy_slot(src, dst, written)
        self.release_row(src)

    def release_row(self, row: int) -> None:
        """Row `row` reads no prompt any more (its sample ended); a prompt slot closes with its last reader."""
        segments, self._segments[row] = self._segments[row], ()
        for slot, _ in segments:
            self._users[slot].remove(row)
            if not self._users[slot]:
                del self._users[slot], self._tokens[slot], self._version[slot]
                self._parent.pop(slot, None)
                self._free.append(slot)
        self._dirty = self._dirty or bool(segments)

    def prepare(self, rows: int | None = None) -> None:
        """Write the host's row and reader tables to the device if they changed, the readers over rows [0, rows) (a
        step's: held sessions' rows lie above and are read by no step); before a step, not while a graph is
        captured; stream-ordered, so after the step in flight."""
        if not self._dirty and rows == self._readers_over:
            return
        self._dirty, self._readers_over = False, rows
        t = self.tables
        levels, count = t.levels, t.reader_slot.shape[1]
        slots = [[0] * levels for _ in self._segments]
        lens = [[0] * levels for _ in self._segments]
        groups: list[dict[tuple[int, int], list[int]]] = [{} for _ in range(levels)]
        for row, segments in enumerate(self._segments):
            for level, (slot, length) in enumerate(segments):
                slots[row][level], lens[row][level] = slot, length
                if rows is None or row < rows:
                    groups[level].setdefault((slot, length), []).append(row)
        t.row_slots.copy_(torch.tensor(slots))
        t.row_lens.copy_(torch.tensor(lens))
        t.row_start.copy_(torch.tensor([sum(x) for x in lens]))
        reader_slot, reader_len = [[0] * count for _ in range(levels)], [[0] * count for _ in range(levels)]
        members = [[[-1] * READER_WIDTH for _ in range(count)] for _ in range(levels)]
        for level, group in enumerate(groups):
            readers = [(key, rows[i:i + READER_WIDTH]) for key, rows in group.items()
                       for i in range(0, len(rows), READER_WIDTH)]
            for i, ((slot, length), rows) in enumerate(readers):
                reader_slot[level][i], reader_len[level][i] = slot, length
                members[level][i][:len(rows)] = rows
        t.reader_slot.copy_(torch.tensor(reader_slot))
        t.reader_len.copy_(torch.tensor(reader_len))
        t.reader_rows.copy_(torch.tensor(members))

    # ---------------------------------------------------------------- writes and reads
    def write_prefill(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write K/V [B, Hkv, S, D] of whole prompts into prompt slots `slots` [B] at positions 0..S−1."""
        s = k.shape[2]
        self._raw(self.prompt_k)[layer, :, :, :s].index_copy_(0, slots, self._stored(k))
        self._raw(self.prompt_v)[layer, :, :, :s].index_copy_(0, slots, self._stored(v))

    def _placed(self, slots: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor, Tensor, bool]]:
        """Where positions [B, S] of rows `slots` [B] live: for each prompt segment and then the own slot, (mask of the
        positions there, the pool slot of each, the offset in it, whether in the prompt pool)."""
        self.prepare()
        t = self.tables
        placed, first = [], torch.zeros_like(positions)
        for level in range(t.levels):
            length = t.row_lens[slots, level][:, None]
            inside = (positions >= first) & (positions < first + length)
            at = (positions - first).clamp(0, self.max_prompt_len - 1)
            placed.append((inside, t.row_slots[slots, level][:, None].expand_as(positions), at, True))
            first = first + length
        own = (positions - first).clamp(0, self.response_len - 1)
        placed.append((positions >= first, slots[:, None].expand_as(positions), own, False))
        return placed

    def _write_rows(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """K/V [B, Hkv, S, D] of row b at its sequence's `positions[b]` ([B, S]): each into the prompt segment or the
        own slot that holds it (offsets clamped to each pool's last)."""
        placed = self._placed(slots, positions)
        for x, cache, prompt_cache in ((k, self.k, self.prompt_k), (v, self.v, self.prompt_v)):
            stored = self._stored(rearrange(x, "b h s d -> b s h d"))
            for inside, where, at, in_prompt in placed:
                self._raw(prompt_cache if in_prompt else cache)[layer][where[inside], :, at[inside]] = stored[inside]

    def read_rows(self, layer: int, slots: Tensor, span: int) -> tuple[Tensor, Tensor]:
        """Rows `slots` [B] as one sequence each: K and V [B, Hkv, span, D] of positions 0..span−1, in `dtype`."""
        positions = torch.arange(span, device=slots.device)[None, :].expand(slots.shape[0], -1)
        placed = self._placed(slots, positions)
        out = []
        for cache, prompt_cache in ((self.k, self.prompt_k), (self.v, self.prompt_v)):
            pools = self._raw(cache)[layer], self._raw(prompt_cache)[layer]
            x = None
            for inside, where, at, in_prompt in placed:
                part = pools[in_prompt][where, :, at]  # [B, span, Hkv, D]
                x = part if x is None else torch.where(inside[:, :, None, None], part, x)
            out.append(self._read(rearrange(x, "b s h d -> b h s d")))
        return out[0], out[1]

    def write_extend(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor,
                     span: int, *, in_order: bool = False) -> tuple[Tensor, Tensor]:
        """`KVCache.write_extend` over the two pools: write the rows, return their sequences' first `span` positions."""
        self._write_rows(layer, slots, positions, k, v)
        return self.read_rows(layer, slots, span)

    def attend_decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
        """Write one K/V [B, Hkv, 1, D] per row b (response slot b, at positions[b] − P), then attend q [B, H, 1, D]
        over its prompt and its responses up to positions[b] (`self.attention`) -> [B, H, 1, D]."""
        b = k.shape[0]
        rows = torch.arange(b, device=k.device)
        at = (positions - self.tables.row_start[:b]).clamp(0, self.response_len - 1)
        self._raw(self.k)[layer][rows, :, at] = self._stored(k[:, :, 0])
        self._raw(self.v)[layer][rows, :, at] = self._stored(v[:, :, 0])
        out = self.attention(q[:, :, 0], self.prompt_k[layer], self.prompt_v[layer], self.k[layer], self.v[layer],
                             self.tables, positions, self.attend_len)
        return out[:, :, None]

    def _own(self, row: int, length: int) -> int:
        """Of a sequence's first `length` positions, those in row `row`'s own slot."""
        return max(0, min(length - self.start_of(row), self.response_len))

    def copy_slot(self, src: int, dst: Tensor | int | list[int], length: int) -> None:
        """Row(s) `dst` now hold row `src`'s first `length` positions: its own slot's part copied (all layers), the
        same prompt segments bound (a held session's move, a prompt's spill to its siblings)."""
        rows = torch.as_tensor(dst).reshape(-1).tolist()
        if self.allocated:
            super().copy_slot(src, rows, self._own(src, length))
        self._bind([r for r in rows if r != src], self._segments[src])

    def swap_slots(self, a: int, b: int, len_a: int, len_b: int) -> None:
        """Exchange rows `a` and `b`: their own slots' first positions and their prompt segments."""
        if self.allocated:
            super().swap_slots(a, b, self._own(a, len_a), self._own(b, len_b))
        segments_a, segments_b = self._segments[a], self._segments[b]
        for row, other, segments in ((a, b, segments_a), (b, a, segments_b)):
            for slot, _ in segments:
                users = self._users[slot]
                users[users.index(row)] = other
        self._segments[a], self._segments[b] = segments_b, segments_a
        self._dirty = True

    def read_slot(self, slot: int, length: int):
        """A copy of row `slot`'s first `length` positions: its own slot's part (`KVCache.read_slot`) and what its
        prompt segments are, to bind again in `write_slot` even once this row's release closed them."""
        k, v = super().read_slot(slot, self._own(slot, length))
        kept = tuple((s, n, self._tokens[s], self._parent.get(s), self._version[s]) for s, n in self._segments[slot])
        return k, v, kept

    def write_slot(self, slot: int, kv) -> None:
        """Write what `read_slot` returned into row `slot`; a prompt slot closed since is taken back (nothing can
        have opened it in between: the engine holds a finished session right after releasing its row)."""
        k, v, kept = kv
        for s, _, tokens, parent, version in kept:
            if s not in self._tokens:
                self._free.remove(s)
                self._tokens[s], self._users[s], self._version[s] = tokens, [], version
                if parent is not None:
                    self._parent[s] = parent
        super().write_slot(slot, (k, v))
        self._bind([slot], tuple((s, n) for s, n, *_ in kept))


def build_kv_cache(model: CausalLM, config: EngineConfig, attention: DecodeAttention) -> KVCache:
    """The engine's cache for `config.kv_layout`, with `attention` (the decode attention chosen for the device)."""
    cfg, dtype, device = model.config, model.dtype, model.device
    storage = kv_storage(config.kv_dtype, dtype)
    shape = (cfg.num_layers, config.max_slots, cfg.num_kv_heads, config.max_len, cfg.head_dim)
    if config.kv_layout == "shared-prompt":
        return SharedPromptKVCache(*shape, dtype, device, max_prompt_len=config.max_prompt_len,
                                   num_prompts=config.max_prompts or config.max_slots, share_prefix=config.share_prefix,
                                   attention=shared_prompt_attention(attention), storage=storage)
    return KVCache(*shape, dtype, device, attention=attention, verify=verify_attention(attention), storage=storage)
