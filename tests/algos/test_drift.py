"""The drift from the behaviour policy (asyncrl/algos/drift.py): golden values, on-policy zero drift, ESS in (0, 1]
(hypothesis), only valid tokens counted, and the means of two halves combining, weighted by their tokens, into the
whole batch's."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from asyncrl import algos


def test_golden_values():
    """Ratios 2 and 1: k1 = −ln 2 / 2, mean r 1.5, mean r² 2.5, ESS 2.25 / 2.5 = 0.9; the masked token is ignored."""
    logp_b = torch.tensor([[-1.0, -2.0, -3.0]])
    logp = logp_b + torch.tensor([[math.log(2.0), 0.0, 50.0]])
    mask = torch.tensor([[True, True, False]])
    d = algos.behaviour_drift(logp, logp_b, mask)
    assert float(d.k1) == pytest.approx(-math.log(2) / 2)
    assert float(d.ratio) == pytest.approx(1.5) and float(d.ratio_sq) == pytest.approx(2.5)
    assert algos.effective_sample_size(float(d.ratio), float(d.ratio_sq)) == pytest.approx(0.9)


def test_on_policy_has_no_drift_and_an_empty_mask_none():
    logp = torch.randn(3, 5)
    d = algos.behaviour_drift(logp, logp.clone(), torch.ones(3, 5, dtype=torch.bool))
    assert float(d.k1) == 0.0 and float(d.ratio) == 1.0 and float(d.ratio_sq) == 1.0
    empty = algos.behaviour_drift(logp, logp - 1, torch.zeros(3, 5, dtype=torch.bool))
    assert float(empty.k1) == 0.0 and algos.effective_sample_size(float(empty.ratio), float(empty.ratio_sq)) == 1.0
    with pytest.raises(ValueError, match="behaviour_drift"):
        algos.behaviour_drift(logp, logp[:2], torch.ones(3, 5, dtype=torch.bool))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.0, 5.0), split=st.integers(1, 5))
def test_ess_lies_in_0_1_and_halves_combine_into_the_whole(seed, scale, split):
    gen = torch.Generator().manual_seed(seed)
    logp_b = -torch.rand(6, 7, generator=gen) * 4
    logp = logp_b + torch.randn(6, 7, generator=gen) * scale
    mask = torch.rand(6, 7, generator=gen) > 0.3
    mask[0, 0] = True
    whole = algos.behaviour_drift(logp, logp_b, mask)
    ess = algos.effective_sample_size(float(whole.ratio), float(whole.ratio_sq))
    assert 0.0 < ess <= 1.0 + 1e-6
    parts = [(algos.behaviour_drift(logp[rows], logp_b[rows], mask[rows]), int(mask[rows].sum()))
             for rows in (slice(0, split), slice(split, 6))]
    tokens = sum(n for _, n in parts)
    for field in ("k1", "ratio", "ratio_sq"):
        combined = sum(float(getattr(d, field)) * n for d, n in parts) / tokens
        assert combined == pytest.approx(float(getattr(whole, field)), rel=1e-5, abs=1e-6), field
