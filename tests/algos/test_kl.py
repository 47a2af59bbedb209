"""KL estimators, KL-in-reward and the adaptive controller (`asyncrl.algos.kl`).

Reference: /work/shared/reference/algos.md §5 (5.1 estimators, 5.2 KL in reward, 5.3 controllers) and §9.7.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.algos.kl import (
    KL_ESTIMATORS, adaptive_kl_coef, kl_abs, kl_k1, kl_k2, kl_k3, kl_penalized_rewards,
)
from tests.strategies import masks, shapes, tensors

F64 = torch.float64
NAN, INF = float("nan"), float("inf")
ESTIMATORS = [kl_k1, kl_k2, kl_k3, kl_abs]


def assert_near(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=0, atol=atol)


# ---------------------------------------------------------------- (a) golden values

# logp = [−1, −2, −0.25], logp_ref = [−1.5, −1, −0.25]  ⇒  d = logp − logp_ref = [0.5, −1, 0]
LOGP = torch.tensor([[-1.0, -2.0, -0.25]], dtype=F64)
REF = torch.tensor([[-1.5, -1.0, -0.25]], dtype=F64)


def test_k1_abs_k2_golden():
    assert_near(kl_k1(LOGP, REF), [[0.5, -1.0, 0.0]])
    assert_near(kl_abs(LOGP, REF), [[0.5, 1.0, 0.0]])
    assert_near(kl_k2(LOGP, REF), [[0.125, 0.5, 0.0]])  # ½·0.25, ½·1, 0


def test_k3_golden():
    # x = logp_ref − logp = [−0.5, 1, 0]
    # e^−0.5 − (−0.5) − 1 = 0.6065306597 − 0.5 = 0.1065306597;  e^1 − 1 − 1 = 0.7182818285;  e^0 − 0 − 1 = 0
    out = kl_k3(LOGP, REF)
    assert_near(out, [[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    assert_near(out, [[0.1065306597, 0.7182818285, 0.0]], atol=1e-10)


def test_k3_clamps():
    # d = 5:   x = −5,  e^−5 + 5 − 1 = 4.0067379470 (inside [−10, 10], unclamped)
    # d = −3:  x = 3,   e^3 − 3 − 1 = 16.0855369 → clamped to 10
    # d = 15:  x = −15, e^−15 + 15 − 1 = 14.0000003 → 10
    # d = 100: x = −100 → clamped to −20 first: e^−20 + 19 → 10;  d = −100: x = 20, e^20 − 21 → 10 (no overflow)
    logp = torch.tensor([[5.0, -3.0, 15.0, 100.0, -100.0]], dtype=F64)
    out = kl_k3(logp, torch.zeros_like(logp))
    assert_near(out, [[math.exp(-5.0) + 4.0, 10.0, 10.0, 10.0, 10.0]])
    # clamped tokens pass no gradient (∂/∂logp = 0); the unclamped one has 1 − e^x = 1 − e^−5
    logp = logp.clone().requires_grad_(True)
    kl_k3(logp, torch.zeros_like(logp)).sum().backward()
    assert_near(logp.grad, [[1.0 - math.exp(-5.0), 0.0, 0.0, 0.0, 0.0]])


def test_estimator_registry_names():
    assert KL_ESTIMATORS["k1"] is kl_k1 and KL_ESTIMATORS["kl"] is kl_k1
    assert KL_ESTIMATORS["k2"] is kl_k2 and KL_ESTIMATORS["mse"] is kl_k2
    assert KL_ESTIMATORS["k3"] is kl_k3 and KL_ESTIMATORS["low_var_kl"] is kl_k3
    assert KL_ESTIMATORS["abs"] is kl_abs


def _grads(fn, straight_through):
    logp = LOGP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    out = fn(logp, ref, straight_through=straight_through)
    out.sum().backward()
    return out.detach(), logp.grad, ref.grad


def test_plain_gradients_golden():
    d = torch.tensor([[0.5, -1.0, 0.0]], dtype=F64)
    # ∂k1/∂logp = 1, ∂k1/∂ref = −1
    _, g, gr = _grads(kl_k1, False)
    assert_near(g, torch.ones_like(d))
    assert_near(gr, -torch.ones_like(d))
    # ∂k2/∂logp = d
    _, g, gr = _grads(kl_k2, False)
    assert_near(g, d)
    assert_near(gr, -d)
    # ∂k3/∂logp = 1 − e^x with x = ref − logp = −d: [1 − e^−0.5, 1 − e, 0] = [0.3934693, −1.7182818, 0]
    _, g, gr = _grads(kl_k3, False)
    assert_near(g, [[1 - math.exp(-0.5), 1 - math.e, 0.0]])
    assert_near(gr, -g)
    # ∂|d|/∂logp = sign(d) = [1, −1, 0]
    _, g, _ = _grads(kl_abs, False)
    assert_near(g, [[1.0, -1.0, 0.0]])


@pytest.mark.parametrize("fn", ESTIMATORS, ids=lambda f: f.__name__)
def test_straight_through_value_of_base_gradient_of_k2(fn):
    base_value, _, _ = _grads(fn, False)
    value, g, gr = _grads(fn, True)
    assert torch.equal(value, base_value)  # value is exactly the base estimator's
    d = torch.tensor([[0.5, -1.0, 0.0]], dtype=F64)
    assert_near(g, d)  # gradient is ∇k2 = d·∇logp
    assert_near(gr, -d)


def test_straight_through_gradient_differs_from_plain_for_k1():
    # sanity that the straight-through path is really a different gradient (∇k1 = 1 ≠ d)
    _, g_plain, _ = _grads(kl_k1, False)
    _, g_st, _ = _grads(kl_k1, True)
    assert not torch.allclose(g_plain, g_st)


def test_kl_penalized_rewards_golden():
    # row 0: 3 valid tokens, outcome reward 1 at the last; row 1: 2 valid tokens, reward 2 at index 1; row 2 empty
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0], [3.0, 3.0, 3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    logp_old = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -0.3, NAN], [INF, NAN, -INF]], dtype=F64)
    logp_ref = torch.tensor([[-1.2, -0.5, -1.0], [-0.4, -0.1, -INF], [NAN, 0.0, 0.0]], dtype=F64)
    beta = 0.1
    # k1 = old − ref at valid tokens: row 0: [0.2, 0, −1]; row 1: [0.2, −0.2, ·]; row 2: none
    res = kl_penalized_rewards(r, logp_old, logp_ref, mask, kl_coef=beta)
    assert_near(res.kl, [[0.2, 0.0, -1.0], [0.2, -0.2, 0.0], [0.0, 0.0, 0.0]])
    # r − 0.1·k1: row 0: [−0.02, 0, 1.1]; row 1: [−0.02, 2.02, 0]; masked → 0
    assert_near(res.token_rewards, [[-0.02, 0.0, 1.1], [-0.02, 2.02, 0.0], [0.0, 0.0, 0.0]])
    # mean over rows of row means: row 0: (0.2 + 0 − 1)/3 = −0.26667; row 1: 0; row 2 (empty): 0 ⇒ −0.8/9 = −0.088889
    assert_near(res.mean_kl, -0.8 / 9.0)
    # with k2: kl = ½d²: row 0 [0.02, 0, 0.5], row 1 [0.02, 0.02]; mean_kl = ((0.52/3) + 0.02 + 0)/3 = 0.064444
    res2 = kl_penalized_rewards(r, logp_old, logp_ref, mask, kl_coef=beta, estimator=KL_ESTIMATORS["k2"])
    assert_near(res2.kl, [[0.02, 0.0, 0.5], [0.02, 0.02, 0.0], [0.0, 0.0, 0.0]])
    assert_near(res2.token_rewards, [[-0.002, 0.0, 0.95], [-0.002, 1.998, 0.0], [0.0, 0.0, 0.0]])
    assert_near(res2.mean_kl, (0.52 / 3 + 0.02) / 3)
    # β = 0 leaves the (masked) rewards untouched
    res0 = kl_penalized_rewards(r, logp_old, logp_ref, mask, kl_coef=0.0)
    assert_near(res0.token_rewards, torch.where(mask, r, torch.zeros((), dtype=F64)))


def test_adaptive_kl_coef_golden():
    # e = clip(0.11/0.1 − 1, ±0.2) = 0.1;  β = 0.2·(1 + 0.1·64/10000) = 0.2·1.00064 = 0.200128
    assert adaptive_kl_coef(0.2, 0.11, 64) == pytest.approx(0.200128, abs=1e-12)
    # e = 0.05/0.1 − 1 = −0.5 → clipped to −0.2;  β = 0.2·(1 − 0.2·64/10000) = 0.2·0.99872 = 0.199744
    assert adaptive_kl_coef(0.2, 0.05, 64) == pytest.approx(0.199744, abs=1e-12)
    # e = 10/0.1 − 1 = 99 → clipped to +0.2;  horizon 100, 50 steps: β = 1·(1 + 0.2·0.5) = 1.1
    assert adaptive_kl_coef(1.0, 10.0, 50, horizon=100) == pytest.approx(1.1, abs=1e-12)
    # KL = 0: e = −1 → −0.2;  β = 1·(1 − 0.2·50/100) = 0.9
    assert adaptive_kl_coef(1.0, 0.0, 50, horizon=100) == pytest.approx(0.9, abs=1e-12)
    # just inside the clip: KL/target − 1 = 0.15 (target 0.2, KL 0.23): β = 0.5·(1 + 0.15·10/100) = 0.5075
    assert adaptive_kl_coef(0.5, 0.23, 10, target_kl=0.2, horizon=100) == pytest.approx(0.5075, abs=1e-12)
    # at target the coefficient is unchanged; β = 0 stays 0
    assert adaptive_kl_coef(0.3, 0.1, 1000) == pytest.approx(0.3, abs=1e-15)
    assert adaptive_kl_coef(0.0, 5.0, 1000) == 0.0


# ---------------------------------------------------------------- (b) properties

pairs = shapes().flatmap(lambda s: st.tuples(tensors(*s, lo=-30.0, hi=5.0), tensors(*s, lo=-30.0, hi=5.0)))


@given(pairs)
def test_estimators_zero_at_equality(p):
    logp, _ = p
    for fn in ESTIMATORS:
        for stt in (False, True):
            assert torch.equal(fn(logp, logp.clone(), straight_through=stt), torch.zeros_like(logp)), fn.__name__


@given(pairs)
def test_estimator_signs_bounds_and_identities(p):
    logp, ref = p
    k1, k2, k3, ab = kl_k1(logp, ref), kl_k2(logp, ref), kl_k3(logp, ref), kl_abs(logp, ref)
    assert (k2 >= 0).all() and (k3 >= 0).all() and (ab >= 0).all()
    assert (k3 <= 10.0).all()
    torch.testing.assert_close(kl_k1(ref, logp), -k1, rtol=0, atol=0)  # antisymmetry
    torch.testing.assert_close(k2, 0.5 * k1.square(), rtol=0, atol=1e-12)
    torch.testing.assert_close(ab, k1.abs(), rtol=0, atol=0)
    # k3 agrees with the unclamped formula wherever the clamps are inactive
    x = ref - logp
    inside = (x.abs() <= 20) & (torch.exp(x) - x - 1 <= 10)
    torch.testing.assert_close(k3[inside], (torch.exp(x) - x - 1)[inside], rtol=1e-12, atol=1e-12)
    assert (k3[~inside] == 10.0).all()


def test_k3_accurate_near_zero_in_float32():
    # d = logp − ref = ∓1e-4 ⇒ x = ±1e-4, k3 = x²/2 + x³/6 + … = 5.0001667e-9 / 4.9998333e-9.
    # The naive e^x − x − 1 gives exactly 0 in float32 here (1 + 1e-4 absorbs the x² term); expm1(x) − x does not.
    logp = torch.tensor([[-1e-4, 1e-4, 1e-3]], dtype=torch.float32)
    out = kl_k3(logp, torch.zeros_like(logp)).double()
    expected = torch.tensor([[5.0001667e-9, 4.9998333e-9, 4.9983342e-7]], dtype=F64)  # x³/6 sign flips with x
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=0)


@given(shapes().flatmap(lambda s: tensors(*s, lo=-1e-3, hi=1e-3)))
def test_k3_close_to_k2_for_small_log_ratios(d):
    # k3 = ½d² − d³/6 + O(d⁴): |k3 − k2| ≤ |d|³/6 + d⁴ ≤ 2e-10 for |d| ≤ 1e-3
    ref = torch.zeros_like(d)
    assert ((kl_k3(d, ref) - kl_k2(d, ref)).abs() <= d.abs() ** 3 / 6 + d ** 4 + 1e-15).all()


@given(st.data())
def test_kl_penalized_rewards_mask_hygiene(data):
    b, t = data.draw(shapes())
    mask = data.draw(masks(b, t))
    r, old, ref = (data.draw(tensors(b, t)) for _ in range(3))
    junk = st.sampled_from([NAN, INF, -INF, 123.0])
    dirty = [torch.where(mask, x, torch.tensor(data.draw(st.lists(junk, min_size=b * t, max_size=b * t)),
                                                dtype=F64).reshape(b, t)) for x in (r, old, ref)]
    beta = data.draw(st.floats(0.0, 2.0))
    name = data.draw(st.sampled_from(sorted(KL_ESTIMATORS)))
    clean = kl_penalized_rewards(r, old, ref, mask, kl_coef=beta, estimator=KL_ESTIMATORS[name])
    got = kl_penalized_rewards(*dirty, mask, kl_coef=beta, estimator=KL_ESTIMATORS[name])
    for a, c in zip(got, clean):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    zeros = torch.zeros(int((~mask).sum()), dtype=F64)
    assert torch.equal(got.token_rewards[~mask], zeros) and torch.equal(got.kl[~mask], zeros)
    # and the valid entries are exactly r − β·estimator
    est = KL_ESTIMATORS[name](old, ref)
    torch.testing.assert_close(got.token_rewards[mask], (r - beta * est)[mask], rtol=0, atol=1e-12)


@given(st.floats(0.0, 1.0), st.floats(0.0, 10.0), st.integers(0, 5000), st.floats(1e-3, 1.0),
       st.integers(1, 100_000))
def test_adaptive_kl_coef_bounded_step(beta, kl, n, target, horizon):
    new = adaptive_kl_coef(beta, kl, n, target_kl=target, horizon=horizon)
    e = min(max(kl / target - 1.0, -0.2), 0.2)
    assert new == pytest.approx(beta * (1 + e * n / horizon), rel=1e-12, abs=1e-15)
    # the relative change never exceeds 0.2·n/horizon, and the direction follows the sign of KL − target
    assert abs(new - beta) <= 0.2 * beta * n / horizon * (1 + 1e-12) + 1e-15
    if kl > target:
        assert new >= beta
    elif kl < target:
        assert new <= beta


# ---------------------------------------------------------------- (d) bad input


@pytest.mark.parametrize("fn", ESTIMATORS, ids=lambda f: f.__name__)
def test_estimators_bad_shapes(fn):
    x = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match=rf"{fn.__name__}: logp must be a per-token tensor \[B, T\], got shape \[3\]"):
        fn(torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match=rf"{fn.__name__}: logp_ref has shape \[2, 2\] but must match \[2, 3\]"):
        fn(x, torch.zeros(2, 2, dtype=F64))
    with pytest.raises(ValueError, match=rf"{fn.__name__}: logp_ref must be floating point"):
        fn(x, torch.zeros(2, 3, dtype=torch.int64))


def _kl_args(b=2, t=3):
    z = torch.zeros(b, t, dtype=F64)
    return dict(token_rewards=z.clone(), logp_old=z.clone(), logp_ref=z.clone(),
                response_mask=torch.ones(b, t, dtype=torch.bool))


@pytest.mark.parametrize("change, match", [
    (dict(token_rewards=torch.zeros(2, dtype=F64)), r"token_rewards must be a per-token tensor \[B, T\]"),
    (dict(logp_old=torch.zeros(2, 4, dtype=F64)), r"logp_old has shape \[2, 4\]"),
    (dict(logp_ref=torch.zeros(3, 3, dtype=F64)), r"logp_ref has shape \[3, 3\]"),
    (dict(response_mask=torch.ones(2, dtype=torch.bool)), r"response_mask has shape \[2\]"),
    (dict(response_mask=torch.full((2, 3), 2.0)), r"response_mask must hold only 0 and 1"),
    (dict(logp_old=torch.tensor([[0.0, NAN, 0.0], [0.0, 0.0, 0.0]], dtype=F64)), r"logp_old holds 1 non-finite"),
    (dict(logp_ref=torch.tensor([[0.0, 0.0, 0.0], [-INF, 0.0, 0.0]], dtype=F64)), r"logp_ref holds 1 non-finite"),
    (dict(token_rewards=torch.tensor([[INF, 0.0, 0.0], [0.0, 0.0, NAN]], dtype=F64)),
     r"token_rewards holds 2 non-finite"),
    (dict(kl_coef=-0.1), r"kl_coef must be >= 0"),
    (dict(kl_coef=NAN), r"kl_coef must be >= 0"),
])
def test_kl_penalized_rewards_bad_input(change, match):
    kwargs = dict(_kl_args(), kl_coef=0.1)
    kwargs.update(change)
    with pytest.raises(ValueError, match="kl_penalized_rewards: " + match):
        kl_penalized_rewards(**kwargs)


def test_kl_penalized_rewards_empty_batch():
    with pytest.raises(ValueError, match=r"kl_penalized_rewards: response_mask is empty \(B=0\)"):
        kl_penalized_rewards(**_kl_args(b=0), kl_coef=0.1)


def test_kl_penalized_rewards_01_float_mask_equals_bool():
    args = _kl_args()
    args["token_rewards"] = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    args["logp_old"] = torch.tensor([[0.5, 0.0, -1.0], [0.1, 0.2, 0.3]], dtype=F64)
    m = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    a = kl_penalized_rewards(**{**args, "response_mask": m}, kl_coef=0.5)
    f = kl_penalized_rewards(**{**args, "response_mask": m.to(F64)}, kl_coef=0.5)
    for x, y in zip(a, f):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kl_coef=0.1, current_kl=NAN, n_steps=1), r"current_kl must be finite"),
    (dict(kl_coef=0.1, current_kl=INF, n_steps=1), r"current_kl must be finite"),
    (dict(kl_coef=0.1, current_kl=0.1, n_steps=1, target_kl=0.0), r"target_kl must be > 0"),
    (dict(kl_coef=0.1, current_kl=0.1, n_steps=1, horizon=0), r"horizon must be > 0"),
    (dict(kl_coef=-1.0, current_kl=0.1, n_steps=1), r"kl_coef must be >= 0"),
])
def test_adaptive_kl_coef_bad_input(kwargs, match):
    with pytest.raises(ValueError, match="adaptive_kl_coef: " + match):
        adaptive_kl_coef(**kwargs)
