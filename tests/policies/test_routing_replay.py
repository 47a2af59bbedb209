"""Routing replay on `transformers` MoE models (asyncrl/policies/routing_replay.py), on tiny random Qwen3-MoE, gpt-oss
and DeepSeek-V3-style models in fp32: each router's rule found by the probe; a model's own routes replayed give its
logits bit for bit; with the routers perturbed so choices flip, replay keeps the recorded experts, counts the flips
and the routers still get gradients, through a gradient-checkpointed recompute too; a router no rule reproduces and
routes out of step with the tokens are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncrl.policies.routing_replay import RoutingReplay, find_routers, route_disagreement, router_rule
from tests.hf_zoo import tiny_config

DEEPSEEK_V3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, q_lora_rank=None,
                   kv_lora_rank=16, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1,
                   norm_topk_prob=True, routed_scaling_factor=2.5, rope_scaling=None)
"""Grouped top-k over 2 groups of 4 experts, a sigmoid router with a score-correction bias, renormalised and
scaled: DeepSeek-V3's routing at a tiny size."""
RULE = {"qwen3_moe": "softmax", "gpt_oss": "topk_softmax", "deepseek_v3": "sigmoid_renorm"}


def _model(model_type: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("deepseek_v3", **DEEPSEEK_V3) if model_type == "deepseek_v3" else \
        tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # routers start at zeros in some families: give them real preferences
        for _, router in find_routers(model):
            router.weight.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module", params=list(RULE))
def moe(request):
    return request.param, _model(request.param)


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_each_router_s_rule_is_found_by_the_probe(moe):
    model_type, model = moe
    replay = RoutingReplay(model)
    replay.check_rules()
    assert len(replay.routers) == 2 and set(replay.rules.values()) == {RULE[model_type]}


def test_replaying_a_model_s_own_routes_gives_its_logits_bit_for_bit(moe):
    _, model = moe
    replay, tokens = RoutingReplay(model), _tokens()
    with torch.no_grad(), replay.recording() as recorded:
        plain = model(tokens).logits
    routes = recorded.routes()
    assert routes.shape == (2 * 24, 2, model.config.num_experts_per_tok) and routes.dtype == torch.long
    with torch.no_grad(), replay.replaying(routes) as replayed:
        again = model(tokens).logits
    assert torch.equal(again, plain)
    assert replayed.disagreement() == 0.0


def test_perturbed_routers_keep_the_recorded_experts_and_still_get_gradients(moe):
    """The routers' weights moved enough that many tokens choose other experts: replayed, the forward uses the
    recorded ones (recorded again inside the replay: the same routes), the flips are counted, and each router's
    weight gets a non-zero gradient; without replay the logits differ from the replayed ones."""
    _, model = moe
    replay, tokens = RoutingReplay(model), _tokens()
    with torch.no_grad(), replay.recording() as recorded:
        model(tokens)
    routes = recorded.routes()
    perturbed = _model(moe[0])
    with torch.no_grad():
        for _, router in find_routers(perturbed):
            router.weight.add_(torch.randn_like(router.weight) * 2.0)
    replay_p = RoutingReplay(perturbed)
    with replay_p.replaying(routes) as replayed, replay_p.recording() as seen:
        logits = perturbed(tokens).logits
        logits.float().logsumexp(-1).sum().backward()
    assert torch.equal(seen.routes(), routes)  # the experts the forward used are the recorded ones
    assert replayed.disagreement() > 0.2, replayed.disagreement()
    for _, router in find_routers(perturbed):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with torch.no_grad():
        free = perturbed(tokens).logits
    assert not torch.allclose(free, logits.detach())


def test_the_recompute_of_a_checkpointed_forward_replays_the_same_routes():
    """Gradient checkpointing runs each layer's forward again in the backward: the replay serves the routes again
    (a queue consumed per call would run out or shift), and the gradient equals the non-checkpointed one."""
    grads = {}
    for checkpointed in (False, True):
        model = _model("qwen3_moe").train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        replay, tokens = RoutingReplay(model), _tokens()
        routes = torch.randint(0, 4, (2 * 24, 2, 1)).expand(-1, -1, 2).clone()
        routes[..., 1] = (routes[..., 0] + 1) % 4  # two distinct experts a token
        with replay.replaying(routes):
            model(tokens).logits.logsumexp(-1).sum().backward()
        grads[checkpointed] = torch.cat([r.weight.grad.flatten() for _, r in find_routers(model)])
    assert torch.allclose(grads[True], grads[False], rtol=1e-5, atol=1e-6)


def test_routes_out_of_step_with_the_tokens_and_unknown_routers_are_refused():
    model = _model("qwen3_moe")
    replay = RoutingReplay(model)
    with pytest.raises(ValueError, match="expected \\[tokens, 2 routers, top_k\\]"):
        with replay.replaying(torch.zeros(48, 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(RuntimeError, match="routes and tokens are out of step"):
        with torch.no_grad(), replay.replaying(torch.zeros(47, 2, 2, dtype=torch.long)):
            model(_tokens())

    class CubedRouter(nn.Module):  # weights its experts by a rule replay does not know
        def __init__(self):
            super().__init__()
            self.top_k, self.hidden_dim = 2, 8
            self.weight = nn.Parameter(torch.randn(4, 8))

        def forward(self, hidden):
            logits = hidden @ self.weight.T
            values, indices = logits.topk(2, dim=-1)
            return logits, values ** 3, indices

    holder = nn.Sequential(CubedRouter())
    assert router_rule(holder[0]) is None
    cubed = RoutingReplay(holder)  # found and hooked; refused where a replay needs its rule
    with pytest.raises(ValueError, match="router 0 \\(CubedRouter\\) weights its experts by no known rule"):
        with cubed.replaying(torch.zeros(3, 1, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        RoutingReplay(nn.Linear(2, 2))


def test_disagreement_ignores_the_order_within_the_top_k():
    own = torch.tensor([[0, 1], [2, 3], [1, 2]])
    replayed = torch.tensor([[1, 0], [2, 1], [1, 2]])
    assert route_disagreement(own, replayed).tolist() == [False, True, False]


def test_compiled_layers_trace_once_for_every_router():
    """Every router shares one hook whose work runs outside the compiled graph, so compiled decoder layers (Dynamo,
    eager backend) trace the same frames for 2 layers as for 4 under replay, recording and tapping, and replay as
    eager layers do. Per-router hooks made Dynamo recompile the layer once per router (a 16-layer OLMoE passed the
    recompile limit of 8 and fell back to eager on an H100)."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    frames = {}
    for layers in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", num_hidden_layers=layers)).float().train()
        replay, tokens = RoutingReplay(model), _tokens()
        with torch.no_grad(), replay.recording() as recorded:
            plain = model(tokens, use_cache=False).logits
        routes = recorded.routes()
        for layer in model.model.layers:
            layer.compile(backend="eager", dynamic=True)
        with replay.replaying(routes) as replayed, replay.tapping() as tapped, replay.recording() as seen:
            logits = model(tokens, use_cache=False).logits
            logits.logsumexp(-1).sum().backward()
        assert torch.equal(seen.routes(), routes) and len(tapped) == layers and replayed.disagreement() == 0.0
        assert torch.equal(logits.detach(), plain)
        assert all(r.weight.grad is not None for _, r in find_routers(model))
        frames[layers] = counters["frames"]["ok"]
    torch._dynamo.reset()
    assert frames[2] == frames[4] > 0, frames
