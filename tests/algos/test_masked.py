"""Masked reductions (`asyncrl.algos.masked`): golden values, mask hygiene, whitening invariants, bad input.

Reference: /work/shared/reference/algos.md §1 (masked_mean/var/whiten) and §9.1, §9.8.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from asyncrl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten, seq_lengths
from tests.strategies import masks, shapes, tensors

F64 = torch.float64
NAN, INF = float("nan"), float("inf")
garbage = st.sampled_from([NAN, INF, -INF, 1e300, -7.5, 0.0])


def assert_near(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=0, atol=atol)


# ---------------------------------------------------------------- (a) golden values

# values [[1, 2, NaN], [3, inf, 4]], mask [[1, 1, 0], [1, 0, 1]]: valid entries 1, 2, 3, 4 (the NaN/inf are masked).
V = torch.tensor([[1.0, 2.0, NAN], [3.0, INF, 4.0]], dtype=F64)
M = torch.tensor([[True, True, False], [True, False, True]])


def test_masked_sum_golden():
    assert_near(masked_sum(V, M), 10.0)  # 1 + 2 + 3 + 4
    assert_near(masked_sum(V, M, dim=-1), [3.0, 7.0])  # row 0: 1 + 2; row 1: 3 + 4
    assert_near(masked_sum(V, M, dim=0), [4.0, 2.0, 4.0])  # columns: 1+3, 2, 4


def test_masked_mean_golden():
    assert_near(masked_mean(V, M), 2.5)  # 10 / 4
    assert_near(masked_mean(V, M, dim=-1), [1.5, 3.5])  # 3/2, 7/2
    # an all-masked row has mean 0 (not NaN): Σ = 0, count clamped to 1
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert_near(masked_mean(V, mask, dim=-1), [1.5, 0.0])
    assert_near(masked_mean(V, torch.zeros_like(M)), 0.0)


def test_masked_var_golden():
    # mean 2.5; deviations −1.5, −0.5, 0.5, 1.5; squares 2.25 + 0.25 + 0.25 + 2.25 = 5; unbiased: 5 / (4 − 1) = 5/3
    assert_near(masked_var(V, M), 5.0 / 3.0)
    # two entries 0 and 1: mean 0.5, squares 0.25 + 0.25 = 0.5, / (2 − 1) = 0.5 (biased would be 0.25)
    assert_near(masked_var(torch.tensor([[0.0, 1.0, 9.0]], dtype=F64), torch.tensor([[True, True, False]])), 0.5)


def test_masked_whiten_golden():
    # (x − 2.5) / sqrt(5/3 + 1e-8): 1 → −1.5/1.2909944 = −1.1618950; 2 → −0.3872983; 3 → +0.3872983; 4 → +1.1618950
    s = math.sqrt(5.0 / 3.0 + 1e-8)
    expected = [[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 0.0, 1.5 / s]]  # masked entries are 0 (documented choice)
    out = masked_whiten(V, M)
    assert_near(out, expected)
    assert abs(out[0, 0].item() - (-1.1618950)) < 1e-6
    # a custom eps: sqrt(5/3 + 1/3) = sqrt(2)
    assert_near(masked_whiten(V, M, eps=1.0 / 3.0), [[-1.5 / math.sqrt(2), -0.5 / math.sqrt(2), 0.0],
                                                 [0.5 / math.sqrt(2), 0.0, 1.5 / math.sqrt(2)]])


def test_masked_whiten_constant_values_give_zero():
    # var = 0 → (x − μ)·rsqrt(0 + eps) = 0 exactly, not NaN
    out = masked_whiten(torch.full((2, 3), 4.25, dtype=F64), torch.ones(2, 3, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(2, 3, dtype=F64))


def test_masked_whiten_accepts_01_float_mask():
    out = masked_whiten(V, M.to(F64))
    assert_near(out, masked_whiten(V, M))


def test_seq_lengths():
    assert seq_lengths(M).tolist() == [2, 2]
    assert seq_lengths(torch.tensor([[False, False], [True, True]])).tolist() == [0, 2]


# ---------------------------------------------------------------- (b) properties


@st.composite
def masked_batch(draw, min_valid: int = 0):
    b, t = draw(shapes())
    mask = draw(masks(b, t))
    assume(int(mask.sum()) >= min_valid)
    x = draw(tensors(b, t))
    junk = torch.tensor(draw(st.lists(garbage, min_size=b * t, max_size=b * t)), dtype=F64).reshape(b, t)
    return x, mask, torch.where(mask, x, junk)


@given(masked_batch())
def test_masked_sum_mean_ignore_masked_values(data):
    x, mask, dirty = data
    for dim in (None, 0, -1):
        torch.testing.assert_close(masked_sum(dirty, mask, dim), masked_sum(x, mask, dim), rtol=0, atol=0)
        torch.testing.assert_close(masked_mean(dirty, mask, dim), masked_mean(x, mask, dim), rtol=0, atol=0)
        assert torch.isfinite(masked_mean(dirty, mask, dim)).all()


@given(masked_batch(min_valid=2))
def test_masked_var_whiten_ignore_masked_values(data):
    x, mask, dirty = data
    torch.testing.assert_close(masked_var(dirty, mask), masked_var(x, mask), rtol=0, atol=0)
    out = masked_whiten(dirty, mask)
    torch.testing.assert_close(out, masked_whiten(x, mask), rtol=0, atol=0)
    assert torch.equal(out[~mask], torch.zeros(int((~mask).sum()), dtype=F64))


@given(masked_batch())
def test_masked_mean_matches_python_loop(data):
    x, mask, _ = data
    vals = [x[i, j].item() for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
    assert_near(masked_mean(x, mask), sum(vals) / len(vals) if vals else 0.0, atol=1e-12)
    rows = []
    for i in range(x.shape[0]):
        r = [x[i, j].item() for j in range(x.shape[1]) if mask[i, j]]
        rows.append(sum(r) / len(r) if r else 0.0)
    assert_near(masked_mean(x, mask, dim=-1), rows, atol=1e-12)


@given(masked_batch(min_valid=2))
def test_masked_whiten_mean_zero_unbiased_std_one(data):
    x, mask, _ = data
    vals = x[mask]
    var = vals.var(unbiased=True).item()
    out = masked_whiten(x, mask)[mask]
    assert abs(out.mean().item()) < 1e-9
    # exact: std(out) = sqrt(var / (var + eps)); ≈ 1 once var ≫ eps
    assert abs(out.std(unbiased=True).item() - math.sqrt(var / (var + 1e-8))) < 1e-9
    if var > 1e-3:
        assert abs(out.std(unbiased=True).item() - 1.0) < 1e-5
    assert_near(masked_var(x, mask), var, atol=1e-10)


@given(masked_batch(min_valid=2), st.floats(0.25, 8.0), st.floats(-5.0, 5.0))
def test_masked_whiten_affine_invariant(data, a, b):
    x, mask, _ = data
    assume(x[mask].var().item() > 1e-2)
    # a·(x − μ)/sqrt(a²σ² + eps) = (x − μ)/sqrt(σ² + eps/a²): whiten(a·x + b, eps) = whiten(x, eps/a²)
    torch.testing.assert_close(masked_whiten(a * x + b, mask), masked_whiten(x, mask, eps=1e-8 / a**2),
                               rtol=0, atol=1e-9)
    # with eps → 0 it is exact up to rounding
    torch.testing.assert_close(masked_whiten(a * x + b, mask, eps=1e-300), masked_whiten(x, mask, eps=1e-300),
                               rtol=0, atol=1e-9)


# ---------------------------------------------------------------- (d) bad input


def test_var_and_whiten_need_two_valid_entries():
    one = torch.tensor([[True, False, False]])
    x = torch.zeros(1, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"at least 2 valid entries"):
        masked_var(x, one)
    with pytest.raises(ValueError, match=r"masked_whiten: mask has 1 valid entry.*at least 2"):
        masked_whiten(x, one)
    with pytest.raises(ValueError, match=r"masked_whiten: mask has 0 valid entries"):
        masked_whiten(x, torch.zeros_like(one))


def test_whiten_bad_shapes_and_masks():
    x = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"masked_whiten: values must be a per-token tensor \[B, T\], got shape \[3\]"):
        masked_whiten(torch.zeros(3, dtype=F64), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"masked_whiten: mask has shape \[2, 2\]"):
        masked_whiten(x, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"masked_whiten: mask must hold only 0 and 1"):
        masked_whiten(x, torch.full((2, 3), 0.5, dtype=F64))
    with pytest.raises(ValueError, match=r"masked_whiten: values must be floating point"):
        masked_whiten(torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"masked_whiten: values must be a torch.Tensor"):
        masked_whiten([[0.0, 1.0]], torch.ones(1, 2, dtype=torch.bool))
