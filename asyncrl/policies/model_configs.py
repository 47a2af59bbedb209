"""Model configs by name: the architecture presets of random-weight models, and the Hugging Face config dict of a
preset, a config.json or a model directory (read without weights)."""

from __future__ import annotations

import json
import pathlib

__all__ = ["ARCH_PRESETS", "hf_config"]

ARCH_PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, attention_bias=False, bos_token_id=151643, eos_token_id=151645),
    "qwen3-4b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=True, attention_bias=False, bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, attention_bias=False, bos_token_id=151643, eos_token_id=151645),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "tiny-qwen2": dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "tiny-smollm2": dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}
"""Architecture shapes by name, for random-weight models (benchmarks, tests, demos)."""


def hf_config(config: str | dict) -> dict:
    """The Hugging Face config dict of a preset name, a config.json, or a model directory."""
    if isinstance(config, dict):
        return dict(config)
    if config in ARCH_PRESETS:
        return dict(ARCH_PRESETS[config])
    path = pathlib.Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model config {config!r}: not a preset ({', '.join(ARCH_PRESETS)}) and no config.json "
                         "there; pass a preset name, a config.json, or a model directory")
    return json.loads(path.read_text())
