"""Tests of `asyncrl.algos.correction`: TIS weights, rejection masks, decoupled-PPO weights, V-trace.

Golden values are worked out by hand in the comments; property tests use hypothesis (tests/strategies.py).
Reference: /work/shared/reference/algos.md §4 and §9.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.algos.correction import (
    decoupled_ppo_weights, m2po_mask, sequence_rejection_mask, sequence_tis_weights, token_rejection_mask,
    token_tis_weights, vtrace,
)
from tests.strategies import masks, shapes, tensors, vectors

F64 = torch.float64
NAN, INF = math.nan, math.inf
LOG = math.log


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def assert_near(a, b, atol=1e-12, rtol=1e-10):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=atol, rtol=rtol)


def _garbage(b: int, t: int):
    item = st.one_of(st.sampled_from([NAN, INF, -INF, 1e30]), st.floats(-50, 50))
    return st.lists(item, min_size=b * t, max_size=b * t).map(lambda xs: _t(xs).reshape(b, t))


def _pair(lam):
    """logp_proximal, logp_behaviour with log-ratio λ (NaN λ → NaN at a masked slot)."""
    lam = _t(lam)
    beh = torch.full_like(lam, -2.0)
    return beh + lam, beh


# ---------------------------------------------------------------------------------------------------------------
# (a) golden values
# ---------------------------------------------------------------------------------------------------------------

def test_token_tis_golden():
    # ρ = [1, 1.5, 3, 0.5] + a masked NaN; C = 2 → w = [1, 1.5, 2, 0.5] (no lower truncation), 0 masked.
    prox, beh = _pair([[0.0, LOG(1.5), LOG(3.0), LOG(0.5), NAN]])
    mask = torch.tensor([[True, True, True, True, False]])
    out = token_tis_weights(prox, beh, mask, threshold=2.0)
    assert_near(out.weights, _t([[1.0, 1.5, 2.0, 0.5, 0.0]]))
    assert_near(out.mean, 5.0 / 4)
    assert_near(out.max, 2.0)
    assert_near(out.truncated_fraction, 1 / 4)                      # ρ = 3 > C
    assert_near(out.ess, 5.0 ** 2 / (4 * (1 + 2.25 + 4 + 0.25)))    # (Σw)²/(N·Σw²) = 25/30
    assert_near(out.mismatch_kl, -LOG(1.5 * 3.0 * 0.5) / 4)         # mean(−λ) = −log(2.25)/4
    # batch_normalize divides by the mean valid weight 1.25 after truncation (may exceed C)
    norm = token_tis_weights(prox, beh, mask, threshold=2.0, batch_normalize=True)
    assert_near(norm.weights, _t([[0.8, 1.2, 1.6, 0.4, 0.0]]))
    assert_near(norm.mean, 1.0)
    assert_near(norm.ess, 25.0 / 30)
    assert_near(norm.truncated_fraction, 1 / 4)


def test_sequence_tis_golden():
    # row0: λ = [log 1.5, log 2] → Σ = log 3 → w = min(3, 2) = 2 on both valid tokens
    # row1: λ = [log 0.5]          → 0.5
    # row2: λ = [log 2, −log 2, 0]  → 1
    # row3: all masked             → 0 everywhere, excluded from the batch_normalize mean
    prox, beh = _pair([[LOG(1.5), LOG(2.0), NAN], [LOG(0.5), 5.0, -INF], [LOG(2.0), -LOG(2.0), 0.0],
                       [NAN, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True], [False, False, False]])
    out = sequence_tis_weights(prox, beh, mask, threshold=2.0)
    assert_near(out.weights, _t([[2.0, 2.0, 0.0], [0.5, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert_near(out.mean, (4.0 + 0.5 + 3.0) / 6)
    assert_near(out.max, 2.0)
    assert_near(out.truncated_fraction, 2 / 6)  # the two tokens of row0 (raw 3 > 2)
    # batch_normalize: mean over non-empty rows (2 + 0.5 + 1)/3 = 7/6
    norm = sequence_tis_weights(prox, beh, mask, threshold=2.0, batch_normalize=True)
    assert_near(norm.weights, _t([[12 / 7, 12 / 7, 0.0], [3 / 7, 0.0, 0.0], [6 / 7, 6 / 7, 6 / 7], [0.0, 0.0, 0.0]]))


def test_sequence_tis_sums_before_clamping():
    # tokens at −40 and +25: the true sequence ratio is e^−15 ≈ 3.1e−7; clamping each token to ±20 first would
    # give e^0 = 1. Likewise +15 and +15 is e^30, clamped after the sum to e^20, then truncated to C.
    prox, beh = _t([[-41.0, -1.0], [-1.0, -1.0]]), _t([[-1.0, -26.0], [-16.0, -16.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = sequence_tis_weights(prox, beh, mask, threshold=2.0)
    assert_near(out.weights[0], _t([math.exp(-15.0)] * 2), rtol=1e-12, atol=0)
    assert_near(out.weights[1], _t([2.0, 2.0]))
    assert_near(out.mismatch_kl, (15.0 - 30.0) / 4)  # the true per-token log-ratios, unclamped
    # the rejection statistic sums the true log-ratios too: row 0's e^−15 lies outside [1/2, 2]
    rejected = sequence_rejection_mask(prox, beh, mask, stat="k1", reduce="sum", upper=2.0)
    assert rejected.mask.tolist() == [[False, False], [False, False]]
    kept = sequence_rejection_mask(prox, beh, mask, stat="k1", reduce="sum", lower=1e-7, upper=1e14)
    assert kept.mask.tolist() == [[True, True], [True, True]]


def test_token_rejection_k1_golden():
    # single upper U = 2 means ρ ∈ [1/2, 2]: ρ = [1, 1.5, 0.55, 2.5, 0.4] → keep [T, T, T, F, F]; masked stays F
    # (0.4 < 1/2 is rejected: a single U bounds both sides)
    prox, beh = _pair([[0.0, LOG(1.5), LOG(0.55), LOG(2.5), LOG(0.4), 0.0]])
    mask = torch.tensor([[True] * 5 + [False]])
    out = token_rejection_mask(prox, beh, mask, stat="k1", upper=2.0)
    assert out.mask.tolist() == [[True, True, True, False, False, False]]
    assert_near(out.rejected_fraction, 2 / 5, atol=1e-7)
    # only a lower bound: ρ ≥ 0.45 keeps 2.5 too (upper = ∞)
    lo = token_rejection_mask(prox, beh, mask, stat="k1", lower=0.45)
    assert lo.mask.tolist() == [[True, True, True, True, False, False]]


def test_token_rejection_k1_bounds_the_ratio_itself():
    # asymmetric [0.6, 1.6]: ρ = 0.61 is kept and ρ = 1.65 rejected (verl's 1/ρ filter would do the opposite)
    prox, beh = _pair([[LOG(0.61), LOG(1.65)]])
    out = token_rejection_mask(prox, beh, torch.ones(1, 2, dtype=torch.bool), stat="k1", lower=0.6, upper=1.6)
    assert out.mask.tolist() == [[True, False]]


@pytest.mark.parametrize("stat, upper, keep", [
    ("k2", 0.2, [True, True, False]),    # ½λ² = [0.005, 0.125, 0.5]
    ("k2", 0.11, [True, False, False]),
    ("k3", 0.11, [True, True, False]),   # e^λ − 1 − λ = [0.00517, 0.10653, 0.71828]
    ("k3", 0.1, [True, False, False]),
    ("k3", 0.0, [False, False, False]),
])
def test_token_rejection_k2_k3_golden(stat, upper, keep):
    prox, beh = _pair([[0.1, -0.5, 1.0, NAN]])
    mask = torch.tensor([[True, True, True, False]])
    out = token_rejection_mask(prox, beh, mask, stat=stat, upper=upper)
    assert out.mask.tolist() == [keep + [False]]
    assert_near(out.rejected_fraction, keep.count(False) / 3, atol=1e-7)


_SEQ_LAM = [[0.3, 0.3, NAN], [0.1, -0.1, 0.05], [1.0, 7.0, -INF], [-0.2, -0.2, -0.2]]
_SEQ_MASK = [[True, True, False], [True, True, True], [True, False, False], [True, True, True]]


@pytest.mark.parametrize("kwargs, rows", [
    # k1 sum, U = 1.5 → [2/3, 1.5]: exp(Σλ) = [e^0.6 = 1.82, e^0.05, e, e^−0.6 = 0.55]
    ({"stat": "k1", "reduce": "sum", "upper": 1.5}, [False, True, False, False]),
    # k1 mean (geometric mean): [e^0.3 = 1.35, e^0.0167, e, e^−0.2 = 0.82]
    ({"stat": "k1", "reduce": "mean", "upper": 1.5}, [True, True, False, True]),
    ({"stat": "k1", "reduce": "mean", "lower": 0.9}, [True, True, True, False]),
    # k2 max: [0.045, 0.005, 0.5, 0.02]
    ({"stat": "k2", "reduce": "max", "upper": 0.04}, [False, True, False, True]),
    # k2 sum: [0.09, 0.01125, 0.5, 0.06]
    ({"stat": "k2", "reduce": "sum", "upper": 0.04}, [False, True, False, False]),
    # k3 mean: [0.04986, 0.00376, 0.71828, 0.01873]
    ({"stat": "k3", "reduce": "mean", "upper": 0.03}, [False, True, False, True]),
    # k3 sum: [0.0997, 0.01128, 0.71828, 0.0562]
    ({"stat": "k3", "reduce": "sum", "upper": 0.03}, [False, True, False, False]),
])
def test_sequence_rejection_golden(kwargs, rows):
    prox, beh = _pair(_SEQ_LAM)
    mask = torch.tensor(_SEQ_MASK)
    out = sequence_rejection_mask(prox, beh, mask, **kwargs)
    expected = mask & torch.tensor(rows)[:, None]
    assert out.mask.tolist() == expected.tolist()
    assert_near(out.rejected_fraction, 1 - expected.sum().item() / mask.sum().item(), atol=1e-7)


@pytest.mark.parametrize("cap, drop, weights, trunc", [
    (5.0, False, [0.5, 1.0, 3.0, 5.0], 1 / 4),   # clamp: min(ρ, 5)
    (5.0, True, [0.5, 1.0, 3.0, 0.0], 1 / 4),    # drop: ρ > 5 → 0, others keep ρ
    (2.0, False, [0.5, 1.0, 2.0, 2.0], 2 / 4),
    (2.0, True, [0.5, 1.0, 0.0, 0.0], 2 / 4),
    (None, False, [0.5, 1.0, 3.0, 6.0], 0.0),    # unbounded
])
def test_decoupled_ppo_weights_golden(cap, drop, weights, trunc):
    # ρ = [0.5, 1, 3, 6] + a masked NaN
    prox, beh = _pair([[LOG(0.5), 0.0, LOG(3.0), LOG(6.0), NAN]])
    mask = torch.tensor([[True] * 4 + [False]])
    out = decoupled_ppo_weights(prox, beh, mask, cap=cap, drop_above_cap=drop)
    assert_near(out.weights, _t([weights + [0.0]]))
    assert_near(out.truncated_fraction, trunc)
    assert_near(out.mean, sum(weights) / 4)
    assert_near(out.max, max(weights))


def test_vtrace_golden():
    # λ = 0.5, ρ̄ = 1.5, ρ̄_pg = 1.2.
    # Row 0: mask [1, 0, 1] (an interior hole at t=1, full of NaN), ρ = [2, ·, 0.5], γ = [0.9, ·, 0.8],
    #        r = [1, ·, 2], V = [0.5, ·, 1], bootstrap 3.
    #   t=2 (last): ρ̄ = min(1.5, 0.5) = 0.5; δ = 0.5·(2 + 0.8·3 − 1) = 1.7; err = 1.7; v = 2.7
    #               q = 2 + 0.8·3 = 4.4; pg = min(1.2, 0.5)·(4.4 − 1) = 1.7
    #   t=0: next valid step t=2: V(x_1) = 1, v_1 = 2.7; ρ̄ = min(1.5, 2) = 1.5; δ = 1.5·(1 + 0.9·1 − 0.5) = 2.1
    #        c = 0.5·min(1, 2) = 0.5; err = 2.1 + 0.9·0.5·1.7 = 2.865; v = 3.365
    #        q = 1 + 0.9·(0.5·2.7 + 0.5·1) = 2.665; pg = min(1.2, 2)·(2.665 − 0.5) = 2.598
    # Row 1: mask [1, 1, 0], ρ = 1, γ = 1, r = [0, 1], V = [0, 0], bootstrap 2.
    #   t=1: δ = 1 + 2 − 0 = 3; v = 3; q = 3; pg = 3
    #   t=0: δ = 0; err = 0 + 1·0.5·1·3 = 1.5; v = 1.5; q = 0 + (0.5·3 + 0.5·0) = 1.5; pg = 1.5
    log_rhos = _t([[LOG(2.0), NAN, LOG(0.5)], [0.0, 0.0, INF]])
    discounts = _t([[0.9, NAN, 0.8], [1.0, 1.0, NAN]])
    rewards = _t([[1.0, NAN, 2.0], [0.0, 1.0, -INF]])
    values = _t([[0.5, NAN, 1.0], [0.0, 0.0, NAN]])
    boot = _t([3.0, 2.0])
    mask = torch.tensor([[True, False, True], [True, True, False]])
    out = vtrace(log_rhos, discounts, rewards, values, boot, mask, lambda_=0.5, clip_rho_threshold=1.5,
                 clip_pg_rho_threshold=1.2)
    assert_near(out.vs, _t([[3.365, 0.0, 2.7], [1.5, 3.0, 0.0]]))
    assert_near(out.pg_advantages, _t([[2.598, 0.0, 1.7], [1.5, 3.0, 0.0]]))
    assert_near(out.errors, _t([[2.865, 0.0, 1.7], [1.5, 3.0, 0.0]]))


# ---------------------------------------------------------------------------------------------------------------
# (b) properties
# ---------------------------------------------------------------------------------------------------------------

@st.composite
def logp_pair(draw, max_b=5, max_t=6, nonempty_rows=False):
    """(mask, logp_proximal, logp_behaviour) with some valid positions where the two agree exactly, and garbage
    (NaN / inf) at masked positions."""
    b, t = draw(shapes(max_b=max_b, max_t=max_t))
    mask = draw(masks(b, t, nonempty_rows=nonempty_rows))
    beh = draw(tensors(b, t, lo=-6.0, hi=0.0))
    prox = beh + draw(tensors(b, t, lo=-2.5, hi=2.5))
    agree = draw(masks(b, t))
    prox = torch.where(agree, beh, prox)
    prox = torch.where(mask, prox, draw(_garbage(b, t)))
    beh = torch.where(mask, beh, draw(_garbage(b, t)))
    return mask, prox, beh


def _lam(prox, beh, mask):
    return torch.where(mask, prox - beh, 0.0)


@given(data=st.data())
def test_token_tis_weights_properties(data):
    mask, prox, beh = data.draw(logp_pair())
    c = data.draw(st.floats(1.0, 10.0))
    prox = prox.clone().requires_grad_()
    out = token_tis_weights(prox, beh, mask, threshold=c)
    w = out.weights
    assert not w.requires_grad
    for stat in out:
        assert torch.isfinite(stat).all()
    assert (w >= 0).all() and (w <= c).all()
    assert (w[~mask] == 0).all()
    lam = _lam(prox.detach(), beh, mask)
    agree = mask & (prox.detach() == beh)
    assert (w[agree] == 1.0).all()
    assert_near(w, torch.where(mask, torch.exp(lam).clamp(max=c), 0.0))
    n = max(int(mask.sum()), 1)
    assert_near(out.mean, w.sum() / n)
    assert_near(out.truncated_fraction, (mask & (torch.exp(lam) > c)).sum().item() / n)
    assert_near(out.mismatch_kl, -lam.sum() / n)
    if mask.any():
        assert 0.0 < out.ess.item() <= 1.0 + 1e-12


@given(data=st.data())
def test_token_tis_batch_normalize_has_unit_mean(data):
    mask, prox, beh = data.draw(logp_pair())
    c = data.draw(st.floats(1.0, 10.0))
    raw = token_tis_weights(prox, beh, mask, threshold=c)
    norm = token_tis_weights(prox, beh, mask, threshold=c, batch_normalize=True)
    assert (norm.weights[~mask] == 0).all()
    if mask.any():
        assert_near(norm.mean, 1.0)
        assert_near(norm.weights, raw.weights / raw.mean)


@given(data=st.data())
def test_sequence_tis_weights_properties(data):
    mask, prox, beh = data.draw(logp_pair())
    c = data.draw(st.floats(1.0, 10.0))
    prox = prox.clone().requires_grad_()
    out = sequence_tis_weights(prox, beh, mask, threshold=c)
    w = out.weights
    assert not w.requires_grad
    assert (w >= 0).all() and (w <= c).all()
    assert (w[~mask] == 0).all()
    lam = _lam(prox.detach(), beh, mask)
    for i in range(mask.shape[0]):
        row = w[i][mask[i]]
        if row.numel() == 0:
            continue
        assert (row == row[0]).all()  # constant over the row's valid tokens
        expected = min(math.exp(max(-20.0, min(20.0, lam[i].sum().item()))), c)
        assert_near(row[0], expected)
        if bool((prox.detach()[i][mask[i]] == beh[i][mask[i]]).all()):
            assert row[0].item() == 1.0
    norm = sequence_tis_weights(prox, beh, mask, threshold=c, batch_normalize=True)
    nonempty = mask.any(-1)
    if nonempty.any():
        first = norm.weights.gather(1, mask.to(torch.int64).argmax(-1, keepdim=True))[:, 0]
        assert_near(first[nonempty].mean(), 1.0)


@given(data=st.data())
def test_token_rejection_properties(data):
    mask, prox, beh = data.draw(logp_pair())
    stat = data.draw(st.sampled_from(["k1", "k2", "k3"]))
    lam = _lam(prox, beh, mask)
    if stat == "k1":
        upper = data.draw(st.one_of(st.none(), st.floats(1.0, 10.0)))
        lower = data.draw(st.floats(0.05, 1.0)) if upper is None else data.draw(st.one_of(st.none(), st.floats(0.05, 1.0)))
        out = token_rejection_mask(prox, beh, mask, stat=stat, lower=lower, upper=upper)
        lo = 1.0 / upper if lower is None else lower
        hi = INF if upper is None else upper
        rho = torch.exp(lam)
        keep = (rho >= lo) & (rho <= hi)
    else:
        upper = data.draw(st.floats(0.0, 2.0))
        out = token_rejection_mask(prox, beh, mask, stat=stat, upper=upper)
        div = 0.5 * lam ** 2 if stat == "k2" else torch.expm1(lam) - lam
        keep = div <= upper
    assert out.mask.dtype == torch.bool
    assert not (out.mask & ~mask).any()  # never un-masks
    assert torch.equal(out.mask, mask & keep)
    agree = mask & (prox == beh)
    assert out.mask[agree].all()  # identical policies are never rejected (1 ∈ bounds, divergence 0)
    n = max(int(mask.sum()), 1)
    assert_near(out.rejected_fraction, (int(mask.sum()) - int(out.mask.sum())) / n, atol=1e-7)


@given(data=st.data())
def test_sequence_rejection_properties(data):
    mask, prox, beh = data.draw(logp_pair())
    stat = data.draw(st.sampled_from(["k1", "k2", "k3"]))
    reduce = data.draw(st.sampled_from(["sum", "mean"] if stat == "k1" else ["sum", "mean", "max"]))
    lam = _lam(prox, beh, mask)
    if stat == "k1":
        upper = data.draw(st.floats(1.0, 5.0))
        out = sequence_rejection_mask(prox, beh, mask, stat=stat, reduce=reduce, upper=upper)
    else:
        upper = data.draw(st.floats(0.0, 2.0))
        out = sequence_rejection_mask(prox, beh, mask, stat=stat, reduce=reduce, upper=upper)
    assert not (out.mask & ~mask).any()
    for i in range(mask.shape[0]):
        vals = [lam[i, j].item() for j in range(mask.shape[1]) if mask[i, j]]
        if not vals:
            assert not out.mask[i].any()
            continue
        if stat == "k1":
            x = sum(vals) if reduce == "sum" else sum(vals) / len(vals)
            keep = 1.0 / upper <= math.exp(x) <= upper
        else:
            per = [0.5 * v * v if stat == "k2" else math.expm1(v) - v for v in vals]
            x = {"sum": sum(per), "mean": sum(per) / len(per), "max": max(per)}[reduce]
            keep = x <= upper
        # row-wise decision; skip knife-edge rows where float association could flip the comparison
        bound = math.log(upper) if stat == "k1" else upper
        if abs(abs(x) - bound) < 1e-9:
            continue
        assert out.mask[i].tolist() == (mask[i] & keep).tolist()


@given(data=st.data())
def test_decoupled_weights_properties(data):
    mask, prox, beh = data.draw(logp_pair())
    cap = data.draw(st.floats(0.5, 10.0))
    clamp = decoupled_ppo_weights(prox, beh, mask, cap=cap)
    drop = decoupled_ppo_weights(prox, beh, mask, cap=cap, drop_above_cap=True)
    rho = torch.exp(_lam(prox, beh, mask))
    for out in (clamp, drop):
        assert not out.weights.requires_grad
        assert (out.weights[~mask] == 0).all()
        assert (out.weights >= 0).all() and (out.weights <= cap).all()
        assert_near(out.truncated_fraction, (mask & (rho > cap)).sum().item() / max(int(mask.sum()), 1))
    assert_near(clamp.weights, torch.where(mask, rho.clamp(max=cap), 0.0))
    assert_near(drop.weights, torch.where(mask & (rho <= cap), rho, 0.0))
    assert (drop.weights <= clamp.weights).all()


def _vtrace_ref(log_rhos, discounts, rewards, values, boot, mask, lam, rho_bar, pg_bar):
    """Scalar V-trace: loop over rows and, backwards, over the valid steps of each row (masked steps skipped)."""
    b, t = len(mask), len(mask[0])
    vs = [[0.0] * t for _ in range(b)]
    pg = [[0.0] * t for _ in range(b)]
    for i in range(b):
        next_v = next_vs = float(boot[i])  # V(x_{s+1}), v_{s+1}; both = bootstrap after the last valid step
        for s in reversed([j for j in range(t) if mask[i][j]]):
            rho = math.exp(max(-20.0, min(20.0, float(log_rhos[i][s]))))
            g, r, v = float(discounts[i][s]), float(rewards[i][s]), float(values[i][s])
            delta = min(rho_bar, rho) * (r + g * next_v - v)
            err = delta + g * lam * min(1.0, rho) * (next_vs - next_v)
            q = r + g * (lam * next_vs + (1.0 - lam) * next_v)
            vs[i][s] = v + err
            pg[i][s] = min(pg_bar, rho) * (q - v)
            next_v, next_vs = v, v + err
    return _t(vs), _t(pg)


@st.composite
def vtrace_inputs(draw, max_b=4, max_t=7):
    b, t = draw(shapes(max_b=max_b, max_t=max_t))
    mask = draw(masks(b, t))  # any pattern: interior holes, empty rows
    dirty = lambda x: torch.where(mask, x, draw(_garbage(b, t)))  # noqa: E731
    log_rhos = dirty(draw(tensors(b, t, lo=-2.0, hi=2.0)))
    discounts = dirty(draw(tensors(b, t, lo=0.0, hi=1.0)))
    rewards = dirty(draw(tensors(b, t)))
    values = dirty(draw(tensors(b, t)))
    boot = draw(vectors(b))
    return mask, log_rhos, discounts, rewards, values, boot


@given(inputs=vtrace_inputs(), lam=st.floats(0.0, 1.0), rho_bar=st.floats(0.1, 3.0), pg_bar=st.floats(0.1, 3.0))
def test_vtrace_matches_scalar_loop_reference(inputs, lam, rho_bar, pg_bar):
    mask, log_rhos, discounts, rewards, values, boot = inputs
    out = vtrace(log_rhos, discounts, rewards, values, boot, mask, lambda_=lam, clip_rho_threshold=rho_bar,
                 clip_pg_rho_threshold=pg_bar)
    vs, pg = _vtrace_ref(log_rhos.tolist(), discounts.tolist(), rewards.tolist(), values.tolist(), boot.tolist(),
                         mask.tolist(), lam, rho_bar, pg_bar)
    assert_near(out.vs, vs, atol=1e-9, rtol=1e-9)
    assert_near(out.pg_advantages, pg, atol=1e-9, rtol=1e-9)
    assert_near(out.errors, torch.where(mask, vs - values, 0.0), atol=1e-9, rtol=1e-9)


@given(inputs=vtrace_inputs())
def test_vtrace_on_policy_lambda_one_is_discounted_return(inputs):
    mask, _, discounts, rewards, values, boot = inputs
    out = vtrace(torch.zeros_like(values), discounts, rewards, values, boot, mask, lambda_=1.0)
    b, t = mask.shape
    ret = torch.zeros(b, t, dtype=F64)
    for i in range(b):
        g = boot[i].item()
        for s in reversed(range(t)):
            if mask[i, s]:
                g = rewards[i, s].item() + discounts[i, s].item() * g
                ret[i, s] = g
    assert_near(out.vs, ret, atol=1e-9, rtol=1e-9)
    # and the policy-gradient advantage is the λ=1 (Monte-Carlo) advantage G_s − V(x_s)
    assert_near(out.pg_advantages, torch.where(mask, ret - values, 0.0), atol=1e-9, rtol=1e-9)


@given(inputs=vtrace_inputs(), lam=st.floats(0.0, 1.0), bars=st.lists(st.floats(0.05, 3.0), min_size=2, max_size=2))
def test_vtrace_lower_rho_bar_never_increases_last_step_error(inputs, lam, bars):
    mask, log_rhos, discounts, rewards, values, boot = inputs
    lo, hi = sorted(bars)
    small = vtrace(log_rhos, discounts, rewards, values, boot, mask, lambda_=lam, clip_rho_threshold=lo)
    big = vtrace(log_rhos, discounts, rewards, values, boot, mask, lambda_=lam, clip_rho_threshold=hi)
    for i in range(mask.shape[0]):
        valid = mask[i].nonzero()
        if valid.numel() == 0:
            continue
        last = valid[-1].item()
        assert abs(small.errors[i, last].item()) <= abs(big.errors[i, last].item()) * (1 + 1e-12) + 1e-15


# ---------------------------------------------------------------------------------------------------------------
# (d) bad input
# ---------------------------------------------------------------------------------------------------------------

def _good(b=2, t=3):
    x = torch.full((b, t), -1.0, dtype=F64)
    return x, x.clone(), torch.ones(b, t, dtype=torch.bool)


@pytest.mark.parametrize("fn", [token_tis_weights, sequence_tis_weights])
@pytest.mark.parametrize("c", [0.99, 0.0, -1.0, NAN])
def test_tis_threshold_below_one_rejected(fn, c):
    with pytest.raises(ValueError, match=r"threshold C must be >= 1"):
        fn(*_good(), threshold=c)


@pytest.mark.parametrize("fn", [token_tis_weights, sequence_tis_weights, decoupled_ppo_weights])
def test_weight_functions_reject_bad_tensors(fn):
    prox, beh, mask = _good()
    with pytest.raises(ValueError, match=r"logp_behaviour must be a per-token tensor \[B, T\]"):
        fn(prox, beh[:, 0], mask)
    with pytest.raises(ValueError, match=r"logp_behaviour has shape \[2, 2\]"):
        fn(prox, beh[:, :2], mask)
    with pytest.raises(ValueError, match=r"response_mask must hold only 0 and 1"):
        fn(prox, beh, torch.full((2, 3), 2.0, dtype=F64))
    bad = beh.clone()
    bad[0, 1] = NAN
    with pytest.raises(ValueError, match=r"logp_behaviour holds 1 non-finite value"):
        fn(prox, bad, mask)
    z = torch.zeros(0, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"response_mask is empty"):
        fn(z, z, torch.zeros(0, 3, dtype=torch.bool))


@pytest.mark.parametrize("fn", [token_rejection_mask, sequence_rejection_mask])
@pytest.mark.parametrize("kwargs, match", [
    ({"stat": "k2", "lower": 0.1, "upper": 1.0}, r"stat='k2' is a divergence .*lower=0.1"),
    ({"stat": "k3", "lower": 0.0, "upper": 1.0}, r"stat='k3' is a divergence"),
    ({"stat": "k2"}, r"stat='k2' needs an `upper` bound"),
    ({"stat": "k3", "upper": -0.1}, r"upper must be >= 0"),
    ({"stat": "k1"}, r"stat='k1' needs ratio bounds"),
    ({"stat": "k1", "upper": 0.5}, r"lower=2.0 exceeds upper=0.5"),      # single U < 1 → [1/U, U] empty
    ({"stat": "k1", "lower": 2.0, "upper": 1.5}, r"lower=2.0 exceeds upper=1.5"),
    ({"stat": "k1", "upper": 0.0}, r"upper must be > 0"),
    ({"stat": "k1", "lower": -1.0}, r"lower must be > 0"),
    ({"stat": "k4", "upper": 1.0}, r"stat='k4' is not one of"),
])
def test_rejection_bad_bounds(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*_good(), **kwargs)


def test_sequence_rejection_k1_with_max_rejected():
    with pytest.raises(ValueError, match=r"reduce='max' is defined for the divergences k2/k3 only"):
        sequence_rejection_mask(*_good(), stat="k1", reduce="max", upper=2.0)
    with pytest.raises(ValueError, match=r"reduce='min' is not one of"):
        sequence_rejection_mask(*_good(), stat="k2", reduce="min", upper=2.0)


def test_decoupled_bad_cap():
    with pytest.raises(ValueError, match=r"drop_above_cap=True needs a cap"):
        decoupled_ppo_weights(*_good(), cap=None, drop_above_cap=True)
    with pytest.raises(ValueError, match=r"cap must be > 0"):
        decoupled_ppo_weights(*_good(), cap=0.0)


def _vt_good(b=2, t=3):
    x = torch.zeros(b, t, dtype=F64)
    return dict(log_rhos=x, discounts=x + 0.9, rewards=x + 1, values=x, bootstrap_value=torch.zeros(b, dtype=F64),
                response_mask=torch.ones(b, t, dtype=torch.bool))


@pytest.mark.parametrize("change, match", [
    ({"bootstrap_value": torch.zeros(2, 1, dtype=F64)}, r"bootstrap_value must be a per-sequence tensor \[B\] with B=2"),
    ({"bootstrap_value": torch.zeros(3, dtype=F64)}, r"bootstrap_value must be a per-sequence tensor \[B\]"),
    ({"bootstrap_value": _t([0.0, NAN])}, r"bootstrap_value holds 1 non-finite"),
    ({"discounts": torch.full((2,), 0.9, dtype=F64)}, r"discounts must be a per-token tensor \[B, T\]"),
    ({"rewards": torch.zeros(2, 4, dtype=F64)}, r"rewards has shape \[2, 4\]"),
    ({"values": _t([[0.0, 0.0, 0.0], [0.0, INF, 0.0]])}, r"values holds 1 non-finite"),
    ({"response_mask": torch.ones(3, 3, dtype=torch.bool)}, r"response_mask has shape \[3, 3\]"),
    ({"lambda_": 1.5}, r"lambda_ must lie in \[0, 1\]"),
    ({"lambda_": -0.1}, r"lambda_ must lie in \[0, 1\]"),
    ({"clip_rho_threshold": 0.0}, r"clip_rho_threshold must be > 0"),
    ({"clip_pg_rho_threshold": -1.0}, r"clip_pg_rho_threshold must be > 0"),
])
def test_vtrace_bad_input(change, match):
    kwargs = _vt_good()
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        vtrace(**kwargs)


def test_vtrace_empty_batch_rejected():
    z = torch.zeros(0, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"response_mask is empty"):
        vtrace(z, z, z, z, torch.zeros(0, dtype=F64), torch.zeros(0, 3, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------------------
# M2PO (arXiv:2510.01161)
# ---------------------------------------------------------------------------------------------------------------

def test_m2po_golden():
    # λ = [3, 0.1, -0.2, 0] + a masked slot → m2 = [9, 0.01, 0.04, 0], mean 2.2625 ≥ τ = 1; dropping the largest
    # (9) leaves mean (0.01 + 0.04 + 0) / 3 = 0.0167 < 1: exactly one token rejected.
    prox, beh = _pair([[3.0, 0.1, -0.2, 0.0, NAN]])
    mask = torch.tensor([[True, True, True, True, False]])
    out = m2po_mask(prox, beh, mask, threshold=1.0)
    assert out.mask.tolist() == [[False, True, True, True, False]]
    assert_near(out.rejected_fraction, 0.25)
    # τ = 0.02: after the 9 the mean is 0.0167 < 0.02 too → still one; τ = 0.015: drop 0.04 as well →
    # (0.01 + 0) / 2 = 0.005 < 0.015
    assert m2po_mask(prox, beh, mask, threshold=0.02).mask.tolist() == [[False, True, True, True, False]]
    assert m2po_mask(prox, beh, mask, threshold=0.015).mask.tolist() == [[False, True, False, True, False]]
    # τ above the mean: nothing rejected
    assert torch.equal(m2po_mask(prox, beh, mask, threshold=2.27).mask, mask)


def test_m2po_keeps_one_token_when_no_suffix_gets_below_the_threshold():
    # m2 = [4, 4, 1]: suffix means 3, 2.5, 1 — none < 0.5 → keep only the smallest
    prox, beh = _pair([[2.0, -2.0], [1.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    out = m2po_mask(prox, beh, mask, threshold=0.5)
    assert out.mask.tolist() == [[False, False], [True, False]]
    assert_near(out.rejected_fraction, 2 / 3)


@given(data=st.data())
def test_m2po_properties(data):
    mask, prox, beh = data.draw(logp_pair())
    tau = data.draw(st.floats(1e-3, 4.0))
    out = m2po_mask(prox, beh, mask, threshold=tau)
    m2 = _lam(prox, beh, mask).square()
    kept, dropped = m2[out.mask], m2[mask & ~out.mask]
    assert out.mask.dtype == torch.bool and not (out.mask & ~mask).any()  # never un-masks
    n = int(mask.sum())
    if n == 0:
        assert float(out.rejected_fraction) == 0.0
        return
    assert kept.numel() >= 1
    if dropped.numel():
        assert kept.max() <= dropped.min()  # the largest second moments go first
        assert kept.mean() < tau or kept.numel() == 1
        # minimal: putting back the smallest rejected token lifts the kept mean to τ or above
        assert torch.cat([kept, dropped.min().reshape(1)]).mean() >= tau * (1 - 1e-12)
    else:
        # nothing rejected only when the batch is already inside the region (or is a single token)
        assert m2[mask].mean() < tau or n == 1
    assert_near(out.rejected_fraction, (n - int(out.mask.sum())) / n, atol=1e-7)


def test_m2po_leaves_on_policy_data_alone():
    prox, beh = _pair([[0.0, 0.0, 0.0]])
    assert torch.equal(m2po_mask(prox, beh, torch.ones(1, 3, dtype=torch.bool), threshold=1e-6).mask,
                       torch.ones(1, 3, dtype=torch.bool))


@pytest.mark.parametrize("threshold", [0.0, -1.0, NAN])
def test_m2po_bad_threshold(threshold):
    prox, beh = _pair([[0.5]])
    with pytest.raises(ValueError, match="threshold"):
        m2po_mask(prox, beh, torch.ones(1, 1, dtype=torch.bool), threshold=threshold)

