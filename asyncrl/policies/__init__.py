"""Models and generation: a Llama-family causal LM and the embedded continuous-batching engine."""

from asyncrl.policies.engine import Engine, EngineConfig
from asyncrl.policies.kv_cache import KVCache
from asyncrl.policies.loading import (
    ARCH_PRESETS, load_gguf, load_model, load_pretrained, load_tokenizer, named_weights, random_model,
    save_pretrained, smollm2_gguf_path,
)
from asyncrl.policies.attention_layouts import DocumentLayout, packed_attention_mask
from asyncrl.policies.model import SUPPORTED_MODEL_TYPES, CausalLM, TransformerConfig, token_entropy, token_logprobs
from asyncrl.policies.protocol import RolloutEngine
from asyncrl.policies.sampling import SamplingParams, sample_tokens

__all__ = [
    "Engine", "EngineConfig", "RolloutEngine", "SamplingParams", "sample_tokens",
    "ARCH_PRESETS", "load_model", "load_pretrained", "load_gguf", "random_model", "save_pretrained",
    "named_weights", "load_tokenizer", "smollm2_gguf_path",
    "KVCache", "CausalLM", "TransformerConfig", "SUPPORTED_MODEL_TYPES", "token_logprobs", "token_entropy",
    "packed_attention_mask", "DocumentLayout",
]
