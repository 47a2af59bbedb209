"""asyncrl.policies.lora: a LoRA model is its base plus s·B·A, exactly as merged; adapters start at zero; only
adapters train; the base is what `adapters_off` runs; an engine's merger recomputes from its base copy, so a
thousand publications leave no drift."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.policies.loading import random_model
from asyncrl.policies.lora import (
    LORA_TARGETS, AdapterMerger, LoRALinear, adapter_tensors, adapters_off, apply_lora, is_adapter_name,
    lora_modules, merged_weights,
)
from tests.tolerances import forward_tol

IDS = torch.tensor([[5, 9, 13, 2, 7, 11], [3, 3, 8, 1, 0, 4]])
POSITIONS = torch.arange(6)[None].expand(2, 6)


def _logits(model) -> torch.Tensor:
    return model.logits(model(IDS, POSITIONS)).double()


def _lora_model(rank=4, alpha=8.0, targets=LORA_TARGETS, seed=0):
    base = random_model("tiny-qwen2", seed=seed)
    model = apply_lora(copy.deepcopy(base), rank=rank, alpha=alpha, targets=targets)
    generator = torch.Generator().manual_seed(1)
    for _, module in lora_modules(model):  # trained-looking adapters (B starts at zero)
        module.lora_B.weight.data.normal_(0, 0.05, generator=generator)
    return base, model


def test_a_fresh_adapter_leaves_the_function_unchanged_and_only_adapters_train():
    base = random_model("tiny-qwen2", seed=0)
    model = apply_lora(copy.deepcopy(base), rank=4, alpha=8)
    assert torch.equal(_logits(model), _logits(base))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n in trainable)
    assert len(trainable) == 2 * len(LORA_TARGETS) * len(model.model.layers)
    _logits(model).sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter_name(n))
    # with B = 0 only B's gradient is non-zero (dL/dA = s·Bᵀ(...) = 0): the usual LoRA start
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if n.endswith("lora_B.weight"))


def test_the_lora_forward_equals_the_merged_model_and_adapters_off_equals_the_base():
    base, model = _lora_model()
    merged = copy.deepcopy(base)
    merged.load_state_dict(dict(merged_weights(model)), strict=False)
    lora = model.logits(model(IDS, POSITIONS))
    atol = forward_tol(lora, model.config, dtype=torch.float32)
    assert (_logits(merged) - lora.double()).abs().max() < atol
    assert not torch.allclose(_logits(base), _logits(model), atol=1e-3)  # the adapters do something
    with adapters_off(model):
        assert torch.equal(_logits(model), _logits(base))
    assert all(m.enabled for _, m in lora_modules(model))


def test_names_of_the_base_weights_do_not_change():
    base, model = _lora_model(targets=("q_proj", "down_proj"))
    names = {n for n, _ in model.named_parameters() if not is_adapter_name(n)}
    assert names == {n for n, _ in base.named_parameters()}
    assert {n for n, _ in adapter_tensors(model)} == {
        f"model.layers.{i}.{block}.{proj}.lora_{f}.weight" for i in range(len(model.model.layers))
        for block, proj in (("self_attn", "q_proj"), ("mlp", "down_proj")) for f in "AB"}
    assert isinstance(model.model.layers[0].self_attn.q_proj, LoRALinear)
    assert not isinstance(model.model.layers[0].self_attn.k_proj, LoRALinear)


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0, "alpha": 1}, "need rank >= 1"), ({"rank": 2, "alpha": 0}, "alpha > 0"),
    ({"rank": 2, "alpha": 1, "dropout": 1.0}, "dropout in"), ({"rank": 2, "alpha": 1, "targets": ("qkv",)}, "'qkv'"),
])
def test_bad_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_lora(random_model("tiny-qwen2", seed=0), **kwargs)


def test_a_merger_waits_for_both_factors_and_checks_names_and_shapes():
    _, model = _lora_model()
    weights = dict(model.named_parameters())
    merger = AdapterMerger({n: weights[n] for n in ("model.layers.0.self_attn.q_proj.weight",)}, scale=2.0)
    a_name, b_name = "model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight"
    assert merger.merge([(a_name, weights[a_name])]) == [] and merger.pending == ["model.layers.0.self_attn.q_proj"]
    [(name, merged)] = merger.merge([(b_name, weights[b_name])])
    expected = weights["model.layers.0.self_attn.q_proj.weight"] + 2.0 * weights[b_name] @ weights[a_name]
    assert name == "model.layers.0.self_attn.q_proj.weight" and torch.allclose(merged, expected, atol=1e-6)
    assert merger.pending == []
    with pytest.raises(ValueError, match="not the lora_A/lora_B weight of an adapted layer"):
        merger.merge([("model.layers.0.self_attn.k_proj.lora_A.weight", weights[a_name])])
    with pytest.raises(ValueError, match="does not give the layer's shape"):
        merger.merge([(a_name, weights[a_name]), (b_name, weights[b_name][:, :2])])


def test_a_thousand_merges_leave_no_drift():
    """Each update is recomputed from the base copy: after 1,000 random adapters, zero adapters give the base
    back bit for bit (an update of the previous merge would have accumulated rounding)."""
    layer = "model.layers.0.mlp.down_proj"
    base = random_model("tiny-qwen2", seed=0, dtype=torch.bfloat16).get_parameter(f"{layer}.weight")
    merger = AdapterMerger({f"{layer}.weight": base}, scale=4.0)
    generator = torch.Generator().manual_seed(0)
    out, rank = base.shape[0], 8
    for _ in range(1000):
        a = torch.randn(rank, base.shape[1], generator=generator)
        b = torch.randn(out, rank, generator=generator) * 0.01
        merger.merge([(f"{layer}.lora_A.weight", a), (f"{layer}.lora_B.weight", b)])
    [(_, back)] = merger.merge([(f"{layer}.lora_A.weight", torch.zeros(rank, base.shape[1])),
                                (f"{layer}.lora_B.weight", torch.zeros(out, rank))])
    assert back.dtype == torch.bfloat16 and torch.equal(back, base.detach())
