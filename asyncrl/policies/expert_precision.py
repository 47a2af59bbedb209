"""Mixture-of-experts grouped GEMMs under autocast, as autocast runs every other product.

    autocast_experts(model)       # every experts module of `model` (`find_experts`), once; returns how many

`transformers` runs a MoE layer's experts as grouped GEMMs (`grouped_mm`, its default experts implementation:
one kernel over all experts, each on its own slice of tokens). Autocast does not cover grouped_mm (pytorch issue
174763), so under the learner's default precision, float32 master weights with bf16 autocast, the experts'
products ran in float32. Compiled, it was worse: inductor lowers grouped_mm for bf16 weights only, so
`transformers` took its fallback, a loop over experts whose data-dependent slices break the graph (measured on an
H100, 2026-11-28, OLMoE-1B-7B shape). Attention and the dense layers meanwhile ran in bf16.

Within an experts module's forward, here, while autocast is on for its device: each grouped GEMM, and the
fallback loop (which gets the grouped GEMM instead), runs on operands cast to the autocast dtype, as `F.linear`
under autocast does. The casts are differentiable, so the float32 master weights get float32 gradients. Without
autocast, or with weights already in the autocast dtype (bf16 models, FSDP2's bf16 gathers, a LoRA run's frozen
bf16 base), nothing changes. The module keeps its class, parameters and names; only its instance's `forward` is
wrapped.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["autocast_experts", "find_experts", "is_autocast_experts"]

def _grouped_products() -> tuple:
    """What `transformers`' experts call for their products: torch's grouped GEMM (public and private names) and
    `transformers`' fallback loop (registered as an op when its MoE integration is imported)."""
    fallback = getattr(getattr(torch.ops, "transformers"), "grouped_mm_fallback", None)
    found = [getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None), fallback,
             getattr(fallback, "default", None)]
    return tuple(f for f in found if f is not None)


class _AutocastGroupedProducts(TorchFunctionMode):
    """Within: the grouped products `targets` run as torch's grouped GEMM on `dtype` operands."""

    def __init__(self, dtype: torch.dtype, targets: tuple, grouped_mm):
        super().__init__()
        self.dtype, self.targets, self.grouped_mm = dtype, targets, grouped_mm

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.targets:
            cast = [a.to(self.dtype) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args]
            kwargs = {k: v.to(self.dtype) if isinstance(v, Tensor) and v.is_floating_point() else v
                      for k, v in kwargs.items()}
            return self.grouped_mm(*cast, **kwargs)
        return func(*args, **kwargs)


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The experts modules of `model`: those holding 3-D parameters of their own (one matrix per expert), not
    counting convolutions (a linear-attention layer's 3-D conv1d weight)."""
    return [(name, module) for name, module in model.named_modules()
            if not isinstance(module, nn.modules.conv._ConvNd)
            and any(p.dim() == 3 for p in module.parameters(recurse=False))]


def _autocast_forward(module: nn.Module, targets: tuple):
    """`module`'s forward (its class's) under the grouped products' autocast, bound to `module` (a deep copy binds
    it to the copy)."""
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    forward = type(module).forward

    @functools.wraps(forward)
    def run(self, hidden_states: Tensor, *args, **kwargs):
        device = hidden_states.device.type
        if not torch.is_autocast_enabled(device):
            return forward(self, hidden_states, *args, **kwargs)
        dtype = torch.get_autocast_dtype(device)
        if all(p.dtype == dtype for p in self.parameters(recurse=False) if p.dim() == 3):
            return forward(self, hidden_states, *args, **kwargs)
        with _AutocastGroupedProducts(dtype, targets, grouped_mm):
            return forward(self, hidden_states, *args, **kwargs)
    run.autocast_experts = True
    return types.MethodType(run, module)


def is_autocast_experts(module: nn.Module) -> bool:
    """Whether `autocast_experts` wrapped this experts module's forward."""
    return getattr(module.forward, "autocast_experts", False)


def autocast_experts(model: nn.Module) -> int:
    """Wrap the forward of every experts module of `model` (`find_experts`) so that its grouped GEMMs follow
    autocast (once per module: a second call changes nothing). Returns the number of modules (0 for a dense
    model)."""
    experts = find_experts(model)
    targets = _grouped_products() if experts else ()
    for _, module in experts:
        if not is_autocast_experts(module):
            module.forward = _autocast_forward(module, targets)
    return len(experts)
