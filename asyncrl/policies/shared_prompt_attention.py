"""The decode attention of a `SharedPromptKVCache`: each row over its prompt (in the prompt pool) and its own
responses (in the response pool), as one softmax.

    attend = shared_prompt_attention(decode)    # beside the engine's decode attention: Triton or SDPA
    out = attend(q, prompt_k, prompt_v, k_cache, v_cache, tables, positions, attend_len)    # [B, H, D]

q [B, H, D] is one query per row (row b in response slot b, its newest K/V already written at position
positions[b] − P); `tables` (`SharedPromptTables`) say which prompt slot each row reads. On CUDA the Triton kernel
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
    """SDPA over [the row's prompt | its responses], masked to the prompt's P positions and the responses up to
    positions[b] − P: G = H / Hkv queries of each KV head, as `sdpa_decode`."""
    b = q.shape[0]
    start = tables.row_start[:b]
    prompt_len, response_len = min(attend_len, prompt_k.shape[2]), min(attend_len, k_cache.shape[2])
    prompts = tables.row_prompt[:b]
    keys = torch.cat([prompt_k[:, :, :prompt_len].index_select(0, prompts), k_cache[:b, :, :response_len]], 2)
    values = torch.cat([prompt_v[:, :, :prompt_len].index_select(0, prompts), v_cache[:b, :, :response_len]], 2)
    in_prompt = torch.arange(prompt_len, device=q.device)[None, :] < start[:, None]
    in_response = torch.arange(response_len, device=q.device)[None, :] <= (positions - start)[:, None]
    mask = torch.cat([in_prompt, in_response], 1)[:, None, None, :]  # [B, 1, 1, P + R]
    grouped = rearrange(q, "b (hkv g) d -> b hkv g d", hkv=k_cache.shape[1])
    out = F.scaled_dot_product_attention(grouped, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
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
