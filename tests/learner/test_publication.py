"""What a weight publication sends: every weight of a plain policy (in the engine's dtype), only the adapters of
a LoRA policy (float32, as trained: megabytes, not gigabytes)."""

from __future__ import annotations

import torch

from asyncrl.learner import published_weights, publishes_adapters
from asyncrl.policies.loading import named_weights, random_model
from asyncrl.policies.lora import apply_lora, is_adapter_name


def test_a_plain_policy_publishes_every_weight_in_the_asked_dtype():
    model = random_model("tiny-qwen2", seed=0)
    sent = list(published_weights(model, dtype=torch.bfloat16))
    assert not publishes_adapters(model)
    assert [n for n, _ in sent] == [n for n, _ in named_weights(model)]
    assert {t.dtype for _, t in sent} == {torch.bfloat16}


def test_a_lora_policy_publishes_its_adapters_alone_in_float32():
    model = apply_lora(random_model("tiny-qwen2", seed=0), rank=4, alpha=8, targets=("q_proj", "v_proj"))
    sent = list(published_weights(model, dtype=torch.bfloat16))
    assert publishes_adapters(model) and sent and all(is_adapter_name(n) for n, _ in sent)
    assert {t.dtype for _, t in sent} == {torch.float32}
    layers = len(model.model.layers)
    assert len(sent) == layers * 2 * 2  # two targets, two factors each
    full = sum(t.numel() * t.element_size() for _, t in named_weights(model))
    adapters = sum(t.numel() * t.element_size() for _, t in sent)
    assert adapters == layers * 4 * ((64 + 64) + (64 + 32)) * 4 and adapters < full / 10  # r(in + out) fp32 each
