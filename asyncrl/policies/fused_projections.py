"""One GEMM for the projections that read the same input: q/k/v, and gate/up.

    fuse_projections(model)      # once, by the engine that owns the model
    q, k, v = layer.self_attn.qkv(x)
    gate, up = layer.mlp.gate_up(x)

Generation (prefill, extend, decode: every forward with a KV cache) then runs 4 products per layer instead of
7; a decode step at batch 256 spends a quarter of its time in them, and the small k/v products use the
GPU worst. The Hugging Face-named parameters (`...q_proj.weight`, ...) stay, as views into the fused tensor:
weight updates copied in place by name land in it, and nothing else about the model changes. Forwards
without a cache (the learner's, the reference log-probs') keep the separate products, so their arithmetic
stays the learner's.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FusedProjection", "fuse_projections"]


class FusedProjection:
    """Linear layers of one input as one product; their parameters become views of its weight and bias.

    Not an `nn.Module`: the model's parameters and state dict keep their Hugging Face names and shapes."""

    def __init__(self, linears: Sequence[nn.Linear]):
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])
            biases = [lin.bias for lin in linears]
            self.bias = None if biases[0] is None else torch.cat(biases)
        self.sizes = tuple(lin.out_features for lin in linears)
        for lin, weight in zip(linears, self.weight.split(self.sizes)):
            lin.weight = nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            for lin, bias in zip(linears, self.bias.split(self.sizes)):
                lin.bias = nn.Parameter(bias, requires_grad=False)

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """[..., in] -> one [..., out_i] per fused layer (views of one product)."""
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def fuse_projections(model: nn.Module) -> None:
    """Fuse q/k/v and gate/up of every layer of a `CausalLM` (idempotent). For models used only to generate:
    the parameters are replaced by views, so an optimizer holding the old ones would stop seeing them."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv is None:
            attn.qkv = FusedProjection([attn.q_proj, attn.k_proj, attn.v_proj])
        if mlp.gate_up is None:
            mlp.gate_up = FusedProjection([mlp.gate_proj, mlp.up_proj])
