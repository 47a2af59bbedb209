"""The decode attention of a `SharedPromptKVCache`: each row over its prompt (in the prompt pool) and its own
responses (in the response pool), as one softmax.

    attend = shared_prompt_attention(decode)    # beside the engine's decode attention: Triton or SDPA
    out = attend(q, prompt_k, prompt_v, k_cache, v_cache, tables, positions, attend_len)    # [B, H, D]

q [B, H, D] is one query per row (row b in its own slot b, its newest K/V already written at position
positions[b] − row_start[b]); `tables` (`SharedPromptTables`) say which prompt slots each row reads. On CUDA the Triton kernel
reads a prompt slot once for up to `READER_WIDTH` of its rows and merges it with each row's responses through their
log-sum-exps; elsewhere SDPA gathers each row's prompt beside its responses under a mask.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from asyncrl.policies.decode_attention import DecodeAttention, sdpa_decode

__all__ = ["SharedPromptAttention", "sdpa_shared_prompt", "shared_prompt_attention"]

SharedPromptAttention = Callable[..., Tensor]
"""(q, prompt_k, prompt_v, k_cache, v_cache, tables, positions [B], attend_len) -> [B, H, D]."""


def sdpa_shared_prompt(q: Tensor, prompt_k: Tensor, prompt_v: Tensor, k_cache: Tensor, v_cache: Tensor, tables,
                       positions: Tensor, attend_len: int) -> Tensor:
    """SDPA over [the row's prompt segments | its own slot], masked to each segment's positions and the own slot's up
    to positions[b] − row_start[b]: G = H / Hkv queries of each KV head, as `sdpa_decode`."""
    b = q.shape[0]
    prompt_len, own_len = min(attend_len, prompt_k.shape[2]), min(attend_len, k_cache.shape[2])
    keys, values, masks = [], [], []
    seen = torch.arange(prompt_len, device=q.device)[None, :]
    for level in range(tables.levels):
        slots = tables.row_slots[:b, level]
        keys.append(prompt_k[:, :, :prompt_len].index_select(0, slots))
        values.append(prompt_v[:, :, :prompt_len].index_select(0, slots))
        masks.append(seen < tables.row_lens[:b, level][:, None])
    keys.append(k_cache[:b, :, :own_len])
    values.append(v_cache[:b, :, :own_len])
    masks.append(torch.arange(own_len, device=q.device)[None, :] <= (positions - tables.row_start[:b])[:, None])
    mask = torch.cat(masks, 1)[:, None, None, :]  # [B, 1, 1, levels · P + R]
    grouped = rearrange(q, "b (hkv g) d -> b hkv g d", hkv=k_cache.shape[1])
    out = F.scaled_dot_product_attention(grouped, torch.cat(keys, 2).to(q.dtype), torch.cat(values, 2).to(q.dtype),
                                         attn_mask=mask)
    return rearrange(out, "b hkv g d -> b (hkv g) d")


def _triton_shared_prompt(q: Tensor, prompt_k: Tensor, prompt_v: Tensor, k_cache: Tensor, v_cache: Tensor, tables,
                          positions: Tensor, attend_len: int) -> Tensor:
    from asyncrl.policies.triton_decode import triton_shared_prompt_attention
    b = q.shape[0]
    return triton_shared_prompt_attention(q, prompt_k, prompt_v, k_cache, v_cache, tables.reader_slot,
                                          tables.reader_len, tables.reader_rows, positions - tables.row_start[:b] + 1,
                                          attend_len=attend_len)


def shared_prompt_attention(decode: DecodeAttention) -> SharedPromptAttention:
    """The shared-prompt form of the engine's decode attention: Triton beside Triton, SDPA beside SDPA."""
    return sdpa_shared_prompt if decode is sdpa_decode else _triton_shared_prompt
