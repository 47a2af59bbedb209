"""Routers in float32 (asyncrl/policies/router_precision.py) on tiny random bf16 Qwen3-MoE and gpt-oss models: the
router's logits are the float32 product of its input and weight (a bf16 GEMM's are not), under bf16 autocast too;
the router's weight still gets a gradient in its own dtype; the state dict's names, the replay rule probe, a deep
copy and a compiled decoder layer (no graph break) are unchanged; a second wrap and a dense model change nothing;
`build_learner` wraps the routers under --trainer.router-dtype float32 (the default) and leaves them under model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.config import GRPO, TrainerConfig
from asyncrl.learner import build_learner
from asyncrl.policies import load_model
from asyncrl.policies.router_precision import float32_routers, is_float32_router
from asyncrl.policies.routing_replay import RoutingReplay, find_routers
from tests.hf_zoo import tiny_config

BF16 = torch.bfloat16


def _model(model_type: str, dtype=BF16) -> nn.Module:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).to(dtype)
    with torch.no_grad():
        for _, router in find_routers(model):
            router.weight.normal_(0, 0.5)
    return model


def _first_router_io(model: nn.Module, tokens: torch.Tensor) -> tuple[nn.Module, torch.Tensor, tuple]:
    """The first router, its input and its output in a forward of `tokens`."""
    seen = {}
    _, router = find_routers(model)[0]

    def keep(module, args, out):  # returns None: the output stays the router's
        seen.setdefault("io", (args[0], out))
    handle = router.register_forward_hook(keep)
    try:
        model(tokens)
    finally:
        handle.remove()
    return router, *seen["io"]


def _float32_logits(router: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    bias = getattr(router, "bias", None)
    return F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), router.weight.float(),
                    None if bias is None else bias.float())


TOKENS = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_a_wrapped_router_computes_float32_logits_from_bf16_weights(model_type):
    model = _model(model_type)
    router, hidden, (logits, weights, _) = _first_router_io(model, TOKENS)
    assert logits.dtype == BF16 and not torch.equal(logits.float(), _float32_logits(router, hidden))
    names = list(model.state_dict())
    assert float32_routers(model) == 2 and float32_routers(model) == 2
    assert all(is_float32_router(r) for _, r in find_routers(model))
    assert list(model.state_dict()) == names
    router, hidden, (logits, weights, _) = _first_router_io(model, TOKENS)
    assert logits.dtype == torch.float32 and weights.dtype == torch.float32
    assert torch.equal(logits, _float32_logits(router, hidden))
    out = model(TOKENS).logits
    assert out.dtype == BF16
    out.float().square().mean().backward()
    assert router.weight.grad.dtype == BF16 and router.weight.grad.abs().sum() > 0
    replay = RoutingReplay(model)
    replay.check_rules()
    assert len(replay.rules) == 2
    assert torch.equal(copy.deepcopy(model)(TOKENS).logits, model(TOKENS).logits)


def test_under_bf16_autocast_a_wrapped_router_stays_float32():
    model = _model("qwen3_moe", torch.float32)
    with torch.autocast("cpu", BF16):
        _, _, (logits, _, _) = _first_router_io(model, TOKENS)
    assert logits.dtype == BF16
    float32_routers(model)
    with torch.autocast("cpu", BF16):
        router, hidden, (logits, _, _) = _first_router_io(model, TOKENS)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, _float32_logits(router, hidden))


def test_a_wrapped_router_compiles_in_its_layer_without_a_graph_break():
    model = _model("qwen3_moe", torch.float32)
    float32_routers(model)
    layer = model.model.layers[0]
    hidden = model.model.embed_tokens(TOKENS)
    positions = model.model.rotary_emb(hidden, torch.arange(16)[None].expand(2, -1))
    explained = torch._dynamo.explain(layer)(hidden, position_embeddings=positions, attention_mask=None)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()


def test_a_deep_copy_of_a_wrapped_model_routes_with_its_own_routers():
    model = _model("qwen3_moe", torch.float32)
    float32_routers(model)
    twin = copy.deepcopy(model)
    assert all(is_float32_router(r) for _, r in find_routers(twin))
    _, _, (before, _, _) = _first_router_io(model, TOKENS)
    with torch.no_grad():
        for _, router in find_routers(twin):
            router.weight.mul_(-1.0)
    _, _, (again, _, _) = _first_router_io(model, TOKENS)
    _, _, (twins, _, _) = _first_router_io(twin, TOKENS)
    assert torch.equal(again, before) and torch.equal(twins, -before)


def test_a_dense_model_has_no_router_to_wrap():
    from transformers import AutoModelForCausalLM
    assert float32_routers(AutoModelForCausalLM.from_config(tiny_config("olmo2"))) == 0


@pytest.mark.parametrize("router_dtype", ["float32", "model"])
def test_build_learner_wraps_the_routers_unless_told_model(router_dtype, hf_zoo):
    policy = load_model(str(hf_zoo("qwen3_moe")))
    build_learner(policy, TrainerConfig(router_dtype=router_dtype), GRPO())
    routers = find_routers(policy)
    assert routers and all(is_float32_router(r) for _, r in routers) == (router_dtype == "float32")
