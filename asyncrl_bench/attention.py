"""The decode-attention benchmark (`asyncrl bench attention`): one layer's decode attention over the KV cache,
each kernel on the same cache, against the HBM bandwidth roofline.

    asyncrl bench attention                                        # GPU: Qwen3-1.7B shape, SDPA vs Triton vs flex
    asyncrl bench attention --model random:qwen3-8b --contexts 4096 16384 --batch-sizes 8 64

Per (batch, context): row b attends to `lengths[b]` cached positions — all `context` (`--lengths full`) or
uniform in [1, context] (`ragged`, as rows of a continuous batch are). Kernels:
* `sdpa` — what the engine ran before: SDPA over the first `context` positions of every row under a length mask;
* `triton` — `asyncrl.policies.triton_decode` (reads each row's own positions, split-K for small batches);
* `triton-tf32` — the same with tf32 probabilities in the weighted sum of values (bf16 otherwise);
* `flex` — `torch.nn.attention.flex_attention` (compiled) with a block mask of the lengths, made once per case
  (outside the timing; an engine would make it every step).
Time per call from CUDA events over `--iters` calls after a warm-up; `max_diff_vs_fp32` is each kernel's largest
difference from SDPA in fp32 on the same cache (first 8 rows). The roofline is the K/V bytes the rows must
read (Σ lengths × 2 × Hkv × D × element size) at the device's nominal bandwidth; `fraction` is how close a kernel gets.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import torch

from asyncrl.launch.device_checks import known_model_config
from asyncrl.policies.decode_attention import sdpa_decode
from asyncrl_bench.roofline import peak_bandwidth
from asyncrl_bench.shared import device_name, write_json
from asyncrl_bench.timing import cuda_time_us

__all__ = ["AttentionBenchArgs", "bench_attention"]

Kernel = Literal["sdpa", "triton", "triton-tf32", "flex"]


@dataclasses.dataclass
class AttentionBenchArgs:
    """Decode attention kernels on one layer's KV cache: microseconds per call and the fraction of the HBM roofline."""

    model: str = "random:qwen3-1.7b"
    """A 'random:<preset>' or HF dir: only its shape (heads, KV heads, head_dim) is used."""
    batch_sizes: tuple[int, ...] = (8, 64, 256)
    contexts: tuple[int, ...] = (384, 2048, 8192)
    """Cached positions of the longest row."""
    lengths: Literal["full", "ragged"] = "ragged"
    """full: every row attends to the whole context; ragged: row lengths uniform in [1, context]."""
    kernels: tuple[Kernel, ...] = ("sdpa", "triton", "triton-tf32", "flex")
    dtype: str = "bfloat16"
    iters: int = 50
    max_cache_gb: float = 24.0
    """Skip (batch, context) cases whose K/V would exceed this."""
    seed: int = 0
    out: str | None = None


def _shape(path: str) -> tuple[int, int, int]:
    cfg = known_model_config(path)
    if cfg is None:
        raise ValueError(f"--model {path}: not a known preset or config.json")
    return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim


def _flex(q, k, v, lengths):
    """flex_attention with a block mask of the lengths; returns a callable of no arguments."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._dynamo.reset()  # each case compiles afresh: past the recompile limit flex would fall back to eager
    compiled = torch.compile(flex_attention, dynamic=False)

    def keep(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    mask = create_block_mask(keep, q.shape[0], None, 1, k.shape[2], device=q.device)
    q4 = q[:, :, None]
    return lambda: compiled(q4, k, v, block_mask=mask, enable_gqa=True)


def _callable(kernel: Kernel, q, k, v, lengths, context: int):
    if kernel == "sdpa":
        positions = lengths - 1
        return lambda: sdpa_decode(q, k, v, positions, context)
    if kernel in ("triton", "triton-tf32"):
        from asyncrl.policies.triton_decode import triton_decode_attention  # imports Triton: only where it runs
        tf32 = kernel == "triton-tf32"
        return lambda: triton_decode_attention(q, k, v, lengths, attend_len=context, pv_tf32=tf32)
    return _flex(q, k, v, lengths)


def _case(args: AttentionBenchArgs, shape, batch: int, context: int, bandwidth: float | None) -> dict | None:
    heads, kv_heads, dim = shape
    dtype = getattr(torch, args.dtype)
    elem = torch.finfo(dtype).bits // 8
    if 2 * batch * kv_heads * context * dim * elem > args.max_cache_gb * 2**30:
        return None
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    k, v = (torch.randn(batch, kv_heads, context, dim, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    q = torch.randn(batch, heads, dim, generator=gen, device="cuda", dtype=dtype)
    if args.lengths == "full":
        lengths = torch.full((batch,), context, device="cuda")
    else:
        lengths = torch.randint(1, context + 1, (batch,), generator=gen, device="cuda")
    need = int(lengths.sum()) * 2 * kv_heads * dim * elem
    row = {"device": device_name("cuda"), "model": args.model, "batch": batch, "context": context,
           "lengths": args.lengths, "kv_bytes": need, "peak_bandwidth": bandwidth,
           "roofline_us": need / bandwidth * 1e6 if bandwidth else None}
    few = min(batch, 8)  # the reference: SDPA in fp32 on the same (rounded) K/V, for the first rows
    reference = sdpa_decode(q[:few].float(), k[:few].float(), v[:few].float(), lengths[:few] - 1, context)
    for kernel in args.kernels:
        try:
            fn = _callable(kernel, q, k, v, lengths, context)
            out = fn().reshape(batch, heads, dim)[:few].float()
            us = cuda_time_us(fn, args.iters)
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run this case is reported, not fatal
            row[f"{kernel}_error"] = f"{type(err).__name__}: {str(err)[:160]}"
            continue
        row[f"{kernel}_us"] = us
        row[f"{kernel}_fraction"] = need / bandwidth / (us * 1e-6) if bandwidth else None
        row[f"{kernel}_max_diff_vs_fp32"] = float((out - reference).abs().max())
    return row


def bench_attention(args: AttentionBenchArgs) -> list[dict]:
    """Run the decode-attention benchmark; print one JSON row per (batch, context) and return them."""
    if not torch.cuda.is_available():
        raise ValueError("the attention benchmark needs a CUDA device (the Triton kernel runs there)")
    shape, bandwidth = _shape(args.model), peak_bandwidth("cuda")
    rows = []
    for batch in args.batch_sizes:
        for context in args.contexts:
            row = _case(args, shape, batch, context, bandwidth)
            if row is not None:
                rows.append(row)
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    write_json(args.out, rows)
    return rows
