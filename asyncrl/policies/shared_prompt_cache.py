"""A KV cache that stores each prompt once for all its samples (`--rollout.kv-layout shared-prompt`).

The per-slot `KVCache` copies a prompt's K/V into each of its n sample slots and a decode step reads it n times.
Here a request's prompt lives in a *prompt slot* of a pool `[layers, prompts, Hkv, max_prompt_len, D]`, and each
sample's slot of a second pool `[layers, slots, Hkv, max_len − max_prompt_len, D]` holds only its response
positions (and a prompt's tokens past max_prompt_len, which the engine writes into each sample's slot). Positions
stay the sequence's own everywhere (a row at position p reads position p′ < P of its prompt slot and p′ ≥ P of its
own slot at p′ − P, P the positions its prompt slot holds), so the model, the samplers and the engine's bookkeeping
do not change: writes are routed by position, and reads see one logical sequence.

A GRPO group of n = 8 samples of a 2,048-token prompt with 512-token responses takes 2,048 + 8·512 positions
instead of 8·2,560: 3.3× fewer, so 3.3× the groups in the same memory. The decode attention
(`asyncrl.policies.shared_prompt_attention`) reads a prompt slot once for up to `READER_WIDTH` of its samples (on
CUDA; SDPA elsewhere gathers it per row) and merges that with each row's responses through their log-sum-exps.

Tables on the device say where each row reads, so a step replays in a CUDA graph: `row_prompt[b]` (the prompt slot
of row b), `row_start[b]` (P), and the readers of the Triton kernel (a prompt slot, its length and up to
`READER_WIDTH` rows). The engine opens a prompt slot when it admits a request (`open`), binds its samples' rows
(`bind`), moves a row when its slot changes (`move_row`) and closes the prompt slot when its last sample ends.
"""

from __future__ import annotations

import dataclasses

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
    """Where decode rows read (device tensors, updated in place between steps).

    row_prompt, row_start: [slots] the prompt slot of row b and its prompt's length P (a free row: slot 0, P 0).
    reader_slot, reader_len: [readers] the prompt slot a reader reads and its length (0: an idle reader).
    reader_rows: [readers, READER_WIDTH] the rows that read it (−1: none).
    """

    row_prompt: Tensor
    row_start: Tensor
    reader_slot: Tensor
    reader_len: Tensor
    reader_rows: Tensor


