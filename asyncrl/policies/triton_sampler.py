"""The unfiltered sampler as two Triton kernels: inverse-CDF temperature sampling with behaviour log-probs.

    tokens, logprobs = triton_sample(logits, temperature, uniforms)   # [B], [B] <- [B, V], [B], [B]

The same distribution and the same rule as `asyncrl.policies.sampling` (token = the first index whose
cumulative probability exceeds u · total; greedy rows take the first argmax and report log softmax(logits)),
computed in two passes instead of softmax, cumsum and search over [B, V] fp32 tensors:

1. one program per (row, chunk of `CHUNK` tokens) reads the logits once in their own dtype (bf16 logits are
   not copied to fp32 first) and writes the chunk's max, its sum of exp(z - max) and its first argmax;
2. one program per row merges the chunks into the row's log-sum-exp, finds the chunk where u · total falls
   and scans only that chunk for the token.

The chunk size is fixed, never chosen from the batch: a seeded request gets the same token whatever else is
in the batch. Sums are taken in another order than torch's cumsum, so a uniform number that lands within
rounding of a boundary between two tokens may pick the neighbour (the tests bound this with an fp64 CDF).
Importing this module needs Triton; on CPU it runs under `TRITON_INTERPRET=1` (how the tests check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["triton_sample", "CHUNK"]

CHUNK = 8192
"""Tokens per program of the first pass (fixed: results must not depend on the batch)."""


@triton.jit
def _chunk_stats(Logits, Temperature, Max, Sum, ArgVal, ArgIdx, stride_row, vocab, num_chunks,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    b, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.load(Temperature + b)
    scale = tl.where(t > 0, t, 1.0)
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2147483647, tl.int32)
    row = Logits + b * stride_row
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        z = tl.load(row + idx, mask=idx < end, other=float("-inf")).to(tl.float32) / scale
        m_new = tl.maximum(m, z)
        live = m_new > float("-inf")
        s = tl.where(live, s * tl.exp(m - m_new) + tl.exp(z - m_new), 0.0)
        m = m_new
        better = z > best  # strict: each lane keeps its first (lowest) index of its maximum
        best_i = tl.where(better, idx, best_i)
        best = tl.where(better, z, best)
    chunk_max = tl.max(m, 0)
    weights = tl.where(m > float("-inf"), tl.exp(m - chunk_max), 0.0)
    top = tl.max(best, 0)
    at = b * num_chunks + c
    tl.store(Max + at, chunk_max)
    tl.store(Sum + at, tl.sum(s * weights, 0))
    tl.store(ArgVal + at, top)
    tl.store(ArgIdx + at, tl.min(tl.where(best == top, best_i, 2147483647), 0))


@triton.jit
def _pick(Logits, Temperature, Uniforms, Max, Sum, ArgVal, ArgIdx, Tokens, Logp, stride_row, vocab, num_chunks,
          CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.load(Temperature + b)
    scale = tl.where(t > 0, t, 1.0)
    cs = tl.arange(0, CHUNKS_PAD)
    ok = cs < num_chunks
    mc = tl.load(Max + b * num_chunks + cs, mask=ok, other=float("-inf"))
    row_max = tl.max(mc, 0)
    mass = tl.where(ok & (mc > float("-inf")), tl.load(Sum + b * num_chunks + cs, mask=ok, other=0.0)
                    * tl.exp(mc - row_max), 0.0)
    total = tl.sum(mass, 0)
    # u · total, kept strictly below the total (a token of positive probability is always found)
    target = tl.minimum(tl.load(Uniforms + b) * total, total * (1.0 - 5.960464477539063e-08))
    cum = tl.cumsum(mass, 0)
    chunk = tl.min(tl.where(ok & (cum > target), cs, CHUNKS_PAD), 0)
    chunk = tl.where(chunk == CHUNKS_PAD, tl.max(tl.where(mass > 0, cs, -1), 0), chunk)
    left = target - tl.sum(tl.where(cs < chunk, mass, 0.0), 0)
    start = chunk * CHUNK
    end = tl.minimum(start + CHUNK, vocab)
    row = Logits + b * stride_row
    run = left * 0.0
    token = chunk * 0 - 1
    last = chunk * 0 - 1
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        z = tl.load(row + idx, mask=idx < end, other=float("-inf")).to(tl.float32) / scale
        p = tl.where(z > float("-inf"), tl.exp(z - row_max), 0.0)
        crossed = (tl.cumsum(p, 0) + run > left) & (p > 0)
        first = tl.min(tl.where(crossed, idx, 2147483647), 0)
        token = tl.where((token < 0) & (first < 2147483647), first, token)
        last = tl.maximum(last, tl.max(tl.where(p > 0, idx, -1), 0))
        run += tl.sum(p, 0)
    token = tl.where(token < 0, last, token)  # rounding left the target past the chunk's own sum
    # greedy rows: the first index of the row's maximum
    av = tl.load(ArgVal + b * num_chunks + cs, mask=ok, other=float("-inf"))
    ai = tl.load(ArgIdx + b * num_chunks + cs, mask=ok, other=2147483647)
    greedy_token = tl.min(tl.where(av == tl.max(av, 0), ai, 2147483647), 0)
    token = tl.where(t > 0, token, greedy_token)
    z_token = tl.load(row + token).to(tl.float32) / scale
    tl.store(Tokens + b, token.to(tl.int64))
    tl.store(Logp + b, z_token - row_max - tl.log(total))


def triton_sample(logits: Tensor, temperature: Tensor, uniforms: Tensor, *, chunk: int = CHUNK,
                  block: int = 1024, num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """Sample one token per row of `logits` by inverse CDF (see the module docstring).

    Args:
      logits: [B, V] in any float dtype, last dim contiguous.
      temperature: [B] fp32; rows with 0 are greedy.
      uniforms: [B] fp32 in [0, 1).
      chunk, block, num_warps: tokens per first-pass program, tile width, launch (a smaller chunk and block
        keep the CPU interpreter fast in tests; the engine uses the defaults).
    Returns tokens [B] int64 and their behaviour log-probs [B] fp32.
    """
    batch, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("triton_sample: logits need a contiguous last dim")
    num_chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    stats = torch.empty(3, batch, num_chunks, dtype=torch.float32, device=device)
    arg_idx = torch.empty(batch, num_chunks, dtype=torch.int32, device=device)
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    logp = torch.empty(batch, dtype=torch.float32, device=device)
    temperature, uniforms = temperature.float().contiguous(), uniforms.float().contiguous()
    chunk_max, chunk_sum, arg_val = stats[0], stats[1], stats[2]
    _chunk_stats[(batch, num_chunks)](logits, temperature, chunk_max, chunk_sum, arg_val, arg_idx, logits.stride(0),
                                      vocab, num_chunks, CHUNK=chunk, BLOCK=block, num_warps=num_warps)
    _pick[(batch,)](logits, temperature, uniforms, chunk_max, chunk_sum, arg_val, arg_idx, tokens, logp,
                    logits.stride(0), vocab, num_chunks, CHUNK=chunk, BLOCK=block,
                    CHUNKS_PAD=max(2, triton.next_power_of_2(num_chunks)), num_warps=num_warps)
    return tokens, logp
