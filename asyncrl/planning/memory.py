"""Bytes one role of a run holds on its GPU at its peak, from the model's shape and the run's knobs: the trainer's
weights, gradients and optimizer state and its activations at the micro-batch token budget, the engine's weights,
KV cache, logits and overhead. `asyncrl.planning.predict.memory_gib` (the planner) and the checks before launch
(`asyncrl.launch.memory_checks`) both count with these.

    states = trainer_state_bytes(shape, param_dtype="float32", lora_rank=0, offload="none")
    acts = trainer_activation_bytes(shape, budget=16_384, checkpointing="mlp", logits_chunk=4096, fp32_weights=True)
    engine = engine_bytes(shape, slots=256, tokens=1_536, lora=False)      # .kv_cache, .total

Units: bytes (GiB = 2**30 bytes where a name says so). The activation constants are fitted to the learner peaks of
docs/benchmarks/ (max_memory_allocated; each constant's docstring names its rows) and are within ~3 GiB of them;
an engine's prediction is within 0.5 GiB of the measured 8B LoRA agent (38.3 GiB at 64 slots).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from asyncrl.planning.predict import ModelShape

__all__ = ["GIB", "ENGINE_OVERHEAD_GIB", "CUDA_CONTEXT_GIB", "ALLOCATOR_SLACK", "ACTIVATION_BYTES_BY_SCOPE",
           "LOGITS_BYTES", "CAST_BYTES", "EngineBytes", "trainer_state_bytes", "trainer_activation_bytes",
           "engine_bytes", "adapted_params"]

GIB = 2**30
Checkpointing = Literal["none", "mlp", "layer"]

ENGINE_OVERHEAD_GIB = 1.25
"""An engine's CUDA graphs, buffers and allocator slack: the 2 x H200 rows peaked at 6.8 GiB where weights, KV
cache and logits make 5.6."""
CUDA_CONTEXT_GIB = 0.5
"""What a process's CUDA context takes on each GPU it uses, outside PyTorch's allocator (kernels, cuBLAS
workspaces): 0.3-0.6 GiB on H100s with CUDA 12."""
ALLOCATOR_SLACK = 0.13
"""A trainer process's memory held by PyTorch's caching allocator beyond what it has allocated at its peak
(reserved / allocated − 1), lost to any other process on its GPU: 35.9 / 31.7 GiB in the qwen3-8b-lora fully async
recipe on one H100 (2026-11-27), whose agent then failed to allocate (cuBLAS, at 80 slots). Within one process
(colocated) the engine reuses it."""
ACTIVATION_BYTES_BY_SCOPE = {"none": 41.0, "mlp": 17.5, "layer": 4.0}
"""Learner activations per micro-batch token, decoder layer and hidden unit, by what gradient checkpointing
recomputes (none: nothing; mlp: each layer's MLP; layer: whole layers, which keep only each layer's bf16 input and
recompute one layer at a time: `LAYER_RECOMPUTE_BYTES` on top). Fitted to learner-h100-2026-11-26.md (Qwen3-1.7B
ragged: none 51.7 GiB at 8,192 tokens and 68.9 at 16,384; mlp 41.0 at 8,192; Qwen2.5-0.5B mlp 15.7),
offload-h100-2026-11-26.md (8B bf16 mlp: 25.3 GiB of activations) and lora-h100-2026-11-26.md (8B LoRA: mlp 39.5
GiB at 8,192; layer 31.7 in the fully async trainer at 16,384)."""
LAYER_RECOMPUTE_BYTES = (16, 8)
"""Whole-layer recompute: the one layer rebuilt in the backward holds (16 x hidden + 8 x intermediate) bytes a
token."""
LOGITS_BYTES = 8
"""Per entry of the learner's [logits_chunk_tokens, vocab] LM-head chunk: bf16 logits, their fp32 log-softmax and
its gradient, alive at once."""
CAST_BYTES = 2
"""Per parameter, under bf16 autocast with fp32 weights, where layers are not recomputed whole (none, mlp): the
bf16 copies of the weights the backward keeps (the 1.7B and 0.5B fp32 rows sit 2 bytes a parameter above the
bf16 and LoRA rows at the same scope)."""


def adapted_params(shape: "ModelShape") -> int:
    """Parameters of the layers LoRA adapts, whose base the engine keeps a copy of to merge from (asyncrl's own
    models: the seven projections of every layer; a model read through transformers: every parameter, an upper
    bound)."""
    if shape.adapter_width is not None:
        return shape.params
    h = shape.hidden
    per_layer = 2 * h * shape.attention_width + 2 * h * shape.kv_width + 3 * h * shape.intermediate
    return shape.layers * per_layer


def trainer_state_bytes(shape: "ModelShape", *, param_dtype: str = "float32", lora_rank: int = 0,
                        offload: str = "none") -> float:
    """Weights, gradients and AdamW moments of the whole model (divide by the trainer ranks for one rank's
    shard): 16 bytes a parameter in fp32, 8 in bf16; LoRA: a bf16 base and 16 bytes an adapter parameter;
    `--trainer.offload optimizer`: the weights and gradients alone (8 or 4 bytes); `params`: none on the GPU."""
    if lora_rank:
        return 2 * shape.params + 16 * shape.lora_params(lora_rank)
    per_param = {"none": 16, "optimizer": 8, "params": 0}[offload] // (1 if param_dtype == "float32" else 2)
    return float(per_param * shape.params)


def trainer_activation_bytes(shape: "ModelShape", *, budget: int, checkpointing: Checkpointing = "none",
                             logits_chunk: int = 4096, fp32_weights: bool = True) -> float:
    """A trainer rank's memory above its states while a micro-batch of `budget` tokens runs forward and
    backward (activations do not shard over ranks): ACTIVATION_BYTES_BY_SCOPE a token, layer and hidden unit,
    the LM-head chunk (LOGITS_BYTES an entry), the recomputed layer of whole-layer checkpointing, and with fp32
    weights outside whole-layer recompute the kept bf16 casts (CAST_BYTES a parameter)."""
    per_token = ACTIVATION_BYTES_BY_SCOPE[checkpointing] * shape.layers * shape.hidden
    if checkpointing == "layer":
        per_token += LAYER_RECOMPUTE_BYTES[0] * shape.hidden + LAYER_RECOMPUTE_BYTES[1] * shape.intermediate
    casts = CAST_BYTES * shape.params if fp32_weights and checkpointing != "layer" else 0
    return budget * per_token + LOGITS_BYTES * min(logits_chunk, budget) * shape.vocab + casts


@dataclasses.dataclass(frozen=True)
class EngineBytes:
    """An embedded engine's peak, by part (bytes)."""

    weights: float  # bf16; with LoRA also the base copy of the adapted layers it merges from
    kv_cache: float
    logits: float
    overhead: float  # CUDA graphs, buffers, allocator slack

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.logits + self.overhead


def engine_bytes(shape: "ModelShape", *, slots: int, tokens: int, lora: bool = False,
                 full_base_copy: bool = False) -> EngineBytes:
    """An engine of `slots` sequences of `tokens` each: bf16 weights (with LoRA, plus a bf16 copy of the adapted
    layers' base, `adapted_params`, or of every weight with `full_base_copy`), the KV cache, fp32 logits and
    ENGINE_OVERHEAD_GIB."""
    base = (shape.params if full_base_copy else adapted_params(shape)) if lora else 0
    return EngineBytes(weights=2.0 * (shape.params + base), kv_cache=float(slots * shape.kv_bytes(tokens)),
                       logits=4.0 * shape.vocab * slots, overhead=ENGINE_OVERHEAD_GIB * GIB)
