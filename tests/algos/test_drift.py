"""The drift from the behaviour policy (asyncrl/algos/drift.py): golden values, on-policy zero drift, ESS in (0, 1]
(hypothesis), only valid tokens counted, and the means of two halves combining, weighted by their tokens, into the
whole batch's."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from asyncrl import algos
from asyncrl.algos.drift import UNBOUNDED_LAG


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


def _drifted(seed: int, scale: float, shape: tuple[int, int]):
    """(generator, log μ, log π_θ = log μ + noise of `scale`), seeded."""
    gen = torch.Generator().manual_seed(seed)
    logp_b = -torch.rand(*shape, generator=gen) * 4
    return gen, logp_b, logp_b + torch.randn(*shape, generator=gen) * scale


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.0, 5.0), split=st.integers(1, 5))
def test_ess_lies_in_0_1_and_halves_combine_into_the_whole(seed, scale, split):
    gen, logp_b, logp = _drifted(seed, scale, (6, 7))
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


def test_opsm_golden_values():
    """Row 0: negative advantage, drift ln 2 / 2 > δ 0.1: masked. Row 1: the same drift, positive advantage: kept.
    Row 2: negative advantage, drift 0.05 < δ: kept. Of 6 valid tokens 2 are removed."""
    logp_b = torch.full((3, 2), -1.0)
    logp = logp_b - torch.tensor([[math.log(2.0), 0.0], [math.log(2.0), 0.0], [0.1, 0.0]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    out = algos.off_policy_sequence_mask(logp, logp_b, adv, mask, threshold=0.1)
    assert out.mask.tolist() == [[False, False], [True, True], [True, True]]
    assert float(out.masked_fraction) == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="threshold δ must be >= 0"):
        algos.off_policy_sequence_mask(logp, logp_b, adv, mask, threshold=-1.0)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.0, 3.0), threshold=st.floats(0.0, 1.0))
def test_opsm_removes_whole_negative_sequences_only(seed, scale, threshold):
    gen, logp_b, logp = _drifted(seed, scale, (5, 6))
    adv = torch.randn(5, 1, generator=gen).expand(5, 6)
    mask = torch.rand(5, 6, generator=gen) > 0.2
    out = algos.off_policy_sequence_mask(logp, logp_b, adv, mask, threshold=threshold)
    assert not (out.mask & ~mask).any()  # never adds a token
    for row in range(5):
        removed = mask[row] & ~out.mask[row]
        assert not removed.any() or (removed == mask[row]).all()  # a whole sequence or nothing
        if removed.any():
            assert float(adv[row, 0]) < 0
    same = algos.off_policy_sequence_mask(logp, logp_b, adv, mask, threshold=float("inf"))
    assert torch.equal(same.mask, mask) and float(same.masked_fraction) == 0.0


def test_drift_rate_and_lag_cap_golden_values():
    """The first lagged step sets the rate (0.06 at lag 2: 0.03 a version); the next (0.02 at lag 1) moves it by
    (1 − decay); steps below lag 1/2 say nothing; the cap is budget / rate rounded down, never below 1."""
    rate = algos.DriftRate()
    assert algos.drift_lag_cap(0.1, rate) is None  # unknown: no cap
    assert algos.drift_rate_update(rate, kl=0.5, mean_lag=0.4) == rate
    rate = algos.drift_rate_update(rate, kl=0.06, mean_lag=2.0)
    assert rate == algos.DriftRate(pytest.approx(0.03), 1)
    assert algos.drift_lag_cap(0.09, rate) == 3 and algos.drift_lag_cap(0.089, rate) == 2
    assert algos.drift_lag_cap(0.001, rate) == 1
    rate = algos.drift_rate_update(rate, kl=0.02, mean_lag=1.0, decay=0.5)
    assert rate == algos.DriftRate(pytest.approx(0.025), 2)
    assert algos.drift_rate_update(rate, kl=-0.01, mean_lag=1.0, decay=0.0) == algos.DriftRate(0.0, 3)
    assert algos.drift_lag_cap(0.1, algos.DriftRate(0.0, 3)) is None  # no drift: no cap
    assert algos.drift_lag_cap(0.1, algos.DriftRate(1e-9, 3)) is None  # 10^8 versions of lag: no cap either
    with pytest.raises(ValueError, match="budget"):
        algos.drift_lag_cap(0.0, rate)
    with pytest.raises(ValueError, match="decay"):
        algos.drift_rate_update(rate, kl=0.1, mean_lag=1.0, decay=1.0)


@given(kls=st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(0.5, 8.0)), min_size=1, max_size=12),
       budget=st.floats(1e-4, 1.0))
def test_the_rate_stays_within_the_observed_rates_and_the_cap_affords_the_budget(kls, budget):
    """An average of the observed per-version drifts lies between their extremes; the cap L is the largest lag
    with L · rate ≤ budget (or 1)."""
    rate = algos.DriftRate()
    for kl, lag in kls:
        rate = algos.drift_rate_update(rate, kl=kl, mean_lag=lag)
    observed = [kl / lag for kl, lag in kls]
    assert min(observed) - 1e-12 <= rate.per_version <= max(observed) + 1e-12 and rate.steps == len(kls)
    cap = algos.drift_lag_cap(budget, rate)
    if rate.per_version == 0 or budget / rate.per_version > UNBOUNDED_LAG:
        assert cap is None
    else:
        assert cap >= 1 and (cap == 1 or cap * rate.per_version <= budget * (1 + 1e-9))
        assert (cap + 1) * rate.per_version > budget
