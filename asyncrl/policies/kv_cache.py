"""Per-slot KV cache: one fixed row of `max_len` positions per running sequence.

Layout `[layers, slots, kv_heads, max_len, head_dim]` for K and for V. A sequence owns a slot from
admission to finish; the engine keeps running sequences in slots 0..n−1 (moving the last one into a hole
when one finishes), so a decode step reads the contiguous view `[:n]` — no gather, no block table.

Why per-slot rather than paged: RL rollouts have a known budget (prompt + max_new_tokens) per sequence,
so reserving it up front wastes little, and fixed shapes make the decode step capturable in a CUDA graph
with plain PyTorch ops (index_put for the write, SDPA with a length mask for the read) on any device, or,
on CUDA, a Triton split-K kernel that reads each row's own positions only (`decode_attention`). The n samples of one prompt share one
prefill: the prompt's K/V are copied into the sibling slots. A paged cache would save memory on very
long, very uneven budgets; decode reads only up to `attend_len` (a bucket above the longest running
sequence) so short batches do not pay for the full budget.
"""

from __future__ import annotations

from typing import Literal

import torch
from einops import rearrange
from torch import Tensor

from asyncrl.policies.decode_attention import DecodeAttention, VerifyAttention, sdpa_decode

__all__ = ["KVCache", "KVDtype", "kv_storage", "FP8_MAX"]

KVDtype = Literal["auto", "fp8"]
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
"""448: float8 e4m3's largest finite value. K/V are stored unscaled (a scale of 1, as vLLM's default fp8 cache),
clamped to ±448: the e4m3 format has no infinity, and a cast past it gives NaN."""


