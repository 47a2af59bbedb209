"""Decode attention over the per-slot KV cache as a Triton kernel (split-K "flash decoding").

    out = triton_decode_attention(q, k_cache, v_cache, lengths)   # [B, H, D] <- [B, H, D], [S, Hkv, L, D] x 2, [B]

Row b attends to the first `lengths[b]` positions of slot b. One program per (row, KV head, split) loads the
G = H / Hkv query heads that share its KV head, reads each of its K/V positions once (grouped-query attention
without repeating K/V) and keeps an online softmax in fp32; splits of one row are merged by a second small
kernel through their log-sum-exps. Compared with SDPA over the cache under a length mask, a row reads only
its own positions, not the longest row's bucket, and a decode-shaped query (G rows) keeps every SM busy.

The grid depends only on (B, Hkv, splits): the kernel is captured in CUDA graphs like the rest of the step,
the lengths are read from device memory at replay. Importing this module needs Triton; on CPU it runs under
`TRITON_INTERPRET=1` (how the tests check it against SDPA).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["triton_decode_attention", "triton_shared_prompt_attention", "choose_splits"]


@triton.jit
def _partial(Q, K, V, Lengths, O, Lse, Out, Slots, Rows,
             stride_qb, stride_qh, stride_ks, stride_kh, stride_kl, stride_vs, stride_vh, stride_vl,
             stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
             scale_log2, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
             DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PV_TF32: tl.constexpr,
             PRECISION: tl.constexpr, WIDTH: tl.constexpr, GATHER: tl.constexpr = False,
             SPLIT_BASE: tl.constexpr = 0, PARTIAL: tl.constexpr = False):
    # WIDTH queries a slot (a speculative step's newest token and draft): tile row r is query r // GROUP of slot b,
    # head kv_head·GROUP + r % GROUP; query w sees the slot's first length − (WIDTH − 1 − w) positions (causal).
    # GATHER (a shared prompt's readers): program b reads slot Slots[b] for the rows Rows[b, w] (−1: none), each over
    # all `length` positions; its partial results go to splits SPLIT_BASE.. of O and Lse (PARTIAL: never to Out)
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(Lengths + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    r = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    w, g = r // GROUP, r % GROUP
    heads = kv_head * GROUP + g
    g_ok, d_ok = r < GROUP * WIDTH, d < HEAD_DIM
    if GATHER:
        slot = tl.load(Slots + b)
        rows = tl.load(Rows + b * WIDTH + w, mask=g_ok, other=-1)
        g_ok = g_ok & (rows >= 0)
        rows = tl.where(g_ok, rows, 0)
        limit = length + 0 * w
    else:
        slot = b
        rows = b * WIDTH + w  # the query's row of Q, O, Lse and Out
        limit = length - (WIDTH - 1 - w)
    q = tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    k_row = K + slot * stride_ks + kv_head * stride_kh
    v_row = V + slot * stride_vs + kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_row + n[:, None] * stride_kl + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)  # fp8 cache
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G, N], log2 units
        scores = tl.where(n_ok[None, :] & (n[None, :] < limit[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query that sees none of these keys yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_row + n[:, None] * stride_vl + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if PV_TF32:  # probabilities kept to tf32's 10 bits (rounded to the cache's dtype otherwise)
            pv = tl.dot(p, v.to(tl.float32), input_precision="tf32")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.maximum(total, 1e-30)[:, None]  # an empty split (start >= length) stays 0, weight 0 below
    if SPLITS == 1 and not PARTIAL:
        tl.store(Out + rows[:, None] * stride_outb + heads[:, None] * stride_outh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        at = SPLIT_BASE + split
        tl.store(O + rows[:, None] * stride_ob + heads[:, None] * stride_oh + at * stride_os + d[None, :], out,
                 mask=g_ok[:, None] & d_ok[None, :])
        lse = tl.where(total > 0, m + tl.log2(tl.maximum(total, 1e-30)), float("-inf"))
        tl.store(Lse + rows * stride_lb + heads * stride_lh + at, lse, mask=g_ok)


@triton.jit
def _merge(O, Lse, Out, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
           HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_ok, d_ok = s < SPLITS, d < HEAD_DIM
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # some split is never empty (a row's own newest position): finite max
    seen = lse > float("-inf")  # a split with no keys may hold no partial result (a row no shared prompt reader has)
    parts = tl.load(O + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                    mask=(s_ok & seen)[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(Out + b * stride_outb + h * stride_outh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def choose_splits(batch: int, kv_heads: int, attend_len: int, *, programs: int = 264, block_n: int = 64) -> int:
    """Splits per (row, KV head): enough programs to fill the GPU (`programs`, two per SM of an H100) when the
    batch is small, never a split shorter than 4 blocks of keys."""
    wanted = math.ceil(programs / max(1, batch * kv_heads))
    return max(1, min(wanted, attend_len // (4 * block_n), 16))


def triton_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, *,
                            attend_len: int, block_n: int = 64, splits: int | None = None,
                            pv_tf32: bool = False, num_warps: int = 4, num_stages: int = 2, width: int = 1) -> Tensor:
    """Attention of one query per row over its slot's first `lengths[b]` cached positions (or of `width` queries a
    slot, causal among themselves: a speculative step's newest token and draft).

    Args:
      q: [B, H, D] queries (after RoPE), the model's dtype; the cache in it or in float8 (converted as loaded).
        With width W: [B·W, H, D], row b·W + w the w-th query of slot b, which sees its first
        lengths[b] − (W − 1 − w) positions.
      k_cache, v_cache: [slots, Hkv, max_len, D], slot b holding row b (slots >= B; last dim contiguous).
      lengths: [B] integer, W <= lengths[b] <= attend_len.
      attend_len: an upper bound of the lengths, on the host (chooses the split count; one per graph shape).
      splits: splits per (row, KV head) instead of `choose_splits`'.
      pv_tf32: weight the values with tf32 probabilities instead of probabilities rounded to the cache's dtype.
      block_n, num_warps, num_stages: the kernel's tile of keys and launch (tuned on an H100: BENCHMARKS.md).
    Returns [B, H, D] in q's dtype, scaled by 1/sqrt(D).
    """
    rows, heads, dim = q.shape
    b = rows // width
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"triton_decode_attention: {heads} query heads over {kv_heads} KV heads, contiguous last dims")
    group = heads // kv_heads
    splits = splits or choose_splits(b, kv_heads, attend_len, block_n=block_n)
    out = torch.empty_like(q)
    parts = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device) if splits > 1 else out
    lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device) if splits > 1 else out
    dim_pad = max(16, triton.next_power_of_2(dim))
    scale_log2 = (1.0 / math.sqrt(dim)) * 1.4426950408889634  # softmax in base 2
    _partial[(b, kv_heads, splits)](
        q, k_cache, v_cache, lengths, parts, lse, out, lengths, lengths,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        parts.stride(0), parts.stride(1), parts.stride(2) if splits > 1 else 0,
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), scale_log2,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group * width)), HEAD_DIM=dim, DIM_PAD=dim_pad,
        BLOCK_N=block_n, SPLITS=splits, PV_TF32=pv_tf32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
        WIDTH=width)
    if splits > 1:
        _merge[(rows, heads)](parts, lse, out, parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0),
                           lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=dim, DIM_PAD=dim_pad,
                           SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
    return out


def triton_shared_prompt_attention(q: Tensor, prompt_k: Tensor, prompt_v: Tensor, k_cache: Tensor, v_cache: Tensor,
                                   reader_slot: Tensor, reader_len: Tensor, reader_rows: Tensor, response_len: Tensor,
                                   *, attend_len: int, block_n: int = 128, num_warps: int = 4,
                                   num_stages: int = 2, splits: tuple[int, int] | None = None) -> Tensor:
    """Attention of one query per row over its prompt, read once per reader, and its own responses.

    Args:
      q: [B, H, D] queries (after RoPE).
      prompt_k, prompt_v: [prompts, Hkv, max_prompt_len, D], the prompts' K/V.
      k_cache, v_cache: [slots, Hkv, response_len, D], row b's responses in slot b.
      reader_slot, reader_len: [levels, R] the prompt slot reader r of a level reads and how many positions (0: an
        idle reader); a row's prompt is one segment a level (a shared prefix, then its own prompt).
      reader_rows: [levels, R, W] the rows (< B) that share reader r's read (−1: none); a row is in at most one reader
        a level.
      response_len: [B] the cached responses of row b, >= 1 (its newest position included).
      attend_len: an upper bound of both lengths, on the host (chooses the split counts).
      splits: (prompt, response) splits instead of `choose_splits`' (a reader's prompt, a row's responses).
      block_n, num_warps, num_stages: tuned on an H200 at Qwen3-1.7B/8B shapes, 2,048-token prompts × 8 samples
        (docs/benchmarks/shared-prompt-kv-2026-11-28.md).
    Returns [B, H, D] in q's dtype: the softmax over the prompt's keys and the responses' together.
    """
    rows, heads, dim = q.shape
    levels, readers, width = reader_rows.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or k_cache.stride(-1) != 1 or prompt_k.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"triton_shared_prompt_attention: {heads} query heads over {kv_heads} KV heads, "
                         "contiguous last dims")
    group = heads // kv_heads
    prompt_splits, response_splits = splits or (
        choose_splits(max(1, rows // width), kv_heads, min(attend_len, prompt_k.shape[2]), block_n=block_n),
        choose_splits(rows, kv_heads, min(attend_len, k_cache.shape[2]), block_n=block_n))
    splits = levels * prompt_splits + response_splits
    out = torch.empty_like(q)
    parts = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    lse[:, :, :levels * prompt_splits].fill_(float("-inf"))  # rows no reader serves (padding) keep no prompt part
    dim_pad = max(16, triton.next_power_of_2(dim))
    scale_log2 = (1.0 / math.sqrt(dim)) * 1.4426950408889634
    common = dict(GROUP=group, HEAD_DIM=dim, DIM_PAD=dim_pad, BLOCK_N=block_n, PV_TF32=False,
                  PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps,
                  num_stages=num_stages, PARTIAL=True)
    strides = (parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1), out.stride(0),
               out.stride(1), scale_log2)
    for level in range(levels):  # each level's partial results in splits of their own
        _partial[(readers, kv_heads, prompt_splits)](
            q, prompt_k, prompt_v, reader_len[level], parts, lse, out, reader_slot[level], reader_rows[level],
            q.stride(0), q.stride(1), prompt_k.stride(0), prompt_k.stride(1), prompt_k.stride(2),
            prompt_v.stride(0), prompt_v.stride(1), prompt_v.stride(2), *strides,
            GROUP_PAD=max(16, triton.next_power_of_2(group * width)), SPLITS=prompt_splits, WIDTH=width, GATHER=True,
            SPLIT_BASE=level * prompt_splits, **common)
    _partial[(rows, kv_heads, response_splits)](
        q, k_cache, v_cache, response_len, parts, lse, out, response_len, response_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *strides,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), SPLITS=response_splits, WIDTH=1, GATHER=False,
        SPLIT_BASE=levels * prompt_splits, **common)
    _merge[(rows, heads)](parts, lse, out, parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0),
                       lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=dim, DIM_PAD=dim_pad,
                       SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
    return out
