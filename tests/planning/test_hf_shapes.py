"""The planner's shapes of models asyncrl does not implement (`ModelShape.from_transformers`, `asyncrl plan --model
DIR`): the parameter count exact from the transformers model on the meta device, K/V bytes per layer type (a
hybrid's linear-attention layers hold none, sliding-window layers their window at most), adapters over every layer
all-linear adapts. Golden values worked by hand from tests/hf_zoo.py's shapes."""

from __future__ import annotations

import pytest

from asyncrl.planning import WORKLOADS, Layout, ModelShape, Rates
from asyncrl.planning.command import model_shape
from asyncrl.planning.predict import GIB, memory_gib
from asyncrl.policies.loading import ARCH_PRESETS, load_model
from tests.hf_zoo import ZOO, tiny_config


def test_gemma3_counts_its_parameters_and_a_sliding_layer_holds_its_window():
    shape = ModelShape.from_hf(tiny_config("gemma3_text").to_dict())
    # embedding 512 x 64 = 32,768 (tied: no second head); per layer q 64x64 + k, v 64x32 each + o 64x64 = 12,288,
    # MLP 3 x 64 x 128 = 24,576, four norms 4 x 64 and q/k norms 2 x 32 = 320: 37,184, x 2 = 74,368; final norm 64
    assert shape.params == 32_768 + 74_368 + 64 == 107_200
    # layer 1 is full attention: 1 KV head x 32 x (K, V) x 2 bytes = 128 bytes a token; layer 0 slides over 8 tokens
    assert (shape.kv_layers, shape.window_layers, shape.window) == (1, 1, 8)
    assert shape.kv_bytes_per_token == 128
    assert shape.kv_bytes(100) == 100 * 128 + 8 * 128 and shape.kv_bytes(5) == 5 * 128 + 5 * 128


def test_moe_experts_count_and_get_no_adapter():
    shape = ModelShape.from_hf(tiny_config("qwen3_moe").to_dict())
    # embedding and untied head 2 x 512 x 64 = 65,536; per layer attention 12,288, q/k norms 64, two norms 128,
    # router 4 x 64 = 256, experts 4 x (64 x 2·32 + 32 x 64) = 24,576: 37,312, x 2 = 74,624; final norm 64
    assert shape.params == 65_536 + 74_624 + 64 == 140_224
    # adapters on q (64+64), k (64+32), v (64+32), o (64+64) only: 448 per layer, 2 layers
    assert shape.adapter_width == 896 and shape.lora_params(8) == 8 * 896


def test_a_hybrids_linear_attention_layer_holds_no_kv_and_fused_layers_adapt_whole():
    hybrid = ModelShape.from_hf(tiny_config("qwen3_5_text").to_dict())
    assert (hybrid.layers, hybrid.kv_layers, hybrid.window_layers) == (2, 1, 0)
    assert hybrid.kv_bytes_per_token == 128  # the one full-attention layer
    phi3 = ModelShape.from_hf(tiny_config("phi3").to_dict())
    # per layer o (64+64), qkv (64+128), gate_up (64+256), down (128+64) = 832, 2 layers
    assert phi3.adapter_width == 1664 and phi3.kv_bytes_per_token == 2 * 128


@pytest.mark.parametrize("model_type", ZOO)
def test_the_count_is_the_loaded_models(hf_zoo, model_type):
    model = load_model(str(hf_zoo(model_type)))
    loaded = sum(p.numel() for p in model.parameters())  # tied weights once
    assert model_shape(str(hf_zoo(model_type))).params == loaded


def test_own_types_keep_their_formula_and_memory_counts_the_window():
    own = ModelShape.from_hf(ARCH_PRESETS["qwen2.5-0.5b"])
    assert own.params == 494_032_768 and own.kv_layers is None and own.adapter_width is None
    shape = ModelShape(params=10**9, layers=10, hidden=1000, attention_width=1000, kv_width=200, intermediate=3000,
                       vocab=1000, kv_layers=2, window_layers=8, window=100)
    rates = Rates(learner_tok_s=1e4, learner_step_tokens=1000, learner_budget=1000, engine=((64, 1e3),),
                  learner_peak_gib=4.0)
    work = WORKLOADS["gsm8k"]  # 512 + 1024 = 1536 tokens a sequence
    _, agent = memory_gib(shape, work, rates, Layout("split", 1, 1), slots=10)
    # 2 growing layers x 200 x 4 bytes x 1536 tokens + 8 window layers x 200 x 4 x 100 tokens, + fp32 logits
    cache = 10 * (1536 * 1600 + 100 * 6400 + 4 * 1000)
    assert agent * GIB == pytest.approx(2 * 10**9 + cache + 1.25 * GIB)


def test_a_model_transformers_does_not_build_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "my_lm", "auto_map": {"AutoConfig": "m.C"}}')
    with pytest.raises(ValueError, match=rf"--model {tmp_path}: model_type 'my_lm': the installed transformers"):
        model_shape(str(tmp_path))
