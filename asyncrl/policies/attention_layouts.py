"""How rows attend when they are not plain right-padded sequences: packed documents (training) and
continuations of cached sequences (generation). `CausalLM.forward` takes either."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

__all__ = ["CacheExtension", "DocumentLayout", "packed_attention_mask"]


@dataclasses.dataclass(frozen=True)
class CacheExtension:
    """Rows that continue the sequences cached in their slots (new turns of conversations whose earlier
    turns are cached): row b's tokens, right-padded to the longest row's, take positions starts[b].. and
    attend to the slot's cached positions 0..starts[b]-1 and causally to each other.

    starts: [B] long, on the model's device.
    span: the key positions any row attends to (max of start + new tokens), on the host.
    in_order: row b continues slot b (a speculative step's running rows): the keys are read in place rather than
      gathered from the cache_slots.
    """

    starts: Tensor
    span: int
    in_order: bool = False


@dataclasses.dataclass(frozen=True)
class DocumentLayout:
    """Sequences packed end to end into one row of length L = Σ lengths; each attends causally to itself only.

    lengths: the sequences' lengths, on the host (for splitting without a device sync).
    cu_seqlens: [D + 1] int32 offsets (0, l0, l0 + l1, ...) on the model's device.
    """

    lengths: tuple[int, ...]
    cu_seqlens: Tensor
    max_len: int = dataclasses.field(init=False)  # the longest sequence (the flash kernel's launch bound)
    flash: Any = dataclasses.field(init=False, repr=False)  # varlen flash attention on CUDA, else None

    def __post_init__(self):
        # resolved here, outside any compiled region, so a compiled layer only calls it
        object.__setattr__(self, "max_len", max(self.lengths))
        object.__setattr__(self, "flash", _varlen_attention() if self.cu_seqlens.is_cuda else None)

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Document-causal attention of q [1, H, L, D] over k, v [1, Hkv, L, D] -> [1, H, L, D].

        CUDA in bf16/fp16 (or under autocast, which SDPA would follow too): one flash-attention call over
        all documents (`torch.nn.attention.varlen`). Otherwise (CPU, fp32): causal SDPA per document — the
        same arithmetic as a padded row, with no padding and no L × L mask."""
        if q.is_cuda and torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if self.flash is not None and q.dtype in (torch.bfloat16, torch.float16):
            tokens_first = (rearrange(t, "1 h l d -> l h d") for t in (q, k, v))  # the varlen kernel's layout
            out = self.flash(*tokens_first, self.cu_seqlens, self.max_len)
            return rearrange(out, "l h d -> 1 h l d")
        gqa = q.shape[1] != k.shape[1]
        parts = [F.scaled_dot_product_attention(qd, kd, vd, is_causal=qd.shape[2] > 1, enable_gqa=gqa)
                 for qd, kd, vd in zip(*(t.split(self.lengths, dim=2) for t in (q, k, v)))]
        return torch.cat(parts, dim=2)


@functools.cache
def _varlen_attention():
    """torch's variable-length flash attention as f(q, k, v, cu_seqlens, max_len) with causal masking and
    grouped K/V heads ([L, H, D] layouts), or None where this torch has none. The one place that knows the
    API's versions: torch 2.10 takes `is_causal`, 2.11+ `window_size=(-1, 0)`; flash attention reads
    grouped K/V heads natively (2.13 also asks for `enable_gqa`)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    grouped = dict(causal, enable_gqa=True) if "enable_gqa" in params else causal
    return functools.partial(_call_varlen, varlen_attn, causal, grouped)


def _call_varlen(varlen_attn, causal: dict, grouped: dict, q: Tensor, k: Tensor, v: Tensor, cu: Tensor,
                 max_len: int) -> Tensor:
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **(grouped if q.shape[1] != k.shape[1] else causal))


def packed_attention_mask(seq_lens: list[int] | Tensor, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    """Positions [1, S] and a block-diagonal causal mask [1, 1, S, S] for sequences packed into one row.

    The mask is O(S²) booleans: fine for CPU tests and moderate token budgets.
    """
    lens = torch.as_tensor(seq_lens, device=device, dtype=torch.long)
    if lens.dim() != 1 or bool((lens <= 0).any()):
        raise ValueError(f"packed_attention_mask: seq_lens must be positive lengths, got {lens.tolist()}")
    doc = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    positions = torch.arange(int(lens.sum()), device=device) - torch.repeat_interleave(starts, lens)
    causal = positions.new_ones(len(doc), len(doc), dtype=torch.bool).tril()
    mask = causal & (doc[:, None] == doc[None, :])
    return positions[None], mask[None, None]
