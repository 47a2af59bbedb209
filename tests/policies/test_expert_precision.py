"""Grouped expert GEMMs under autocast (asyncrl/policies/expert_precision.py) on tiny random Qwen3-MoE and gpt-oss
models with float32 weights: under bf16 autocast a wrapped model's logits equal those of the same model with its
expert tensors stored in bf16 (so the products ran in bf16, as `F.linear` does under autocast), the float32
expert weights get float32 gradients, and a compiled decoder layer is one graph of grouped GEMMs (unwrapped,
`transformers` takes its fallback loop); without autocast nothing changes; convolutions are not experts; `build_learner`
wraps the policy and the reference."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from asyncrl.config import GRPO, TrainerConfig
from asyncrl.learner import build_learner
from asyncrl.policies import load_model
from asyncrl.policies.expert_precision import autocast_experts, find_experts, is_autocast_experts
from tests.hf_zoo import tiny_config

BF16 = torch.bfloat16
TOKENS = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))


def _model(model_type: str) -> nn.Module:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type))


def _logits(model: nn.Module, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        return model(TOKENS).logits


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_under_autocast_the_experts_products_run_in_bf16_and_fp32_weights_get_fp32_gradients(model_type):
    model = _model(model_type)
    stored_bf16 = copy.deepcopy(model)
    for _, experts in find_experts(stored_bf16):
        for param in experts.parameters(recurse=False):
            if param.dim() == 3:
                param.data = param.data.to(BF16)
    plain = _logits(copy.deepcopy(model), autocast=True)
    assert autocast_experts(model) == model.config.num_hidden_layers
    wrapped = _logits(model, autocast=True)
    assert torch.equal(wrapped, _logits(stored_bf16, autocast=True))
    assert not torch.equal(wrapped, plain)  # unwrapped, the experts' products ran in float32
    wrapped.float().logsumexp(-1).sum().backward()
    for _, experts in find_experts(model):
        for param in experts.parameters(recurse=False):
            if param.dim() == 3:
                assert param.dtype == torch.float32 and param.grad.dtype == torch.float32
                assert param.grad.abs().sum() > 0


def test_without_autocast_a_wrapped_model_is_unchanged():
    model = _model("qwen3_moe")
    before = _logits(copy.deepcopy(model), autocast=False)
    autocast_experts(model)
    assert torch.equal(_logits(model, autocast=False), before)
    assert autocast_experts(model) == 2 and all(is_autocast_experts(e) for _, e in find_experts(model))


def test_compiled_a_wrapped_experts_layer_is_one_graph_of_grouped_gemms_not_the_fallback_loop():
    """What dynamo captures of a decoder layer under bf16 autocast: unwrapped, `transformers` calls its fallback
    loop (with float32 weights it cannot use grouped_mm when compiled; inductor then fails on its data-dependent
    slices on a GPU); wrapped, the graph holds grouped GEMMs and no fallback, in one graph."""
    model = _model("qwen3_moe")
    hidden = model.model.embed_tokens(TOKENS)
    positions = model.model.rotary_emb(hidden, torch.arange(16)[None].expand(2, -1))
    called, graphs = {}, {}
    for wrap in (False, True):
        layer = copy.deepcopy(model.model.layers[0])
        if wrap:
            autocast_experts(layer)
        targets, count = [], [0]

        def record(gm, example_inputs):
            count[0] += 1
            targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return gm.forward
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=BF16):
            torch.compile(layer, backend=record)(hidden, position_embeddings=positions, attention_mask=None)
        called[wrap], graphs[wrap] = " ".join(targets), count[0]
    torch._dynamo.reset()
    assert "grouped_mm_fallback" in called[False]
    assert "grouped_mm_fallback" not in called[True] and "grouped_mm" in called[True], called[True]
    assert graphs[True] == 1, graphs


def test_convolutions_are_not_experts_and_a_dense_model_has_none():
    names = [name for name, _ in find_experts(_model("qwen3_next"))]
    assert names and all(name.endswith("mlp.experts") for name in names)  # not linear_attn.conv1d
    assert autocast_experts(_model("olmo2")) == 0


def test_build_learner_wraps_the_experts_of_the_policy(hf_zoo):
    policy = load_model(str(hf_zoo("qwen3_moe")))
    build_learner(policy, TrainerConfig(), GRPO())
    experts = find_experts(policy)
    assert experts and all(is_autocast_experts(e) for _, e in experts)


def test_a_deep_copy_of_a_wrapped_model_computes_with_its_own_experts():
    model = _model("qwen3_moe")
    autocast_experts(model)
    twin = copy.deepcopy(model)
    assert all(is_autocast_experts(e) for _, e in find_experts(twin))
    before = _logits(model, autocast=True)
    with torch.no_grad():
        for _, experts in find_experts(twin):
            experts.down_proj.zero_()
    assert torch.equal(_logits(model, autocast=True), before)  # the original's experts are its own
    assert not torch.equal(_logits(twin, autocast=True), before)