class SharedPromptKVCache(KVCache):
    """Prompt K/V once per request, response K/V per sample (module docstring). `k`, `v` are the response pool;
    `prompt_k`, `prompt_v` the prompt pool; `max_len` the longest sequence, `max_prompt_len` the longest prompt."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, *, max_prompt_len: int, num_prompts: int,
                 attention: SharedPromptAttention = sdpa_shared_prompt, storage: torch.dtype | None = None):
        if not 0 < max_prompt_len < max_len:
            raise ValueError(f"--rollout.max-prompt-length {max_prompt_len} must lie in [1, {max_len}) "
                             "(the longest sequence; the rest is the responses' room)")
        if num_prompts < 1:
            raise ValueError(f"--rollout.max-prompts {num_prompts} must be >= 1")
        self.max_prompt_len, self.response_len, self.num_prompts = max_prompt_len, max_len - max_prompt_len, num_prompts
        self.prompt_shape = (num_layers, num_prompts, num_kv_heads, max_prompt_len, head_dim)
        readers = num_prompts + num_slots // READER_WIDTH + 1  # a reader per prompt, and one per 8 samples beyond
        dev = torch.device(device)
        self.tables = SharedPromptTables(
            row_prompt=torch.zeros(num_slots, dtype=torch.long, device=dev),
            row_start=torch.zeros(num_slots, dtype=torch.long, device=dev),
            reader_slot=torch.zeros(readers, dtype=torch.long, device=dev),
            reader_len=torch.zeros(readers, dtype=torch.long, device=dev),
            reader_rows=torch.full((readers, READER_WIDTH), -1, dtype=torch.long, device=dev))
        self._free = list(range(num_prompts - 1, -1, -1))  # prompt slots, the lowest popped first
        self._length: dict[int, int] = {}  # an open prompt slot's prompt length
        self._rows: dict[int, list[int]] = {}  # an open prompt slot's rows
        self._row_prompt = [-1] * num_slots  # host copy of the row table
        self._dirty = False  # the host's tables changed since they were last written to the device
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

    def open(self, length: int) -> int:
        """A prompt slot for a prompt of `length` tokens, which holds its first `max_prompt_len` (the rest goes to
        each sample's slot); ValueError when none is free."""
        length = min(length, self.max_prompt_len)
        if length < 1:
            raise ValueError("an empty prompt has nothing to share")
        if not self._free:
            raise ValueError(f"all {self.num_prompts} prompt slots are in use (--rollout.max-prompts)")
        slot = self._free.pop()
        self._length[slot], self._rows[slot] = length, []
        return slot

    def bind(self, rows: list[int], prompt: int) -> None:
        """Rows (sample slots) now read prompt slot `prompt`."""
        for row in rows:
            self._row_prompt[row] = prompt
            self._rows[prompt].append(row)
        self._dirty = True

    def move_row(self, src: int, dst: int, written: int) -> None:
        """Row `src`'s sequence now lives in row `dst`: its first `written` positions' responses are copied."""
        prompt = self._row_prompt[src]
        if self.allocated:
            self.copy_slot(src, dst, written - self._length[prompt])
        self.release_row(dst)
        rows = self._rows[prompt]
        rows[rows.index(src)] = dst
        self._row_prompt[src], self._row_prompt[dst] = -1, prompt
        self._dirty = True

    def release_row(self, row: int) -> None:
        """Row `row` reads no prompt any more (its sample ended); its prompt slot closes with its last row."""
        prompt = self._row_prompt[row]
        if prompt < 0:
            return
        self._row_prompt[row] = -1
        self._rows[prompt].remove(row)
        if not self._rows[prompt]:
            del self._rows[prompt], self._length[prompt]
            self._free.append(prompt)
        self._dirty = True

    def prepare(self) -> None:
        """Write the host's row and reader tables to the device if they changed (before a step: not while a graph
        is captured; stream-ordered, so after the step in flight)."""
        if not self._dirty:
            return
        self._dirty = False
        t = self.tables
        start = [self._length.get(p, 0) for p in self._row_prompt]
        t.row_prompt.copy_(torch.tensor([max(p, 0) for p in self._row_prompt]))
        t.row_start.copy_(torch.tensor(start))
        readers = [(p, rows[i:i + READER_WIDTH]) for p, rows in self._rows.items()
                   for i in range(0, len(rows), READER_WIDTH)]
        count = t.reader_slot.shape[0]
        slot, length = [0] * count, [0] * count
        members = [[-1] * READER_WIDTH for _ in range(count)]
        for i, (p, rows) in enumerate(readers):
            slot[i], length[i] = p, self._length[p]
            members[i][:len(rows)] = rows
        t.reader_slot.copy_(torch.tensor(slot))
        t.reader_len.copy_(torch.tensor(length))
        t.reader_rows.copy_(torch.tensor(members))

    def prompt_length(self, prompt: int) -> int:
        return self._length[prompt]

    # ---------------------------------------------------------------- writes and reads
    def write_prefill(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write K/V [B, Hkv, S, D] of whole prompts into prompt slots `slots` [B] at positions 0..S−1."""
        s = k.shape[2]
        self._raw(self.prompt_k)[layer, :, :, :s].index_copy_(0, slots, self._stored(k))
        self._raw(self.prompt_v)[layer, :, :, :s].index_copy_(0, slots, self._stored(v))

    def _write_rows(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """K/V [B, Hkv, S, D] of row b at its sequence's `positions[b]` ([B, S]): the response part (p ≥ P) into
        response slot `slots[b]`, anything before P into the row's prompt slot (clamped to each pool's last)."""
        self.prepare()
        t = self.tables
        start = t.row_start[slots][:, None]
        response = positions >= start
        rows = slots[:, None].expand_as(positions)
        prompts = t.row_prompt[slots][:, None].expand_as(positions)
        at_response = (positions - start).clamp(0, self.response_len - 1)
        at_prompt = positions.clamp(max=self.max_prompt_len - 1)
        for cache, prompt_cache, x in ((self.k, self.prompt_k, k), (self.v, self.prompt_v, v)):
            stored = self._stored(rearrange(x, "b h s d -> b s h d"))
            self._raw(cache)[layer][rows[response], :, at_response[response]] = stored[response]
            self._raw(prompt_cache)[layer][prompts[~response], :, at_prompt[~response]] = stored[~response]

    def read_rows(self, layer: int, slots: Tensor, span: int) -> tuple[Tensor, Tensor]:
        """Rows `slots` [B] as one sequence each: K and V [B, Hkv, span, D] of positions 0..span−1, in `dtype`."""
        self.prepare()
        t = self.tables
        seen = torch.arange(span, device=slots.device)
        start = t.row_start[slots][:, None]
        in_prompt = (seen[None, :] < start)[:, None, :, None]  # [B, 1, span, 1]
        at = (seen[None, :] - start).clamp(0, self.response_len - 1)  # [B, span]
        out = []
        for cache, prompt_cache in ((self.k, self.prompt_k), (self.v, self.prompt_v)):
            responses = self._raw(cache)[layer].index_select(0, slots)  # [B, Hkv, R, D]
            index = at[:, None, :, None].expand(-1, responses.shape[1], -1, responses.shape[3])
            shifted = responses.gather(2, index)
            prompt = self._raw(prompt_cache)[layer].index_select(0, t.row_prompt[slots])[:, :, :min(span, self.max_prompt_len)]
            if prompt.shape[2] < span:
                prompt = torch.cat([prompt, prompt.new_zeros(*prompt.shape[:2], span - prompt.shape[2], prompt.shape[3])], 2)
            out.append(self._read(torch.where(in_prompt, prompt, shifted)))
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

    def attend_in_order(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, span: int) -> Tensor:
        raise NotImplementedError("speculative steps over shared prompts: --rollout.kv-layout shared-prompt refuses "
                                  "--rollout.speculation.tokens > 0")

    @torch.inference_mode()
    def copy_slot(self, src: int, dst: Tensor | int, length: int) -> None:
        """Copy the first `length` response positions of slot `src` into slot(s) `dst` (all layers)."""
        super().copy_slot(src, dst, max(0, min(length, self.response_len)))

    def read_slot(self, slot: int, length: int):
        raise NotImplementedError("held sessions over shared prompts: use --rollout.kv-layout slot")

    write_slot = swap_slots = read_slot


def build_kv_cache(model: CausalLM, config: EngineConfig, attention: DecodeAttention) -> KVCache:
    """The engine's cache for `config.kv_layout`, with `attention` (the decode attention chosen for the device)."""
    cfg, dtype, device = model.config, model.dtype, model.device
    storage = kv_storage(config.kv_dtype, dtype)
    shape = (cfg.num_layers, config.max_slots, cfg.num_kv_heads, config.max_len, cfg.head_dim)
    if config.kv_layout == "shared-prompt":
        return SharedPromptKVCache(*shape, dtype, device, max_prompt_len=config.max_prompt_len,
                                   num_prompts=config.max_prompts or config.max_slots,
                                   attention=shared_prompt_attention(attention), storage=storage)
    return KVCache(*shape, dtype, device, attention=attention, verify=verify_attention(attention), storage=storage)
