"""LoRA on HF-path models (asyncrl.policies.lora): the layers an adapter may target come from the model itself
(every decoder linear layer, less routers, the LM head and vision towers); "all-linear" takes them all, explicit
names are checked against them; a fresh adapter leaves the function unchanged and only B gets a gradient. asyncrl's
own models keep their seven names (tests/policies/test_lora.py)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import LoraConfig
from asyncrl.policies.loading import load_model, random_model
from asyncrl.policies.lora import (ALL_LINEAR, LORA_TARGETS, LoRALinear, apply_lora, is_adapter_name, lora_candidates,
                                   lora_layers, lora_modules, lora_targets)
from asyncrl.policies.meta_model import meta_transformers
from tests.hf_zoo import ZOO

IDS = torch.tensor([[5, 9, 13, 2, 7, 11], [3, 3, 8, 1, 0, 4]])
POSITIONS = torch.arange(6)[None].expand(2, 6)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
CANDIDATES = {
    "gemma3_text": LORA_TARGETS, "olmo2": LORA_TARGETS, "granite": LORA_TARGETS, "gemma2": LORA_TARGETS,
    "phi3": ("o_proj", "qkv_proj", "gate_up_proj", "down_proj"),  # fused projections are ordinary layers
    "glm4": (*ATTENTION, "gate_up_proj", "down_proj"),
    # layer 0 is linear attention, layer 1 softmax attention; both have the dense MLP
    "qwen3_5_text": ("out_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "gate_proj", "up_proj",
                     "down_proj", *ATTENTION),
    # the experts are 3-D parameters (no nn.Linear) and the router is left out: attention only
    "qwen3_moe": ATTENTION, "gpt_oss": ATTENTION,
    # linear attention, then the shared expert's dense MLP (its routed experts are 3-D), then softmax attention
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj", "gate_proj", "up_proj", "down_proj", *ATTENTION),
}


def _logits(model) -> torch.Tensor:
    return model.logits(model(IDS, POSITIONS)).double()


@pytest.mark.parametrize("model_type", ZOO)
def test_candidates_of_every_zoo_type(hf_zoo, model_type):
    model = load_model(str(hf_zoo(model_type)))
    assert lora_candidates(model) == CANDIDATES[model_type]
    layers = lora_layers(model, lora_candidates(model))
    assert all(name.startswith("model.layers.") for name in layers)
    assert not any(name.rpartition(".")[2] in ("gate", "router", "lm_head") for name in layers)


@pytest.mark.parametrize("model_type", ZOO)
def test_a_fresh_adapter_leaves_the_function_unchanged_and_only_b_gets_a_gradient(hf_zoo, model_type):
    base, model = (load_model(str(hf_zoo(model_type))) for _ in range(2))
    apply_lora(model, rank=2, alpha=4.0)
    adapted = [name for name, _ in lora_modules(model)]
    assert adapted == lora_layers(base, CANDIDATES[model_type])
    assert torch.equal(_logits(model), _logits(base))  # B = 0
    _logits(model).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(grads[n] is None for n in grads if not is_adapter_name(n))  # the base is frozen (experts too)
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if n.endswith("lora_B.weight"))
    # dL/dA = s·Bᵀ(...) = 0 while B = 0: the usual LoRA start
    assert all(g is None or not g.any() for n, g in grads.items() if n.endswith("lora_A.weight"))


def test_explicit_targets_adapt_those_layers_only(hf_zoo):
    model = apply_lora(load_model(str(hf_zoo("phi3"))), rank=2, alpha=4.0, targets=("qkv_proj",))
    assert [name for name, _ in lora_modules(model)] == [f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]
    assert not isinstance(model.model.layers[0].mlp.gate_up_proj, LoRALinear)


@pytest.mark.parametrize("targets, unknown", [(("q_proj", "o_proj"), "['q_proj'] is not"),
                                              (("q_proj", "v_proj"), "['q_proj', 'v_proj'] are not")])
def test_a_target_the_model_does_not_have_is_refused_naming_the_flag_and_the_valid_names(hf_zoo, targets, unknown):
    model = load_model(str(hf_zoo("phi3")))
    with pytest.raises(ValueError, match="--lora.target-modules") as err:
        apply_lora(model, rank=2, alpha=4.0, targets=targets)
    assert unknown in str(err.value) and "o_proj, qkv_proj, gate_up_proj, down_proj, or all-linear" in str(err.value)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())  # refused before anything changed


def test_routers_beside_experts_and_vision_towers_are_left_out():
    """qwen2_moe's shared-expert gate and Llama 4's router are nn.Linear layers beside the experts (the zoo's MoE
    routers are router modules of their own); a multimodal Gemma 3's vision tower has q/k/v/o too."""
    tiny = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
    moe = meta_transformers({"model_type": "qwen2_moe", **tiny})
    assert lora_candidates(moe) == LORA_TARGETS  # the shared expert's gate/up/down_proj, not shared_expert_gate
    assert "model.layers.0.mlp.shared_expert_gate" not in lora_layers(moe, LORA_TARGETS)
    assert lora_candidates(meta_transformers({"model_type": "llama4_text", **tiny})) == LORA_TARGETS
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    vlm = meta_transformers({"model_type": "gemma3", "text_config": {**tiny, "model_type": "gemma3_text"},
                             "vision_config": vision})
    assert any(".vision_tower." in name and name.endswith("q_proj") for name, _ in vlm.named_modules())
    layers = lora_layers(vlm, lora_candidates(vlm))
    assert len(layers) == 7 and all(n.startswith("model.language_model.layers.0.") for n in layers)


def test_own_models_keep_their_seven_names():
    model = random_model("tiny-qwen2", seed=0)
    assert lora_candidates(model) == LORA_TARGETS == lora_targets(model, (ALL_LINEAR,))
    with pytest.raises(ValueError, match=r"\['gate_up_proj'\] is not a linear layer .*among q_proj, k_proj"):
        lora_targets(model, ("gate_up_proj",))


@pytest.mark.parametrize("targets", [(), ("q_proj", "q_proj"), (ALL_LINEAR, "q_proj")])
def test_the_config_refuses_empty_repeated_or_mixed_targets(targets):
    with pytest.raises(ValueError, match="--lora.target-modules"):
        LoraConfig(rank=4, target_modules=targets).validate()
    LoraConfig(rank=4, target_modules=("qkv_proj",)).validate()  # names are checked against the model, later
