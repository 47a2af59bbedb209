"""What a weight publication sends: the full weights, or, for a LoRA policy, only its adapters.

    for name, tensor in published_weights(state.policy, dtype=torch.bfloat16): ...

A LoRA run's agents hold the frozen base already (they loaded it from the same --model.path) and merge each
publication's adapters into it (`asyncrl.policies.lora.AdapterMerger`), so a publication is megabytes, not
gigabytes. Adapters go in float32, as trained, whatever the engine's dtype: the engine merges in float32 and
rounds once. FSDP2 shards are gathered one tensor at a time (every rank of the trainer group iterates together).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor, nn

from asyncrl.learner.sharding import full_weights
from asyncrl.policies.lora import adapter_tensors, lora_modules

__all__ = ["published_weights", "publishes_adapters"]


def publishes_adapters(model: nn.Module) -> bool:
    """Whether `model` is a LoRA policy, whose publications carry its adapters only."""
    return next(lora_modules(model), None) is not None


def published_weights(model: nn.Module, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) of what a publication of `model` sends: its adapters in float32 for a LoRA
    policy, else every weight (`full_weights`, cast to `dtype`)."""
    if publishes_adapters(model):
        yield from adapter_tensors(model)
    else:
        yield from full_weights(model, dtype=dtype)
