"""Mixture-of-experts routers computed in float32, whatever the rest of the model runs in.

    float32_routers(model)        # every router of `model` (`find_routers`), once; returns how many

A router's logits decide which experts a token reaches: in bf16 (bf16 weights, or fp32 weights under bf16
autocast) two experts whose logits differ by less than a bf16 step (~0.4 % of the logit) tie or swap, and the top-k
flips between the learner's passes and against the engine's. Megatron (`--moe-router-dtype fp32`), verl and slime
run the router GEMM in fp32 for that reason; DeepSeek-V3's `transformers` router already does.

Within a router's forward, here: autocast is off and every `F.linear` / matmul runs on float32 operands (a bf16
weight is upcast for the product: its gradient flows back to it in its own dtype), so the logits and the expert
weights are float32. The experts downstream cast the weighted sum back to the hidden states' dtype. The router
keeps its class, parameters and names (checkpoints, publication and routing replay see the same module): only
its instance's `forward` is wrapped. Under FSDP2's bf16 gathers the weight itself carries bf16 precision; the
product and its accumulation are still fp32.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from asyncrl.policies.routing_replay import find_routers

__all__ = ["float32_routers", "is_float32_router"]

_PRODUCTS = (F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.mm, torch.addmm)


class _Float32Products(TorchFunctionMode):
    """Within: the matrix products above run on float32 operands."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PRODUCTS:
            args = tuple(a.float() if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)
            kwargs = {k: v.float() if isinstance(v, Tensor) and v.is_floating_point() else v
                      for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _float32_forward(router: nn.Module):
    """`router`'s forward (its class's) in float32, bound to `router` (a deep copy binds it to the copy)."""
    forward = type(router).forward

    @functools.wraps(forward)
    def run(self, hidden_states: Tensor, *args, **kwargs):
        with torch.autocast(hidden_states.device.type, enabled=False), _Float32Products():
            return forward(self, hidden_states, *args, **kwargs)
    run.float32_router = True
    return types.MethodType(run, router)


def is_float32_router(router: nn.Module) -> bool:
    """Whether `float32_routers` wrapped this router's forward."""
    return getattr(router.forward, "float32_router", False)


def float32_routers(model: nn.Module) -> int:
    """Wrap the forward of every MoE router of `model` (`find_routers`) so its GEMM and logits are float32 (once per
    router: a second call changes nothing). Returns the number of routers (0 for a dense model)."""
    routers = find_routers(model)
    for _, router in routers:
        if not is_float32_router(router):
            router.forward = _float32_forward(router)
    return len(routers)
