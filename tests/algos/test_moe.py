"""`load_balancing` (asyncrl/algos/moe.py): golden values, the counted-token mask, where the gradient goes, and its
ranges as properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algos import load_balancing


def test_golden_values_and_the_counted_mask():
    """Uniform probabilities, 3 of 4 tokens on expert 0: f = (0.75, 0.25), P = (0.5, 0.5), loss 2·0.5 = 1.0, load
    2·0.75 = 1.5; token 3 left out: f = (1, 0), loss 1.0, load 2.0."""
    logits = torch.zeros(4, 2, requires_grad=True)
    indices = torch.tensor([[0], [0], [0], [1]])
    out = load_balancing(logits, indices)
    assert out.loss.item() == pytest.approx(1.0) and out.load.item() == pytest.approx(1.5)
    assert out.shares.tolist() == pytest.approx([0.75, 0.25])
    masked = load_balancing(logits, indices, torch.tensor([True, True, True, False]))
    assert masked.loss.item() == pytest.approx(1.0) and masked.load.item() == pytest.approx(2.0)


def test_the_gradient_goes_through_the_mean_probabilities_towards_balance():
    """P = (0.75, 0.25) with every token on expert 0: loss 2·0.75 = 1.5; descending it lowers expert 0's logit."""
    logits = torch.tensor([[math.log(3.0), 0.0]], requires_grad=True)
    out = load_balancing(logits, torch.tensor([[0]]))
    assert out.loss.item() == pytest.approx(1.5)
    out.loss.backward()
    assert logits.grad[0, 0] > 0 > logits.grad[0, 1]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="expected \\[N, E\\] and \\[N, k\\]"):
        load_balancing(torch.zeros(3, 4), torch.zeros(2, 1, dtype=torch.long))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 20), st.integers(2, 8), st.integers(1, 3), st.integers(0, 10_000))
def test_shares_sum_to_one_and_the_load_lies_between_balanced_and_one_expert(tokens, experts, k, seed):
    k = min(k, experts)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    indices = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    out = load_balancing(logits, indices)
    assert out.shares.sum().item() == pytest.approx(1.0)
    assert 1.0 - 1e-6 <= out.load.item() <= experts + 1e-6
    assert 0.0 <= out.loss.item() <= experts + 1e-6
