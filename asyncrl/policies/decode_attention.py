"""How a decode step attends over the KV cache: SDPA under a length mask (any device), or the Triton split-K
kernel of `asyncrl.policies.triton_decode` (CUDA).

    attend = decode_attention("auto", device, dtype, head_dim)     # chosen once, when the engine is built
    out = attend(q, k_cache, v_cache, positions, attend_len)       # [B, H, D]

Both take q [B, H, D] (one query per row, after RoPE), the layer's cache [slots, Hkv, max_len, D] (row b in
slot b, its new K/V already written at `positions[b]`; in q's dtype or float8, which they read back in q's) and
attend to positions 0..positions[b].
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

__all__ = ["DecodeKernel", "DecodeAttention", "VerifyAttention", "decode_attention", "sdpa_decode", "verify_attention"]

DecodeKernel = Literal["auto", "sdpa", "triton"]

DecodeAttention = Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor]
"""(q [B, H, D], k_cache, v_cache [slots, Hkv, max_len, D], positions [B], attend_len) -> [B, H, D]."""


def sdpa_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, attend_len: int) -> Tensor:
    """SDPA over each row's first `attend_len` cached positions, masked past positions[b]: the H query heads
    viewed as G = H / Hkv queries of each KV head, so every cached K/V is read once (no repeat for GQA)."""
    b = q.shape[0]
    seen = torch.arange(attend_len, device=q.device)
    mask = (seen[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, L]
    grouped = rearrange(q, "b (hkv g) d -> b hkv g d", hkv=k_cache.shape[1])  # G queries per KV head
    # a float8 cache (--rollout.kv-dtype fp8) is read back in the queries' dtype
    k, v = (cache[:b, :, :attend_len].to(q.dtype) for cache in (k_cache, v_cache))
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
    return rearrange(out, "b hkv g d -> b (hkv g) d")


def _triton_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, attend_len: int) -> Tensor:
    from asyncrl.policies.triton_decode import triton_decode_attention
    return triton_decode_attention(q, k_cache, v_cache, positions + 1, attend_len=attend_len)


VerifyAttention = Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor]
"""(q [B, H, W, D], k_cache, v_cache [slots, Hkv, max_len, D], last [B], attend_len) -> [B, H, W, D]: W queries a slot
(row b in slot b), query w over positions 0..last[b] − (W − 1 − w)."""


def _triton_verify(q: Tensor, k_cache: Tensor, v_cache: Tensor, last: Tensor, attend_len: int) -> Tensor:
    from asyncrl.policies.triton_decode import triton_decode_attention
    width = q.shape[2]
    flat = rearrange(q, "b h w d -> (b w) h d").contiguous()
    out = triton_decode_attention(flat, k_cache, v_cache, last + 1, attend_len=attend_len, width=width)
    return rearrange(out, "(b w) h d -> b h w d", w=width)


def verify_attention(decode: DecodeAttention) -> VerifyAttention | None:
    """The attention of a speculative step's rows that goes with a decode attention: the Triton kernel's form with
    several queries a slot beside the Triton decode kernel; None beside SDPA (the step then masks SDPA over the span)."""
    return _triton_verify if decode is _triton_decode else None


def decode_attention(kernel: DecodeKernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> DecodeAttention:
    """The decode attention to use. "triton" insists on the kernel (CUDA with Triton, else ValueError); "auto"
    takes it on CUDA when Triton imports and the kernel agrees with SDPA on a probe, else SDPA."""
    if kernel == "sdpa":
        return sdpa_decode
    if kernel not in ("auto", "triton"):
        raise ValueError(f"decode attention {kernel!r}: choose auto, sdpa or triton")
    problem = _triton_problem(torch.device(device), dtype, head_dim)
    if problem is None:
        return _triton_decode
    if kernel == "triton":
        raise ValueError(f"--rollout.decode-attention triton: {problem}; use auto or sdpa")
    return sdpa_decode


@functools.cache
def _triton_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the Triton kernel cannot serve this device and dtype (None: it can). Cached per process: the probe
    compiles the kernel once for the shape family."""
    if device.type != "cuda":
        return f"the Triton decode kernel runs on CUDA devices, not {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    gen = torch.Generator(device=device).manual_seed(0)
    slots, kv_heads, length = 3, 2, 300
    q = torch.randn(slots, 2 * kv_heads, head_dim, generator=gen, device=device).to(dtype)
    k, v = (torch.randn(slots, kv_heads, length, head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
    positions = torch.tensor([0, 150, length - 1], device=device)
    try:
        got = _triton_decode(q, k, v, positions, length).float()
    except Exception as err:  # noqa: BLE001 - a compiler problem must not take the engine down
        warnings.warn(f"decode attention: the Triton kernel failed ({type(err).__name__}: {str(err)[:200]}); "
                      "using SDPA")
        return f"the kernel failed to run ({type(err).__name__})"
    want = sdpa_decode(q.float(), k.float(), v.float(), positions, length)
    tolerance = 8 * torch.finfo(dtype).eps  # bf16: one rounding of outputs of magnitude <= 1, with margin
    if not torch.allclose(got, want, atol=tolerance, rtol=tolerance):
        warnings.warn(f"decode attention: the Triton kernel disagrees with SDPA by {(got - want).abs().max():.3g}; "
                      "using SDPA")
        return "the kernel disagreed with SDPA on a probe"
    return None