def kv_storage(kv_dtype: KVDtype, compute: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for `--rollout.kv-dtype`: the model's own ("auto"), or float8 e4m3 ("fp8")."""
    if kv_dtype == "fp8":
        return torch.float8_e4m3fn
    if kv_dtype == "auto":
        return compute
    raise ValueError(f"--rollout.kv-dtype {kv_dtype}: choose auto or fp8")


class KVCache:
    """K/V of every running sequence, stored in `storage` (the compute `dtype` unless `--rollout.kv-dtype fp8`):
    written rounded to it, read back in `dtype` (the decode attention converts what it reads, on the Triton path
    inside the kernel)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, *, attention: DecodeAttention = sdpa_decode,
                 storage: torch.dtype | None = None, verify: VerifyAttention | None = None):
        self.shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.storage = storage or dtype
        self.num_slots, self.max_len = num_slots, max_len
        self.attend_len = max_len  # decode attends over positions [0, attend_len)
        self.attention = attention  # the decode step's attention over a layer's slots
        self.verify = verify  # a speculative step's, several queries a slot (None: SDPA over the span)
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.allocate()

    @property
    def allocated(self) -> bool:
        return self.k is not None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return 2 * n * torch.finfo(self.storage).bits // 8

    def allocate(self) -> None:
        if self.k is None:
            self.k = torch.zeros(self.shape, dtype=self.storage, device=self.device)
            self.v = torch.zeros(self.shape, dtype=self.storage, device=self.device)

    def _stored(self, x: Tensor) -> Tensor:
        """`x` as `_raw` writes it: float8 (clamped to its finite range first) as its bytes; else itself."""
        if self.storage == torch.float8_e4m3fn:
            return x.clamp(-FP8_MAX, FP8_MAX).to(self.storage).view(torch.uint8)
        return x

    def _raw(self, cache: Tensor) -> Tensor:
        """The cache as the writes and copies address it: a float8 cache as its bytes (torch indexes float8 for
        few of the indexed copies the cache makes), any other as itself."""
        return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache

    def _read(self, raw: Tensor) -> Tensor:
        """What `_raw` addressed, in the compute dtype."""
        return (raw.view(self.storage) if self.storage == torch.float8_e4m3fn else raw).to(self.dtype)

    def free(self) -> None:
        self.k = self.v = None

    def write_prefill(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write K/V [B, Hkv, S, D] of whole prompts into `slots` [B] at positions 0..S-1."""
        s = k.shape[2]
        self._raw(self.k)[layer, :, :, :s].index_copy_(0, slots, self._stored(k))
        self._raw(self.v)[layer, :, :, :s].index_copy_(0, slots, self._stored(v))

    def write_extend(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor,
                     span: int, *, in_order: bool = False) -> tuple[Tensor, Tensor]:
        """Write K/V [B, Hkv, S, D] of row b into slot `slots[b]` at `positions[b]` ([B, S]); return the rows'
        keys and values [B, Hkv, span, D] (their cached prefixes and the new positions): views of slots 0..B−1
        when `in_order` (slots[b] == b), else gathered (only their first `span` positions).

        A right-padded row's extra positions lie past its sequence: what they write there is written again
        before a decode step reads it (positions past the slot are clamped to its last, never yet in use)."""
        self._write_rows(layer, slots, positions, k, v)
        keys, values = self._raw(self.k)[layer], self._raw(self.v)[layer]
        if in_order:
            b = slots.shape[0]
            return self._read(keys[:b, :, :span]), self._read(values[:b, :, :span])
        return (self._read(keys[:, :, :span].index_select(0, slots)),
                self._read(values[:, :, :span].index_select(0, slots)))

    def _write_rows(self, layer: int, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """K/V [B, Hkv, S, D] of row b into slot `slots[b]` at `positions[b]` ([B, S]; clamped to the slot's last)."""
        rows = slots[:, None].expand_as(positions)
        at = positions.clamp(max=self.max_len - 1)
        # indexed by [B, S] rows and positions around the head axis, the cache takes [B, S, Hkv, D]
        self._raw(self.k)[layer][rows, :, at] = self._stored(rearrange(k, "b h s d -> b s h d"))
        self._raw(self.v)[layer][rows, :, at] = self._stored(rearrange(v, "b h s d -> b s h d"))

    def attend_decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
        """Write one K/V [B, Hkv, 1, D] per row (row b → slot b, at `positions[b]`), then attend: q [B, H, 1, D]
        over each slot's positions 0..positions[b] (`self.attention`, reading at most `attend_len`) -> [B, H, 1, D]."""
        b = k.shape[0]
        rows = torch.arange(b, device=k.device)
        self._raw(self.k)[layer][rows, :, positions] = self._stored(k[:, :, 0])
        self._raw(self.v)[layer][rows, :, positions] = self._stored(v[:, :, 0])
        return self.attention(q[:, :, 0], self.k[layer], self.v[layer], positions, self.attend_len)[:, :, None]

    def attend_in_order(self, layer: int, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, span: int) -> Tensor:
        """A speculative step's rows, row b in slot b: write K/V [B, Hkv, W, D] at `positions` [B, W] (consecutive,
        below max_len), then attend q [B, H, W, D] causally over each slot (`self.verify`) -> [B, H, W, D]."""
        self._write_rows(layer, torch.arange(k.shape[0], device=k.device), positions, k, v)
        return self.verify(q, self.k[layer], self.v[layer], positions[:, -1], span)

    def prepare(self, rows: int | None = None) -> None:
        """Before a decode step of rows [0, rows): nothing to do for slots that hold whole sequences
        (`SharedPromptKVCache` writes its tables)."""

    def release_row(self, row: int) -> None:
        """Row `row`'s sequence ended (its slot is free): nothing else refers to it here."""

    def move_row(self, src: int, dst: int, written: int) -> None:
        """Row `src`'s sequence now lives in row `dst`: copy its first `written` positions."""
        if self.allocated:
            self.copy_slot(src, dst, written)

    @torch.inference_mode()
    def copy_slot(self, src: int, dst: Tensor | int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot(s) `dst` (all layers). In inference mode
        whoever calls: a cache allocated in inference mode (an engine woken up mid-step) refuses in-place
        writes outside it, and a session's end is called from outside the decode step."""
        if length == 0 or not self.allocated:
            return
        dst_t = torch.as_tensor(dst, device=self.device).reshape(-1)
        for cache in (self._raw(self.k), self._raw(self.v)):
            cache[:, dst_t, :, :length] = cache[:, src:src + 1, :, :length]

    @torch.inference_mode()
    def read_slot(self, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """A copy of the first `length` positions of `slot` (all layers): K and V [layers, Hkv, length, D], as stored
        (a float8 cache's as bytes)."""
        return self._raw(self.k)[:, slot, :, :length].clone(), self._raw(self.v)[:, slot, :, :length].clone()

    @torch.inference_mode()
    def write_slot(self, slot: int, kv: tuple[Tensor, Tensor]) -> None:
        """Write what `read_slot` returned into the first positions of `slot`."""
        k, v = kv
        self._raw(self.k)[:, slot, :, :k.shape[2]] = k
        self._raw(self.v)[:, slot, :, :v.shape[2]] = v

    @torch.inference_mode()
    def swap_slots(self, a: int, b: int, len_a: int, len_b: int) -> None:
        """Exchange the first `len_a` positions of slot `a` with the first `len_b` of slot `b` (all layers)."""
        for cache in (self._raw(self.k), self._raw(self.v)):
            kept = cache[:, a, :, :len_a].clone()
            cache[:, a, :, :len_b] = cache[:, b, :, :len_b]
            cache[:, b, :, :len_a] = kept
