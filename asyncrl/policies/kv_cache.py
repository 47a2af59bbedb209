"""Per-slot KV cache: one fixed row of `max_len` positions per running sequence.

Layout `[layers, slots, kv_heads, max_len, head_dim]` for K and for V. A sequence owns a slot from
admission to finish; the engine keeps running sequences in slots 0..n−1 (moving the last one into a hole
when one finishes), so a decode step reads the contiguous view `[:n]` — no gather, no block table.

Why per-slot rather than paged: RL rollouts have a known budget (prompt + max_new_tokens) per sequence,
so reserving it up front wastes little, and fixed shapes make the decode step capturable in a CUDA graph
with plain PyTorch ops (index_put for the write, SDPA with a length mask for the read) on any device —
no flash-attn, no custom kernel, the same code on CPU for tests. The n samples of one prompt share one
prefill: the prompt's K/V are copied into the sibling slots. A paged cache would save memory on very
long, very uneven budgets; decode reads only up to `attend_len` (a bucket above the longest running
sequence) so short batches do not pay for the full budget.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.num_slots, self.max_len = num_slots, max_len
        self.attend_len = max_len  # decode attends over positions [0, attend_len)
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
        return 2 * n * torch.finfo(self.dtype).bits // 8

    def allocate(self) -> None:
        if self.k is None:
            self.k = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(self.shape, dtype=self.dtype, device=self.device)

    def free(self) -> None:
        self.k = self.v = None

    def write_prefill(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write K/V [B, Hkv, S, D] of whole prompts into `slots` [B] at positions 0..S-1."""
        s = k.shape[2]
        self.k[layer, :, :, :s].index_copy_(0, slots, k)
        self.v[layer, :, :, :s].index_copy_(0, slots, v)

    def write_extend(self, layer: int, slots: Tensor, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write K/V [1, Hkv, S, D] of one row into slot `slots[0]` at positions start..start+S-1; return that
        slot's keys and values [1, Hkv, start + S, D] (the cached prefix and the new positions)."""
        end = start + k.shape[2]
        slot = slots[:1]
        self.k[layer, :, :, start:end].index_copy_(0, slot, k)
        self.v[layer, :, :, start:end].index_copy_(0, slot, v)
        return self.k[layer].index_select(0, slot)[:, :, :end], self.v[layer].index_select(0, slot)[:, :, :end]

    def append_decode(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Write one K/V [B, Hkv, 1, D] per row (row b → slot b, at `positions[b]`); return the keys and values
        [B, Hkv, L, D] of slots 0..B-1 over the first L = `attend_len` positions."""
        b = k.shape[0]
        rows = torch.arange(b, device=k.device)
        cache_k, cache_v = self.k[layer], self.v[layer]
        cache_k[rows, :, positions] = k[:, :, 0]
        cache_v[rows, :, positions] = v[:, :, 0]
        return cache_k[:b, :, :self.attend_len], cache_v[:b, :, :self.attend_len]

    @torch.inference_mode()
    def copy_slot(self, src: int, dst: Tensor | int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot(s) `dst` (all layers). In inference mode
        whoever calls: a cache allocated in inference mode (an engine woken up mid-step) refuses in-place
        writes outside it, and a session's end is called from outside the decode step."""
        if length == 0:
            return
        dst_t = torch.as_tensor(dst, device=self.device).reshape(-1)
        for cache in (self.k, self.v):
            cache[:, dst_t, :, :length] = cache[:, src:src + 1, :, :length]
