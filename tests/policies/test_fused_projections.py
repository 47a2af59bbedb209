"""`asyncrl.policies.fused_projections`: generation's q/k/v and gate/up products as one GEMM each, with the Hugging
Face-named parameters left as views (names, shapes, in-place updates by name)."""

from __future__ import annotations

import torch

from asyncrl.policies import Engine, SamplingParams
from asyncrl.policies.fused_projections import fuse_projections
from asyncrl.policies.kv_cache import KVCache
from tests.policies.helpers import make_prompts, small_config, tiny_model
from tests.tolerances import forward_tol


class _Counting:
    """Stands in for a layer's fused projection: counts the calls, answers as it would."""

    def __init__(self, fused):
        self.fused, self.calls = fused, 0

    def __call__(self, x):
        self.calls += 1
        return self.fused(x)


def _prefill(model, ids):
    cfg = model.config
    cache = KVCache(cfg.num_layers, ids.shape[0], cfg.num_kv_heads, 64, cfg.head_dim, model.dtype, model.device)
    return model.logits(model(ids, cache=cache, cache_slots=torch.arange(ids.shape[0])))


def test_names_shapes_and_values_stay_and_a_cached_forward_matches():
    model = tiny_model(seed=0).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor(make_prompts([9, 9], seed=2))
    with torch.no_grad():
        want = _prefill(model, ids)
        fuse_projections(model)
        fuse_projections(model)  # idempotent
        got = _prefill(model, ids)
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    assert all(torch.equal(after[n], before[n]) for n in before)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv.weight.untyped_storage().data_ptr()
    assert (got - want).abs().max() <= forward_tol(want, model.config)


def test_only_forwards_with_a_cache_use_the_fused_products():
    model = tiny_model(seed=0).eval()
    fuse_projections(model)
    counters = []
    for layer in model.model.layers:
        layer.self_attn.qkv = _Counting(layer.self_attn.qkv)
        layer.mlp.gate_up = _Counting(layer.mlp.gate_up)
        counters += [layer.self_attn.qkv, layer.mlp.gate_up]
    ids = torch.tensor(make_prompts([7], seed=3))
    with torch.no_grad():
        model(ids)  # the learner's forward: separate products
        assert [c.calls for c in counters] == [0] * len(counters)
        _prefill(model, ids)
    assert [c.calls for c in counters] == [1] * len(counters)


def test_weights_updated_by_name_reach_generation():
    """An engine given new q/k/v and gate/up weights through `update_weights` generates what an engine built on
    those weights does."""
    source = tiny_model(seed=1)
    update = [(n, p.detach().clone()) for n, p in source.named_parameters() if "proj" in n and "o_proj" not in n]
    engine = Engine(tiny_model(seed=0), small_config())
    engine.update_weights(update, version=1)
    built_on = tiny_model(seed=0)
    built_on.load_state_dict(dict(update), strict=False)
    prompts = make_prompts([5, 12], seed=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    got = [o.completions[0].token_ids for o in engine.generate(prompts, params)]
    assert got == [o.completions[0].token_ids for o in Engine(built_on, small_config()).generate(prompts, params)]
    fresh = [o.completions[0].token_ids for o in Engine(tiny_model(seed=0), small_config()).generate(prompts, params)]
    assert got != fresh, "the update changed nothing: the test cannot tell"
