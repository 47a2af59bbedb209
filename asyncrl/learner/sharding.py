"""FSDP2 for the trainer group: sharding a model, the global gradient norm over sharded gradients, and
gathering full weights for publication."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

__all__ = ["shard_model", "sharding_options", "layer_precision", "grad_norm_", "full_weights", "compute_device"]


def grad_norm_(params: list[nn.Parameter], max_norm: float, group=None) -> Tensor:
    """Global L2 norm of the gradients, and (max_norm > 0) scale them in place by min(1, max_norm / norm).

        ‖g‖ = sqrt(Σ_ranks Σ_shards ‖g_shard‖²)   — one all-reduce of one scalar over `group`

    FSDP2 gradients are DTensors sharded on dim 0: each rank squares its own shards and the sum is
    all-reduced once: one collective, whatever the number of parameters, outside DTensor's dispatch.
    Replicated tensors count once. Returns the norm (a 0-d tensor on the gradients' device).
    """
    locals_, scale = [], []
    for p in params:
        g = p.grad
        if hasattr(g, "to_local"):
            shards = sum(pl.is_shard() for pl in g.placements)
            scale.append(1.0 if shards else 1.0 / dist.get_world_size(group))  # replicated: every rank has it
            g = g.to_local()
        else:
            scale.append(1.0 / dist.get_world_size(group) if group is not None else 1.0)
        locals_.append(g)
    squares = torch.stack([torch.linalg.vector_norm(g.float()) ** 2 * w for g, w in zip(locals_, scale)]).sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
    return norm


def compute_device(model: nn.Module) -> torch.device:
    """Where `model` computes: its parameters' device, or, for FSDP2 with CPU offload (parameters on the host),
    the device of its mesh."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None and mesh.device_type != p.device.type:
        return torch.device(mesh.device_type, torch.cuda.current_device() if mesh.device_type == "cuda" else None)
    return p.device


def layer_precision(*, mixed_precision: bool) -> MixedPrecisionPolicy | None:
    """A decoder layer's FSDP2 precision policy: with `mixed_precision` its fp32 shards are all-gathered as bf16
    (half the bytes gathered and held) and its gradients reduce-scattered in fp32 onto the fp32 shards, which
    stay the master weights the optimizer steps. Forward inputs are not cast (`cast_forward_inputs=False`): the
    residual stream stays fp32, as in one process under autocast, where each linear layer's matmul runs in bf16
    anyway; only the layer's own small weights (norms, biases) are rounded to bf16 on the way."""
    if not mixed_precision:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def sharding_options(config, device_type: str) -> dict[str, bool]:
    """`shard_model`'s options for a trainer group on `device_type` from its `TrainerConfig`: bf16 layer gathers
    where the group computes under bf16 autocast on GPUs (`layer_precision`), and its reshard setting."""
    return {"mixed_precision": device_type == "cuda" and config.autocast_bf16,
            "reshard_after_forward": config.fsdp_reshard_after_forward}


def shard_model(model: nn.Module, mesh=None, *, mixed_precision: bool = False, offload: bool = False,
                reshard_after_forward: bool = True) -> nn.Module:
    """Shard a CausalLM / ValueModel with FSDP2 (`fully_shard`): each decoder layer, then the root.

    The root (embeddings, final norm, heads) stays gathered from its forward to the end of its backward, so
    the heads (`logits`, `values`, called after forward()) use its full weights directly: one all-gather and
    one reduce-scatter of the root per micro-batch, whatever the number of LM-head chunks. (Registering the
    heads as FSDP forward methods instead costs a gather and a reduce-scatter per chunk, and the chunk
    count differs between ranks holding different rows: the collectives stop lining up and NCCL hangs.)
    `mixed_precision` (GPU, fp32 weights under bf16 autocast) gathers the layers in bf16 and reduces their
    gradients in fp32 (`layer_precision`); the root is gathered as stored (the LM head casts its weight
    per chunk under autocast, as in one process). `reshard_after_forward` frees each layer's gathered
    weights after its forward and gathers them again for its backward (False keeps them from forward to
    backward: one gather fewer per layer and micro-batch, a whole unsharded model more memory).
    `offload` keeps the shards, their gradients and so the optimizer's state in pinned host memory (FSDP2's
    `CPUOffloadPolicy`): each layer's weights are copied to the mesh's device for its forward and backward,
    and the optimizer steps on the CPU. Build the model on the CPU first: it never needs the GPU whole.

    LoRA: the adapters are parameters of their layer like any other, so they are sharded with it (each rank
    holds 1/N of every lora_A / lora_B, gathered for the layer's forward and backward, their gradients
    reduce-scattered), and so is the frozen base (gathered the same way, never reduced: it has no gradient).
    Sharded, not replicated: the adapters' optimizer state splits over the ranks too, and one mechanism serves
    both kinds of parameter (mixed dtypes, bf16 base and fp32 adapters, gather together).
    """
    kwargs = {"mesh": mesh} if mesh is not None else {}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh is not None and mesh.device_type == "cuda")
    precision = layer_precision(mixed_precision=mixed_precision)
    for layer in model.blocks():
        fully_shard(layer, reshard_after_forward=reshard_after_forward,
                    **kwargs, **({"mp_policy": precision} if precision is not None else {}))
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def full_weights(model: nn.Module, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(checkpoint name, full tensor) of every weight, gathering FSDP2 shards one parameter at a time (every rank
    of the trainer group must iterate together). The tied lm_head is left out, as in `named_weights`. An HF-path
    model's weights are renamed (and split) into its checkpoint's format one tensor at a time
    (`HFCausalLM.checkpoint_tensors`: transformers fuses MoE experts in memory)."""
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    to_checkpoint = getattr(model, "checkpoint_tensors", None)
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        full = full.detach() if dtype is None else full.detach().to(dtype)
        yield from (to_checkpoint(name, full) if to_checkpoint is not None else [(name, full)])
