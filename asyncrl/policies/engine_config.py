"""The embedded engine's capacity and speed knobs (`EngineConfig`); `asyncrl.policies.engine` re-exports it."""

from __future__ import annotations

import dataclasses
from typing import Literal

from asyncrl.config.run_config import LORA_TARGETS
from asyncrl.config.speculation import SpeculationConfig
from asyncrl.policies.decode_attention import DecodeKernel
from asyncrl.policies.kv_cache import KVDtype

KVLayout = Literal["slot", "shared-prompt"]

__all__ = ["EngineConfig", "KVLayout"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Capacity and speed knobs of the engine."""

    max_slots: int = 64
    """Sequences decoded together (each sample of a prompt takes one slot)."""
    max_len: int = 2048
    """Prompt + response tokens per sequence: the KV slot size."""
    max_prefill_tokens: int = 16384
    """Padded prompt tokens prefilled in one forward."""
    attend_bucket: int = 128
    """Decode attends over attend_bucket × 2^k positions, the smallest such length covering the longest
    running sequence (capped at max_len)."""
    cuda_graphs: bool = True
    """Capture the decode step (forward, logits, sampler) in CUDA graphs (ignored off CUDA)."""
    decode_ahead: bool = True
    """Launch each decode step before reading the previous one's tokens, so the host's per-token work overlaps
    the GPU (batches with top-k/top-p rows always run one step at a time)."""
    decode_attention: DecodeKernel = "auto"
    """Decode attention over the cache: "triton" (CUDA), "sdpa", or "auto" (Triton where it runs and agrees with SDPA)."""
    kv_dtype: KVDtype = "auto"
    """The K/V cache's storage: the model's dtype ("auto"), or float8 e4m3 ("fp8": half a bf16 cache's bytes, so
    twice the slots in the same memory, for a train–rollout mismatch; `asyncrl.policies.kv_cache`)."""
    kv_layout: KVLayout = "slot"
    """Where K/V live: "slot" (each sequence whole in its slot: a prompt's K/V copied to its n samples' slots) or
    "shared-prompt" (a prompt stored once for its samples, which hold only their responses and read it once a step:
    `asyncrl.policies.shared_prompt_cache`; no speculation)."""
    max_prompt_len: int | None = None
    """With kv_layout="shared-prompt": a prompt slot's positions; a longer prompt's other tokens go to each sample's
    slot, which holds max_len − max_prompt_len positions."""
    max_prompts: int | None = None
    """With kv_layout="shared-prompt": prompts (requests) running at once (default: max_slots)."""
    share_prefix: int = 0
    """With kv_layout="shared-prompt": a request whose prompt begins with at least this many tokens of a running
    request's prompt reads those from that request's prompt slot (a common system prompt); 0: off."""
    fused_kernels: bool = True
    """torch.compile the elementwise pieces of the model (CUDA only; process-wide)."""
    seed: int = 0
    """Seeds the random numbers of requests that bring no seed."""
    lora_rank: int = 0
    """Rank of the policy's LoRA adapters, which weight updates carry (0: updates carry full weights)."""
    lora_alpha: float = 0.0
    """LoRA scale numerator: an update's adapters are merged as W + (lora_alpha / lora_rank)·B·A."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Leaf names of the layers that carry adapters (an HF-path model's: `asyncrl.policies.lora.lora_targets`)."""
    speculation: SpeculationConfig = dataclasses.field(default_factory=SpeculationConfig)
    """Lossless speculative decoding with model-free drafts, while few rows run (`--rollout.speculation.*`; off by
    default: `asyncrl.policies.speculation`)."""

    def validate(self) -> None:
        for name in ("max_slots", "max_len", "max_prefill_tokens", "attend_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_attention not in ("auto", "sdpa", "triton"):
            raise ValueError(f"EngineConfig.decode_attention={self.decode_attention!r}: choose auto, sdpa or triton")
        if self.kv_dtype not in ("auto", "fp8"):
            raise ValueError(f"EngineConfig.kv_dtype={self.kv_dtype!r}: choose auto or fp8")
        self.speculation.validate()
        if self.kv_layout not in ("slot", "shared-prompt"):
            raise ValueError(f"EngineConfig.kv_layout={self.kv_layout!r}: choose slot or shared-prompt")
        if self.kv_layout == "shared-prompt":
            if self.max_prompt_len is None or not 0 < self.max_prompt_len < self.max_len:
                raise ValueError(f"EngineConfig.max_prompt_len={self.max_prompt_len}: kv_layout shared-prompt needs "
                                 f"the longest prompt, in [1, max_len={self.max_len})")
            if self.share_prefix < 0:
                raise ValueError(f"EngineConfig.share_prefix={self.share_prefix} must be >= 0 (0: off)")
            if self.max_prompts is not None and self.max_prompts < 1:
                raise ValueError(f"EngineConfig.max_prompts={self.max_prompts} must be >= 1")
            if self.speculation.enabled:
                raise ValueError("EngineConfig: speculation checks drafts over per-slot sequences; with kv_layout "
                                 "shared-prompt keep speculation.tokens 0")
