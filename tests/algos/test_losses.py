"""Tests of `asyncrl.algos.losses`: agg_loss, PPO clip (asymmetric + dual), GSPO, CISPO, REINFORCE, value loss.

Golden values are worked out by hand in the comments; property tests use hypothesis (tests/strategies.py).
Reference: /work/shared/reference/algos.md §1.1, §3, §6, §9.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from asyncrl.algos.losses import (
    LOSS_AGG_MODES, agg_loss, cispo_loss, gspo_loss, ppo_clip_loss, reinforce_loss, value_loss,
)
from tests.strategies import masks, shapes, tensors

F64 = torch.float64
NAN, INF = math.nan, math.inf


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def assert_near(a, b, atol=1e-12, rtol=1e-10):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=atol, rtol=rtol)


def _garbage(b: int, t: int):
    """[b, t] float64 values that must never be read: NaN, ±inf, huge, or ordinary numbers."""
    item = st.one_of(st.sampled_from([NAN, INF, -INF, 1e30, -1e30]), st.floats(-50, 50))
    return st.lists(item, min_size=b * t, max_size=b * t).map(lambda xs: _t(xs).reshape(b, t))


MODES = st.sampled_from(LOSS_AGG_MODES)
# tests parametrized over 4–5 loss kinds run half the profile's examples each, to keep the file fast
_HALF_EXAMPLES = settings(max_examples=max(10, settings().max_examples // 2))


# ---------------------------------------------------------------------------------------------------------------
# (a) golden values
# ---------------------------------------------------------------------------------------------------------------

# L = [[1, 2, 3], [4, 5, 6]], mask = [[1, 1, 1], [1, 0, 0]] (row 1 is short: n = (3, 1), N = 4).
# Masked slots hold NaN / inf: they must never be read.
_L = [[1.0, 2.0, 3.0], [4.0, NAN, INF]]
_M = [[True, True, True], [True, False, False]]


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("token-mean", {}, 10.0 / 4),                               # (1+2+3+4)/N=4 = 2.5
    ("seq-mean-token-sum", {}, (6.0 + 4.0) / 2),                # (6 + 4)/S=2 = 5
    ("seq-mean-token-mean", {}, (6.0 / 3 + 4.0 / 1) / 2),       # (2 + 4)/2 = 3
    ("seq-mean-token-sum-norm", {}, 10.0 / (2 * 3)),            # 10/(B=2 · T=3) = 5/3
    ("seq-mean-token-sum-norm", {"norm_length": 5}, 10.0 / (2 * 5)),  # 10/(2·5) = 1
    ("token-mean", {"num_tokens": 8}, 10.0 / 8),                # global N overrides: 1.25
    ("seq-mean-token-sum", {"num_seqs": 4}, 10.0 / 4),          # global S overrides: 2.5
    ("seq-mean-token-mean", {"num_seqs": 4}, 6.0 / 4),          # (2 + 4)/4 = 1.5
    ("seq-mean-token-sum-norm", {"num_seqs": 4}, 10.0 / (4 * 3)),  # 10/12
])
def test_agg_loss_golden(mode, kwargs, expected):
    out = agg_loss(_t(_L), torch.tensor(_M), mode, **kwargs)
    assert_near(out, expected)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 10.0 / 4),                   # the empty row adds no token
    ("seq-mean-token-sum", 10.0 / 2),           # the empty row is excluded from S
    ("seq-mean-token-mean", 3.0),               # (2 + 4)/2, empty row skipped
    ("seq-mean-token-sum-norm", 10.0 / (3 * 3)),  # Dr.GRPO: the empty row is counted in B = 3
])
def test_agg_loss_golden_with_empty_row(mode, expected):
    loss = _t(_L + [[NAN, NAN, 7.0]])
    mask = torch.tensor(_M + [[False, False, False]])
    assert_near(agg_loss(loss, mask, mode), expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_all_masked_batch_is_zero_not_nan(mode):
    out = agg_loss(_t([[NAN, INF], [1.0, -INF]]), torch.zeros(2, 2, dtype=torch.bool), mode)
    assert out.item() == 0.0


def test_agg_loss_accepts_float_01_mask():
    out = agg_loss(_t(_L), _t([[1, 1, 1], [1, 0, 0]]), "seq-mean-token-mean")
    assert_near(out, 3.0)


def _ppo_golden_inputs():
    # r = [1.1, 1.5, 0.5, 4.0, 2.0, 0.5] and a 7th masked token with NaN everywhere; logp_old = -1.
    r = [1.1, 1.5, 0.5, 4.0, 2.0, 0.5]
    adv = [1.0, 2.0, -1.0, -0.5, -1.0, 1.0]
    logp_old = _t([[-1.0] * 6 + [NAN]])
    logp = _t([[-1.0 + math.log(x) for x in r] + [NAN]]).requires_grad_()
    mask = torch.tensor([[True] * 6 + [False]])
    return logp, logp_old, _t([adv + [NAN]]), mask, r


def test_ppo_golden_asymmetric_dual_clip():
    # ε_low = 0.2, ε_high = 0.28, c = 3. Per token L = max(−A·r, −A·clip(r, 0.8, 1.28)), then min(L, −A·c) if A < 0:
    #  t0 A= 1,   r=1.1 : unclipped              max(−1.1, −1.1)          = −1.1
    #  t1 A= 2,   r=1.5 : clipped high          max(−3.0, −2·1.28=−2.56)  = −2.56
    #  t2 A=−1,   r=0.5 : clipped low           max(0.5, 0.8) = 0.8, min(0.8, 3) = 0.8
    #  t3 A=−0.5, r=4   : dual clip             max(2, 0.64) = 2,  min(2, 0.5·3 = 1.5) = 1.5
    #  t4 A=−1,   r=2   : A<0 above 1+ε_high, below c: max(2, 1.28) = 2, min(2, 3) = 2
    #  t5 A= 1,   r=0.5 : A>0 below 1−ε_low     max(−0.5, −0.8)           = −0.5
    # Σ = −1.1 − 2.56 + 0.8 + 1.5 + 2 − 0.5 = 0.14, N = 6.
    logp, logp_old, adv, mask, r = _ppo_golden_inputs()
    out = ppo_clip_loss(logp, logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    assert_near(out.loss, 0.14 / 6)
    assert_near(out.clipfrac, 2 / 6)        # t1, t2 (the dual-clipped t3 has L2 < L1, so it is not "clipped")
    assert_near(out.clipfrac_lower, 1 / 6)  # t3
    assert_near(out.ppo_kl, -math.log(1.1 * 1.5 * 0.5 * 4.0 * 2.0 * 0.5) / 6)  # mean(−log r) = −log(3.3)/6
    assert out.num_tokens.item() == 6
    out.loss.backward()
    # ∂/∂logp: −A·r/N on unclipped tokens (t0, t4, t5), 0 on clipped (t1, t2) and dual-clipped (t3) and masked.
    assert_near(logp.grad, _t([[-1.1 / 6, 0.0, 0.0, 0.0, 2.0 / 6, -0.5 / 6, 0.0]]))
    # seq-mean-token-sum on the single row: Σ = 0.14 (S = 1)
    out2 = ppo_clip_loss(logp, logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         loss_agg_mode="seq-mean-token-sum")
    assert_near(out2.loss, 0.14)


def test_ppo_golden_symmetric_no_dual_clip():
    # ε = 0.2 both sides, no dual clip: t1 → max(−3, −2.4) = −2.4; t3 → max(2, 0.5·1.2) = 2 (no cap);
    # others as above: Σ = −1.1 − 2.4 + 0.8 + 2 + 2 − 0.5 = 0.8.
    logp, logp_old, adv, mask, _ = _ppo_golden_inputs()
    out = ppo_clip_loss(logp, logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None)
    assert_near(out.loss, 0.8 / 6)
    assert_near(out.clipfrac, 2 / 6)
    assert out.clipfrac_lower.item() == 0.0
    out.loss.backward()
    # the formerly dual-clipped t3 now has gradient −A·r/N = 0.5·4/6
    assert_near(logp.grad, _t([[-1.1 / 6, 0.0, 0.0, 2.0 / 6, 2.0 / 6, -0.5 / 6, 0.0]]))


def test_ppo_golden_is_weights():
    # is_weights multiply the per-token loss: w = [2, 1, 1, 1, 1, 0] → Σ = −2.2 − 2.56 + 0.8 + 1.5 + 2 + 0 = −0.46
    logp, logp_old, adv, mask, _ = _ppo_golden_inputs()
    w = _t([[2.0, 1.0, 1.0, 1.0, 1.0, 0.0, NAN]])
    out = ppo_clip_loss(logp, logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, is_weights=w)
    assert_near(out.loss, -0.46 / 6)


def test_gspo_golden_two_rows():
    # row 0: log-ratios d = [0.1, −0.2, 0.4] → mean 0.1 → s0 = e^0.1 ≈ 1.10517; A = [1, 2, 0.5]
    # row 1: d = [−0.3, −0.1] + 1 masked → mean −0.2 → s1 = e^−0.2 ≈ 0.81873; A = [−2, −2]
    # ε_low = 0.1, ε_high = 0.2 → clip range [0.9, 1.2].
    # row 0: s0 inside → L_t = −A_t·s0; row mean = −s0·3.5/3.
    # row 1: A<0, s1 < 0.9 → clipped: L = max(2·0.81873, 2·0.9) = 1.8 on both tokens; row mean 1.8.
    # loss (seq-mean-token-mean) = (−s0·3.5/3 + 1.8)/2
    s0 = math.exp(0.1)
    logp_old = _t([[-1.0, -2.0, -0.5], [-1.5, -0.7, NAN]])
    d = _t([[0.1, -0.2, 0.4], [-0.3, -0.1, 0.0]])
    logp = (logp_old.nan_to_num(0.0) + d).detach().requires_grad_()
    adv = _t([[1.0, 2.0, 0.5], [-2.0, -2.0, NAN]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = gspo_loss(logp, logp_old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.2)
    assert_near(out.loss, (-s0 * 3.5 / 3 + 1.8) / 2)
    assert_near(out.clipfrac, 2 / 5)
    assert out.clipfrac_lower.item() == 0.0
    assert_near(out.ppo_kl, -(0.1 - 0.2 + 0.4 - 0.3 - 0.1) / 5)  # token-level mean(−d) = 0.02
    out.loss.backward()
    # GSPO-token: ∂s_{i,t}/∂logp_t = s_i (not s_i/n_i): grad = −A_t·s0/(S=2 · n0=3); clipped row 1 → 0.
    assert_near(logp.grad, _t([[-1.0 * s0 / 6, -2.0 * s0 / 6, -0.5 * s0 / 6], [0.0, 0.0, 0.0]]))


def test_cispo_golden_value_depends_on_logp():
    # logp = [−0.5, −1, −2], r = [1, 1.5, 0.5], A = [1, −1, 2], ε_high = 0.2, no lower bound:
    # r̂ = [1, 1.2, 0.5]; L = −r̂·A·logp = [0.5, −1.2, 2.0]; Σ = 1.3; N = 3.
    logp = _t([[-0.5, -1.0, -2.0, NAN]]).requires_grad_()
    logp_old = _t([[-0.5, -1.0 - math.log(1.5), -2.0 - math.log(0.5), NAN]])
    adv = _t([[1.0, -1.0, 2.0, INF]])
    mask = torch.tensor([[True, True, True, False]])
    out = cispo_loss(logp, logp_old, adv, mask, clip_ratio_high=0.2)
    assert_near(out.loss, 1.3 / 3)
    assert_near(out.clipfrac, 1 / 3)
    assert_near(out.ppo_kl, (-math.log(1.5) - math.log(0.5)) / 3)
    out.loss.backward()
    # every valid token keeps gradient −r̂·A/N (clipped t1 too)
    assert_near(logp.grad, _t([[-1.0 / 3, 1.2 / 3, -1.0 / 3, 0.0]]))
    # with ε_low = 0.2: r̂_2 = 0.8 → L_2 = −0.8·2·(−2) = 3.2; Σ = 0.5 − 1.2 + 3.2 = 2.5
    out_low = cispo_loss(logp, logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert_near(out_low.loss, 2.5 / 3)
    assert_near(out_low.clipfrac, 2 / 3)
    # shifting logp and logp_old by +1 keeps r, changes the value by −Σ r̂·A/N = −(1 − 1.2 + 1)/3
    shifted = cispo_loss(logp.detach() + 1.0, logp_old + 1.0, adv, mask, clip_ratio_high=0.2)
    assert_near(shifted.loss, 1.3 / 3 - 0.8 / 3)


def test_reinforce_golden():
    # L = −A·w·logp: row0 [−(1)(1)(−1) = 1, −(−1)(0.5)(−2) = −1], row1 [−(2)(2)(−0.5) = 2]
    logp = _t([[-1.0, -2.0, NAN], [-0.5, NAN, -INF]]).requires_grad_()
    adv = _t([[1.0, -1.0, NAN], [2.0, INF, 0.0]])
    w = _t([[1.0, 0.5, NAN], [2.0, NAN, NAN]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = reinforce_loss(logp, adv, mask, is_weights=w)
    assert_near(out.loss, 2.0 / 3)                                    # (1 − 1 + 2)/N=3
    assert out.clipfrac.item() == 0.0 and out.ppo_kl.item() == 0.0 and out.clipfrac_lower.item() == 0.0
    out.loss.backward()
    assert_near(logp.grad, _t([[-1.0 / 3, 0.5 / 3, 0.0], [-4.0 / 3, 0.0, 0.0]]))  # −A·w/N
    seq = reinforce_loss(logp, adv, mask, is_weights=w, loss_agg_mode="seq-mean-token-sum")
    assert_near(seq.loss, (0.0 + 2.0) / 2)                            # rows (1 − 1) and 2, S = 2


def _value_golden_inputs():
    # clip_range 0.5; V_clip = V_old + clip(V − V_old, ±0.5)
    #  t0 V=1, V_old=0.8, R=1.5: V_clip=1.0, errs (0.25, 0.25) → 0.25, not clipped
    #  t1 V=2, V_old=1.0, R=2.5: V_clip=1.5, errs (0.25, 1.0)  → 1.0,  clipped branch larger
    #  t2 V=0, V_old=0,   R=1  : V_clip=0,   errs (1, 1)       → 1
    #  t3 V=3, V_old=3.2, R=3  : V_clip=3,   errs (0, 0)       → 0
    #  t4 V=2, V_old=0,   R=0  : V_clip=0.5, errs (4, 0.25)    → 4,    unclipped larger (not counted)
    #  t5 masked, NaN
    values = _t([[1.0, 2.0, 0.0, 3.0, 2.0, NAN]]).requires_grad_()
    values_old = _t([[0.8, 1.0, 0.0, 3.2, 0.0, NAN]])
    returns = _t([[1.5, 2.5, 1.0, 3.0, 0.0, INF]])
    mask = torch.tensor([[True] * 5 + [False]])
    return values, values_old, returns, mask


def test_value_loss_golden_clipped():
    values, values_old, returns, mask = _value_golden_inputs()
    out = value_loss(values, values_old, returns, mask, clip_range=0.5)
    assert_near(out.loss, 0.5 * (0.25 + 1.0 + 1.0 + 0.0 + 4.0) / 5)  # ½·6.25/5 = 0.625
    assert_near(out.clipfrac, 1 / 5)
    out.loss.backward()
    # ½·∂(V − R)²/∂V / N = (V − R)/5 where the unclipped branch is active; 0 on t1 (V_clip is constant there)
    assert_near(values.grad, _t([[-0.5 / 5, 0.0, -1.0 / 5, 0.0, 2.0 / 5, 0.0]]))


@settings(max_examples=40)
@given(st.sampled_from([torch.float32, torch.float64]), st.integers(0, 2**31 - 1))
def test_value_clipfrac_counts_only_clipped_tokens(dtype, seed):
    # every |V − V_old| < 0.98 is strictly inside the clip range 1: nothing is clipped, whatever the rounding
    # (rebuilding V as V_old + (V − V_old), which is not always V, once counted 2–4 % of such tokens as clipped)
    gen = torch.Generator().manual_seed(seed)
    values_old = (torch.rand(8, 64, generator=gen, dtype=torch.float64) * 0.98 - 0.49).to(dtype)
    values = (torch.rand(8, 64, generator=gen, dtype=torch.float64) * 0.98 - 0.49).to(dtype)
    returns = (torch.randn(8, 64, generator=gen, dtype=torch.float64) * 2).to(dtype)
    mask = torch.ones(8, 64, dtype=torch.bool)
    out = value_loss(values, values_old, returns, mask, clip_range=1.0)
    assert out.clipfrac.item() == 0.0
    assert out.loss.item() == value_loss(values, values_old, returns, mask, clip_range=None).loss.item()
    # and a token that moved 2 towards a target 10 away is clipped (its clipped error is larger): 1 of 512
    far, target = values.clone(), returns.clone()
    far[0, 0], target[0, 0] = values_old[0, 0] + 2.0, values_old[0, 0] + 10.0
    assert value_loss(far, values_old, target, mask, clip_range=1.0).clipfrac.item() == 1 / 512


def test_value_loss_golden_unclipped():
    values, values_old, returns, mask = _value_golden_inputs()
    out = value_loss(values, values_old, returns, mask, clip_range=None)
    assert_near(out.loss, 0.5 * (0.25 + 0.25 + 1.0 + 0.0 + 4.0) / 5)  # ½·5.5/5 = 0.55
    assert out.clipfrac.item() == 0.0
    out.loss.backward()
    assert_near(values.grad, _t([[-0.5 / 5, -0.5 / 5, -1.0 / 5, 0.0, 2.0 / 5, 0.0]]))


# ---------------------------------------------------------------------------------------------------------------
# (b) properties
# ---------------------------------------------------------------------------------------------------------------

@st.composite
def policy_batch(draw, max_b=5, max_t=6, min_b=1, nonempty_rows=False, lr=3.0):
    b, t = draw(shapes(max_b=max_b, max_t=max_t, min_b=min_b))
    mask = draw(masks(b, t, nonempty_rows=nonempty_rows))
    logp_old = draw(tensors(b, t, lo=-5.0, hi=0.0))
    d = draw(tensors(b, t, lo=-lr, hi=lr))
    adv = draw(tensors(b, t))
    return mask, logp_old + d, logp_old, adv


def _call(kind, logp, logp_old, adv, mask, mode="token-mean", w=None, **kw):
    if kind == "ppo":
        return ppo_clip_loss(logp, logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                             loss_agg_mode=mode, is_weights=w, **kw)
    if kind == "gspo":
        return gspo_loss(logp, logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, is_weights=w, **kw)
    if kind == "cispo":
        return cispo_loss(logp, logp_old, adv, mask, clip_ratio_high=0.28, loss_agg_mode=mode, is_weights=w, **kw)
    if kind == "reinforce":
        return reinforce_loss(logp, adv, mask, loss_agg_mode=mode, is_weights=w, **kw)
    if kind == "value":
        assert w is None
        return value_loss(logp, logp_old, adv, mask, clip_range=0.5, loss_agg_mode=mode, **kw)
    raise AssertionError(kind)


KINDS = ["ppo", "gspo", "cispo", "reinforce", "value"]


@pytest.mark.parametrize("kind", KINDS)
@_HALF_EXAMPLES
@given(data=st.data())
def test_masked_garbage_never_changes_loss_or_gradient(kind, data):
    mask, logp, logp_old, adv = data.draw(policy_batch())
    b, t = mask.shape
    mode = data.draw(MODES)
    w = data.draw(tensors(b, t, lo=0.0, hi=2.0)) if kind != "value" else None

    def run(fill):
        g = {name: data.draw(_garbage(b, t)) for name in ("logp", "logp_old", "adv", "w")} if fill else {}
        pick = (lambda x, name: torch.where(mask, x, g[name])) if fill else (lambda x, name: torch.where(mask, x, 0.0))
        lp = pick(logp, "logp").requires_grad_()
        ww = None if w is None else pick(w, "w")
        out = _call(kind, lp, pick(logp_old, "logp_old"), pick(adv, "adv"), mask, mode, ww)
        out.loss.backward()
        return out, lp.grad

    clean, g_clean = run(False)
    dirty, g_dirty = run(True)
    assert torch.isfinite(dirty.loss)
    for a, b_ in zip(clean, dirty):
        assert_near(b_, a)
    assert torch.isfinite(g_dirty).all()
    assert_near(g_dirty, g_clean)
    assert (g_dirty[~mask] == 0).all()


@pytest.mark.parametrize("kind", KINDS)
@_HALF_EXAMPLES
@given(data=st.data())
def test_row_permutation_leaves_scalar_loss_unchanged(kind, data):
    mask, logp, logp_old, adv = data.draw(policy_batch())
    perm = torch.tensor(data.draw(st.permutations(range(mask.shape[0]))))
    mode = data.draw(MODES)
    a = _call(kind, logp, logp_old, adv, mask, mode)
    b = _call(kind, logp[perm], logp_old[perm], adv[perm], mask[perm], mode)
    for x, y in zip(a, b):
        assert_near(y, x)


@given(data=st.data())
def test_ppo_ratio_one_gives_minus_agg_advantage(data):
    mask, _, logp_old, adv = data.draw(policy_batch())
    mode = data.draw(MODES)
    c = data.draw(st.one_of(st.none(), st.floats(1.01, 10.0)))
    out = ppo_clip_loss(logp_old.clone(), logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                        clip_ratio_c=c, loss_agg_mode=mode)
    assert_near(out.loss, agg_loss(-adv, mask, mode))
    assert out.clipfrac.item() == 0.0
    assert out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == 0.0


@given(data=st.data())
def test_ppo_gradient_zero_on_clipped_tokens_and_minus_a_r_over_n_elsewhere(data):
    mask, logp, logp_old, adv = data.draw(policy_batch(max_b=4, max_t=6))
    eps_low = data.draw(st.floats(0.05, 0.5))
    eps_high = data.draw(st.floats(0.05, 0.5))
    c = data.draw(st.one_of(st.none(), st.floats(1.6, 5.0)))
    logp = logp.detach().requires_grad_()
    out = ppo_clip_loss(logp, logp_old, adv, mask, clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=c)
    out.loss.backward()
    n = max(int(mask.sum()), 1)
    expected = torch.zeros_like(adv)
    n_clipped = n_dual = 0
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if not mask[i, j]:
                continue
            a = adv[i, j].item()
            r = math.exp(logp[i, j].item() - logp_old[i, j].item())
            for edge in (1 - eps_low, 1 + eps_high) + ((c,) if c is not None else ()):
                assume(abs(r - edge) > 1e-9)
                # clipfrac compares the two branches' losses (verl's definition): an advantage so small that
                # A·r and A·edge round to the same float (a subnormal A) leaves the comparison a tie
                assume(a == 0 or a * r != a * edge)
            high = a > 0 and r > 1 + eps_high
            low = a < 0 and r < 1 - eps_low
            dual = c is not None and a < 0 and r > c
            n_clipped += high or low
            n_dual += dual
            expected[i, j] = 0.0 if (high or low or dual) else -a * r / n
    assert_near(logp.grad, expected)
    assert_near(out.clipfrac, n_clipped / n)
    assert_near(out.clipfrac_lower, n_dual / n)


@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo", "reinforce"])
@_HALF_EXAMPLES
@given(data=st.data())
def test_zero_advantages_give_zero_loss_and_gradient(kind, data):
    mask, logp, logp_old, adv = data.draw(policy_batch())
    mode = data.draw(MODES)
    logp = logp.detach().requires_grad_()
    out = _call(kind, logp, logp_old, torch.zeros_like(adv), mask, mode)
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert (logp.grad == 0).all()


@given(data=st.data())
def test_ppo_equal_eps_recovers_symmetric_ppo(data):
    mask, logp, logp_old, adv = data.draw(policy_batch())
    eps = data.draw(st.floats(0.01, 0.9))
    logp = logp.detach().requires_grad_()
    out = ppo_clip_loss(logp, logp_old, adv, mask, clip_ratio_low=eps, clip_ratio_high=eps, clip_ratio_c=None)
    out.loss.backward()
    # textbook symmetric PPO: −min(r·A, clip(r, 1 − ε, 1 + ε)·A), token-mean
    ref_logp = logp.detach().clone().requires_grad_()
    r = torch.exp(torch.where(mask, ref_logp - logp_old, 0.0))
    a = torch.where(mask, adv, 0.0)
    per = -torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps) * a)
    ref = torch.where(mask, per, 0.0).sum() / max(int(mask.sum()), 1)
    ref.backward()
    assert_near(out.loss, ref)
    assert_near(logp.grad, ref_logp.grad)


@given(data=st.data())
def test_ppo_no_dual_clip_equals_huge_c(data):
    mask, logp, logp_old, adv = data.draw(policy_batch())
    mode = data.draw(MODES)
    outs, grads = [], []
    for c in (None, 1e12):
        lp = logp.detach().clone().requires_grad_()
        out = ppo_clip_loss(lp, logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=c,
                            loss_agg_mode=mode)
        out.loss.backward()
        outs.append(out)
        grads.append(lp.grad)
    for x, y in zip(*outs):
        assert_near(y, x)
    assert_near(grads[1], grads[0])


@given(data=st.data())
def test_ppo_per_token_bounds(data):
    # per-token loss (one valid token at a time): L ≤ c·|A| for A < 0, L ≥ −A·(1 + ε_high) for A > 0
    mask, logp, logp_old, adv = data.draw(policy_batch(max_b=3, max_t=4, lr=4.0))
    c = data.draw(st.floats(1.1, 5.0))
    eps_high = data.draw(st.floats(0.0, 0.5))
    for i, j in mask.nonzero().tolist():
        single = torch.zeros_like(mask)
        single[i, j] = True
        per = ppo_clip_loss(logp, logp_old, adv, single, clip_ratio_high=eps_high, clip_ratio_c=c).loss.item()
        a = adv[i, j].item()
        if a < 0:
            assert per <= c * abs(a) * (1 + 1e-12)
        elif a > 0:
            assert per >= -a * (1 + eps_high) * (1 + 1e-12)
        else:
            assert per == 0.0


@given(data=st.data())
def test_gspo_equals_ppo_on_one_token_sequences(data):
    b, t = data.draw(shapes(max_b=5, max_t=4))
    cols = data.draw(st.lists(st.integers(0, t - 1), min_size=b, max_size=b))
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[torch.arange(b), torch.tensor(cols)] = True
    logp_old = data.draw(tensors(b, t, lo=-5.0, hi=0.0))
    logp = logp_old + data.draw(tensors(b, t))
    adv = data.draw(tensors(b, t))
    eps_low, eps_high = data.draw(st.floats(0.0, 0.9)), data.draw(st.floats(0.0, 2.0))
    lp_g, lp_p = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    g = gspo_loss(lp_g, logp_old, adv, mask, clip_ratio_low=eps_low, clip_ratio_high=eps_high)
    p = ppo_clip_loss(lp_p, logp_old, adv, mask, clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=None)
    g.loss.backward()
    p.loss.backward()
    assert_near(g.loss, p.loss)
    assert_near(g.clipfrac, p.clipfrac)
    assert_near(g.ppo_kl, p.ppo_kl)
    assert_near(lp_g.grad, lp_p.grad)


@given(data=st.data())
def test_gspo_invariant_to_padding_length(data):
    mask, logp, logp_old, adv = data.draw(policy_batch())
    b, t = mask.shape
    extra = data.draw(st.integers(1, 4))
    def pad(x):  # append `extra` masked columns of garbage
        return torch.cat([x, data.draw(_garbage(b, extra))], dim=1)

    mask2 = torch.cat([mask, torch.zeros(b, extra, dtype=torch.bool)], dim=1)
    lp1 = logp.clone().requires_grad_()
    lp2 = pad(logp).requires_grad_()
    o1 = gspo_loss(lp1, logp_old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    o2 = gspo_loss(lp2, pad(logp_old), pad(adv), mask2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    o1.loss.backward()
    o2.loss.backward()
    for x, y in zip(o1, o2):
        assert_near(y, x)
    assert_near(lp2.grad[:, :t], lp1.grad)
    assert (lp2.grad[:, t:] == 0).all()


@given(data=st.data())
def test_gspo_token_gradient_is_seq_ratio(data):
    # with a clip range that is never hit, ∂loss/∂logp_t = −A_t·s_i/(S·n_i), s_i = exp(mean_t d)
    mask, logp, logp_old, adv = data.draw(policy_batch(lr=1.0))
    lp = logp.clone().requires_grad_()
    out = gspo_loss(lp, logp_old, adv, mask, clip_ratio_low=0.95, clip_ratio_high=100.0)
    out.loss.backward()
    assert out.clipfrac.item() == 0.0
    n = mask.sum(-1)
    s_rows = (n > 0).sum().clamp(min=1)
    expected = torch.zeros_like(adv)
    for i in range(mask.shape[0]):
        if n[i] == 0:
            continue
        d = [(logp[i, j] - logp_old[i, j]).item() for j in range(mask.shape[1]) if mask[i, j]]
        s = math.exp(sum(d) / len(d))
        for j in range(mask.shape[1]):
            if mask[i, j]:
                expected[i, j] = -adv[i, j].item() * s / (s_rows.item() * n[i].item())
    assert_near(lp.grad, expected)


@given(data=st.data())
def test_cispo_gradient_is_clipped_weight_times_advantage(data):
    mask, logp, logp_old, adv = data.draw(policy_batch())
    eps_low = data.draw(st.one_of(st.none(), st.floats(0.0, 0.9)))
    eps_high = data.draw(st.floats(0.0, 1.0))
    lp = logp.clone().requires_grad_()
    out = cispo_loss(lp, logp_old, adv, mask, clip_ratio_low=eps_low, clip_ratio_high=eps_high)
    out.loss.backward()
    r = torch.exp(logp - logp_old)
    r_hat = r.clamp(0.0 if eps_low is None else 1 - eps_low, 1 + eps_high)
    n = max(int(mask.sum()), 1)
    assert_near(lp.grad, torch.where(mask, -r_hat * adv / n, 0.0))
    assert_near(out.loss, torch.where(mask, -r_hat * adv * logp, 0.0).sum() / n)


@given(data=st.data())
def test_equal_lengths_token_mean_equals_seq_mean_token_mean(data):
    b, t = data.draw(shapes())
    length = data.draw(st.integers(1, t))
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b):  # exactly `length` valid tokens per row, anywhere in the row
        cols = data.draw(st.lists(st.integers(0, t - 1), min_size=length, max_size=length, unique=True))
        mask[i, cols] = True
    loss = torch.where(mask, data.draw(tensors(b, t)), NAN)
    tm = agg_loss(loss, mask, "token-mean")
    assert_near(agg_loss(loss, mask, "seq-mean-token-mean"), tm)
    assert_near(agg_loss(loss, mask, "seq-mean-token-sum"), length * tm)


@given(data=st.data())
def test_micro_batches_with_global_counts_sum_to_full_batch(data):
    mask, logp, logp_old, adv = data.draw(policy_batch(min_b=2, max_b=6))
    b = mask.shape[0]
    k = data.draw(st.integers(1, b - 1))
    mode = data.draw(MODES)
    loss_mat = torch.where(mask, adv, NAN)
    kw = {"num_tokens": int(mask.sum())}
    if mode == "seq-mean-token-sum-norm":
        kw["num_seqs"] = b
    elif mode != "token-mean":
        kw["num_seqs"] = int(mask.any(-1).sum())
    full = agg_loss(loss_mat, mask, mode)
    halves = agg_loss(loss_mat[:k], mask[:k], mode, **kw) + agg_loss(loss_mat[k:], mask[k:], mode, **kw)
    assert_near(halves, full)
    # the same through ppo_clip_loss: gradient accumulation over micro-batches = full-batch gradient
    lp_full, lp_mb = logp.clone().requires_grad_(), logp.clone().requires_grad_()
    ppo_clip_loss(lp_full, logp_old, adv, mask, loss_agg_mode=mode).loss.backward()
    total = sum(ppo_clip_loss(lp_mb[sl], logp_old[sl], adv[sl], mask[sl], loss_agg_mode=mode,
                              num_tokens=kw["num_tokens"], num_seqs=kw.get("num_seqs")).loss
                for sl in (slice(0, k), slice(k, b)))
    total.backward()
    assert_near(total, ppo_clip_loss(logp, logp_old, adv, mask, loss_agg_mode=mode).loss)
    assert_near(lp_mb.grad, lp_full.grad)


@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo", "reinforce"])
@_HALF_EXAMPLES
@given(data=st.data())
def test_is_weights_scale_linearly_and_are_detached(kind, data):
    mask, logp, logp_old, adv = data.draw(policy_batch())
    mode = data.draw(MODES)
    k = data.draw(st.floats(0.0, 3.0))
    w = torch.full_like(adv, k).requires_grad_()
    lp = logp.clone().requires_grad_()
    base = _call(kind, logp, logp_old, adv, mask, mode)
    weighted = _call(kind, lp, logp_old, adv, mask, mode, w)
    assert_near(weighted.loss, k * base.loss)
    weighted.loss.backward()
    assert w.grad is None  # the weights are detached: no gradient flows into them
    assert lp.grad is not None


@given(data=st.data())
def test_value_loss_properties(data):
    mask, values, values_old, returns = data.draw(policy_batch())
    mode = data.draw(MODES)
    plain = value_loss(values, values_old, returns, mask, clip_range=None, loss_agg_mode=mode)
    assert_near(plain.loss, 0.5 * agg_loss((values - returns) ** 2, mask, mode))
    huge = value_loss(values, values_old, returns, mask, clip_range=1e9, loss_agg_mode=mode)
    assert_near(huge.loss, plain.loss)
    assert huge.clipfrac.item() == 0.0
    clip = data.draw(st.floats(0.01, 2.0))
    clipped = value_loss(values, values_old, returns, mask, clip_range=clip, loss_agg_mode=mode)
    # per-token max of the two squared errors ⇒ never below the plain loss, in every mode
    assert clipped.loss.item() >= plain.loss.item() - 1e-12
    assert 0.0 <= clipped.clipfrac.item() <= 1.0


# ---------------------------------------------------------------------------------------------------------------
# (d) bad input
# ---------------------------------------------------------------------------------------------------------------

def _good(b=2, t=3):
    logp = torch.full((b, t), -1.0, dtype=F64)
    return logp, logp.clone(), torch.ones(b, t, dtype=F64), torch.ones(b, t, dtype=torch.bool)


def test_per_sequence_advantages_rejected_with_hint():
    logp, old, _, mask = _good()
    with pytest.raises(ValueError, match=r"advantages must be a per-token tensor \[B, T\].*per-sequence"):
        ppo_clip_loss(logp, old, torch.ones(2, dtype=F64), mask)
    with pytest.raises(ValueError, match=r"advantages must be a per-token tensor \[B, T\]"):
        reinforce_loss(logp, torch.ones(2, dtype=F64), mask)
    with pytest.raises(ValueError, match=r"advantages must be a per-token tensor \[B, T\]"):
        gspo_loss(logp, old, torch.ones(2, dtype=F64), mask)


@pytest.mark.parametrize("fn", [ppo_clip_loss, gspo_loss, cispo_loss])
def test_mismatched_shapes_rejected(fn):
    logp, old, adv, mask = _good()
    with pytest.raises(ValueError, match=r"logp_old has shape \[2, 4\]"):
        fn(logp, torch.zeros(2, 4, dtype=F64), adv, mask)
    with pytest.raises(ValueError, match=r"response_mask has shape \[3, 3\]"):
        fn(logp, old, adv, torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"is_weights has shape"):
        fn(logp, old, adv, mask, is_weights=torch.ones(2, 2, dtype=F64))


def test_value_loss_shape_mismatch_rejected():
    logp, old, adv, mask = _good()
    with pytest.raises(ValueError, match=r"returns has shape"):
        value_loss(logp, old, adv[:, :2], mask)


def test_non_binary_mask_rejected():
    logp, old, adv, _ = _good()
    bad = torch.tensor([[1.0, 0.5, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    with pytest.raises(ValueError, match=r"response_mask must hold only 0 and 1"):
        ppo_clip_loss(logp, old, adv, bad)
    with pytest.raises(ValueError, match=r"agg_loss: mask must hold only 0 and 1"):
        agg_loss(logp, bad)


def test_agg_loss_rejects_mask_that_would_broadcast():
    # a [T] mask must not silently broadcast over the rows
    with pytest.raises(ValueError, match=r"agg_loss: mask has shape \[3\]"):
        agg_loss(torch.ones(2, 3, dtype=F64), torch.tensor([True, True, False]))
    with pytest.raises(ValueError, match=r"agg_loss: loss_mat must be a per-token tensor \[B, T\]"):
        agg_loss(torch.ones(3, dtype=F64), torch.tensor([True, True, False]))


@pytest.mark.parametrize("name", ["advantages", "logp_old", "logp", "is_weights"])
def test_nan_at_valid_position_rejected(name):
    logp, old, adv, mask = _good()
    inputs = {"logp": logp, "logp_old": old, "advantages": adv, "is_weights": torch.ones_like(adv)}
    inputs[name] = inputs[name].clone()
    inputs[name][1, 2] = NAN
    with pytest.raises(ValueError, match=rf"ppo_clip_loss: {name} holds 1 non-finite value"):
        ppo_clip_loss(inputs["logp"], inputs["logp_old"], inputs["advantages"], mask, is_weights=inputs["is_weights"])


def test_inf_at_valid_position_rejected_in_value_loss():
    logp, old, adv, mask = _good()
    old[0, 0] = INF
    with pytest.raises(ValueError, match=r"value_loss: values_old holds 1 non-finite"):
        value_loss(logp, old, adv, mask)


@pytest.mark.parametrize("fn", [ppo_clip_loss, gspo_loss, cispo_loss])
def test_empty_batch_rejected(fn):
    z = torch.zeros(0, 3, dtype=F64)
    with pytest.raises(ValueError, match=r"response_mask is empty \(B=0\)"):
        fn(z, z, z, torch.zeros(0, 3, dtype=torch.bool))


def test_empty_batch_rejected_reinforce_and_value():
    z = torch.zeros(0, 3, dtype=F64)
    m = torch.zeros(0, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"response_mask is empty"):
        reinforce_loss(z, z, m)
    with pytest.raises(ValueError, match=r"response_mask is empty"):
        value_loss(z, z, z, m)


@pytest.mark.parametrize("kwargs, match", [
    ({"clip_ratio_low": 1.0}, r"clip_ratio_low must lie in \[0, 1\)"),
    ({"clip_ratio_low": 1.5}, r"clip_ratio_low"),
    ({"clip_ratio_low": -0.1}, r"clip_ratio_low"),
    ({"clip_ratio_high": -0.1}, r"clip_ratio_high must be >= 0"),
    ({"clip_ratio_c": 1.0}, r"clip_ratio_c must be > 1"),
    ({"clip_ratio_c": 0.5}, r"clip_ratio_c must be > 1"),
])
def test_ppo_invalid_clip_ranges(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ppo_clip_loss(*_good(), **kwargs)


def test_gspo_cispo_value_invalid_clip_ranges():
    with pytest.raises(ValueError, match=r"gspo_loss: clip_ratio_low"):
        gspo_loss(*_good(), clip_ratio_low=1.0)
    with pytest.raises(ValueError, match=r"cispo_loss: clip_ratio_high"):
        cispo_loss(*_good(), clip_ratio_high=-1.0)
    with pytest.raises(ValueError, match=r"value_loss: clip_range must be > 0 or None"):
        value_loss(*_good(), clip_range=0.0)


def test_unknown_agg_mode_rejected():
    logp, old, adv, mask = _good()
    with pytest.raises(ValueError, match=r"agg_loss: mode='token-sum' is not one of"):
        agg_loss(logp, mask, "token-sum")
    with pytest.raises(ValueError, match=r"ppo_clip_loss: loss_agg_mode='token-sum'"):
        ppo_clip_loss(logp, old, adv, mask, loss_agg_mode="token-sum")
    with pytest.raises(ValueError, match=r"cispo_loss: loss_agg_mode='seq-mean'"):
        cispo_loss(logp, old, adv, mask, loss_agg_mode="seq-mean")
    with pytest.raises(ValueError, match=r"reinforce_loss: loss_agg_mode="):
        reinforce_loss(logp, adv, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"value_loss: loss_agg_mode="):
        value_loss(logp, old, adv, mask, loss_agg_mode="sum")


def test_non_float_and_non_tensor_inputs_rejected():
    logp, old, adv, mask = _good()
    with pytest.raises(ValueError, match=r"advantages must be floating point"):
        ppo_clip_loss(logp, old, torch.ones(2, 3, dtype=torch.int64), mask)
    with pytest.raises(ValueError, match=r"logp must be a torch.Tensor"):
        ppo_clip_loss([[0.0]], old, adv, mask)
