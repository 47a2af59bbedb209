"""Advantage estimators (`asyncrl.algos.advantages`): golden values, properties, loop references, bad input.

Reference: /work/shared/reference/algos.md §2 (GAE, GRPO, Dr.GRPO, RLOO, REINFORCE++) and §9.1–9.3, §9.8.
Documented choices pinned here (they differ from verl on purpose): singleton groups get A = 0; constant groups
get exactly 0; GAE and REINFORCE++ skip masked holes inside a response (neither add reward nor break the
discount chain); every output is exactly 0 at masked positions.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from asyncrl.algos.advantages import (
    dr_grpo_advantage, gae_advantage, group_stats, grpo_advantage, reinforce_pp_advantage,
    reinforce_pp_baseline_advantage, rloo_advantage,
)
from tests.strategies import masks, shapes, tensors, vectors

F64 = torch.float64
NAN, INF = float("nan"), float("inf")
WHITEN_EPS = 1e-8
OUTCOME = [grpo_advantage, dr_grpo_advantage, rloo_advantage, reinforce_pp_baseline_advantage]
GROUPED = [grpo_advantage, dr_grpo_advantage, rloo_advantage]


def assert_near(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), rtol=0, atol=atol)


def lengths_mask(lengths, t):
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


def broadcast(seq, mask):
    seq = torch.as_tensor(seq, dtype=F64)
    return torch.where(mask, seq[:, None], torch.zeros((), dtype=F64))


def whiten_list(vals, eps=WHITEN_EPS, shift_mean=True):
    n = len(vals)
    mu = sum(vals) / n
    var = sum((v - mu) ** 2 for v in vals) / (n - 1)
    return [(v - (mu if shift_mean else 0.0)) / math.sqrt(var + eps) for v in vals]


# ================================================================ (a) golden values — outcome methods

# Non-contiguous groups: rows 0, 2, 4 answer prompt 7, rows 1, 3 prompt 3, row 5 prompt 9 (a singleton).
REWARDS = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0, 5.0], dtype=F64)
GROUPS = torch.tensor([7, 3, 7, 3, 7, 9])
MASK = lengths_mask([3, 1, 2, 0, 3, 2], 3)  # row 3 has no valid token


def test_group_stats_golden():
    s = group_stats(REWARDS, GROUPS)
    # prompt 7: {1, 0, 0}: mean 1/3; Σ(dev²) = (2/3)² + 2·(1/3)² = 6/9; unbiased var (6/9)/2 = 1/3; std 0.5773503
    # prompt 3: {2, 4}: mean 3; var (1 + 1)/1 = 2; std 1.4142136.  prompt 9: {5}: mean 5, std 0 (group of one)
    assert_near(s.mean, [1 / 3, 3.0, 1 / 3, 3.0, 1 / 3, 5.0])
    assert_near(s.std, [math.sqrt(1 / 3), math.sqrt(2), math.sqrt(1 / 3), math.sqrt(2), math.sqrt(1 / 3), 0.0])
    assert_near(s.size, [3.0, 2.0, 3.0, 2.0, 3.0, 1.0])
    assert s.constant.tolist() == [False, False, False, False, False, True]
    assert group_stats(torch.tensor([2.0, 2.0, 1.0], dtype=F64), torch.tensor([0, 0, 1])).constant.tolist() == [True] * 3


def test_grpo_golden_brief_example():
    # rewards [1, 0, 1, 1], groups [0, 0, 1, 1]: group 0 mean 0.5, unbiased std sqrt(0.5) = 0.70711
    #   → A = ±0.5/(0.70711 + 1e-6) = ±0.7071058;  group 1 constant → exactly 0
    out = grpo_advantage(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64), torch.tensor([0, 0, 1, 1]),
                         torch.ones(4, 2, dtype=torch.bool))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert_near(out.advantages, [[a, a], [-a, -a], [0.0, 0.0], [0.0, 0.0]])
    assert abs(a - 0.7071058) < 1e-6
    assert torch.equal(out.advantages[2:], torch.zeros(2, 2, dtype=F64))


def test_grpo_golden():
    # prompt 7: A = (r − 1/3)/(0.5773503 + 1e-6): (2/3)/0.5773513 = 1.1546985; (−1/3)/0.5773513 = −0.5773492
    # prompt 3: A = ∓1/(1.4142136 + 1e-6) = ∓0.7071063;  prompt 9 (singleton): 0
    s7, s3 = math.sqrt(1 / 3) + 1e-6, math.sqrt(2) + 1e-6
    seq = [(2 / 3) / s7, -1 / s3, (-1 / 3) / s7, 1 / s3, (-1 / 3) / s7, 0.0]
    out = grpo_advantage(REWARDS, GROUPS, MASK)
    assert_near(out.advantages, broadcast(seq, MASK))
    assert_near(out.advantages[0, 0], 1.1546985, atol=1e-6)
    assert torch.equal(out.returns, out.advantages)
    # TRL's eps 1e-4: (2/3)/(0.5773503 + 1e-4) = 0.6666667/0.5774503 = 1.1545006
    out4 = grpo_advantage(REWARDS, GROUPS, MASK, eps=1e-4)
    assert_near(out4.advantages[0, 0], (2 / 3) / (math.sqrt(1 / 3) + 1e-4))
    assert_near(out4.advantages[0, 0], 1.1545006, atol=1e-6)


def test_dr_grpo_golden():
    # A = r − mean_g: prompt 7: [2/3, −1/3, −1/3]; prompt 3: [−1, +1]; singleton: 0
    seq = [2 / 3, -1.0, -1 / 3, 1.0, -1 / 3, 0.0]
    out = dr_grpo_advantage(REWARDS, GROUPS, MASK)
    assert_near(out.advantages, broadcast(seq, MASK))
    assert torch.equal(out.returns, out.advantages)
    assert_near(grpo_advantage(REWARDS, GROUPS, MASK, norm_by_std=False).advantages, out.advantages, atol=0)


def test_rloo_golden():
    # prompt 7, k = 3: A = r − mean(others): 1 − (0+0)/2 = 1; 0 − (1+0)/2 = −0.5 (twice)  [= 3/2·(r − 1/3)]
    # prompt 3, k = 2: 2 − 4 = −2; 4 − 2 = 2  [= 2·(r − 3)];  singleton: 0 (documented; verl's loop keeps 5)
    seq = [1.0, -2.0, -0.5, 2.0, -0.5, 0.0]
    out = rloo_advantage(REWARDS, GROUPS, MASK)
    assert_near(out.advantages, broadcast(seq, MASK))
    assert torch.equal(out.returns, out.advantages)


def test_reinforce_pp_baseline_golden():
    # rewards [1, 0, 3, 5], groups [0, 0, 0, 1], lengths [2, 1, 3, 2] (T = 3)
    # centred: group 0 mean 4/3 → [−1/3, −4/3, 5/3]; group 1 singleton → 0
    # valid tokens: 2×(−1/3), 1×(−4/3), 3×(5/3), 2×0 → N = 8, Σ = −2/3 − 4/3 + 5 = 3, μ = 3/8
    # Σx² = 2/9 + 16/9 + 75/9 = 93/9; Σ(x − μ)² = 93/9 − 8·(3/8)² = 10.33333 − 1.125 = 9.208333 = 221/24
    # unbiased var = (221/24)/7 = 221/168 = 1.3154762, std 1.1469421
    mask = lengths_mask([2, 1, 3, 2], 3)
    rewards, groups = torch.tensor([1.0, 0.0, 3.0, 5.0], dtype=F64), torch.tensor([0, 0, 0, 1])
    out = reinforce_pp_baseline_advantage(rewards, groups, mask)
    sd = math.sqrt(221 / 168 + 1e-8)
    # default: divided by the batch std, not re-centred: the singleton group stays exactly 0
    assert_near(out.advantages, broadcast([(-1 / 3) / sd, (-4 / 3) / sd, (5 / 3) / sd, 0.0], mask))
    assert torch.equal(out.advantages[3], torch.zeros(3, dtype=F64))
    assert_near(out.advantages[0, 0], -0.2906279, atol=1e-6)  # −0.3333333/1.1469421
    assert torch.equal(out.returns, out.advantages)
    # shift_mean=True: verl's masked_whiten, which moves the singleton to −μ/σ
    verl = reinforce_pp_baseline_advantage(rewards, groups, mask, shift_mean=True)
    seq = [(-1 / 3 - 3 / 8) / sd, (-4 / 3 - 3 / 8) / sd, (5 / 3 - 3 / 8) / sd, (0 - 3 / 8) / sd]
    assert_near(verl.advantages, broadcast(seq, mask))
    assert_near(verl.advantages[0, 0], -0.6175842, atol=1e-6)  # −0.7083333/1.1469421


# ================================================================ (a) golden values — token methods


def test_reinforce_pp_golden_discount_and_hole():
    # γ = 0.9.  row 0: rewards [0.5, 9, 0, 1, 0] with mask [1, 0, 1, 1, 0] (a hole at t = 1, padding at t = 4)
    #   G3 = 1;  G2 = 0 + 0.9·1 = 0.9;  t = 1 skipped (its 9 is never added, the chain carries 0.9);
    #   G0 = 0.5 + 0.9·0.9 = 1.31            (verl would reset at the hole and give G0 = 0.5)
    # row 1: rewards [0, 0, 2, ·, ·], mask [1, 1, 1, 0, 0]: G2 = 2; G1 = 1.8; G0 = 1.62
    r = torch.tensor([[0.5, 9.0, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, NAN, INF]], dtype=F64)
    mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    out = reinforce_pp_advantage(r, mask, gamma=0.9)
    assert_near(out.returns, [[1.31, 0.0, 0.9, 1.0, 0.0], [1.62, 1.8, 2.0, 0.0, 0.0]])
    # whiten over the 6 valid G: μ = 8.63/6 = 1.4383333, unbiased var = 0.1955367, std 0.4421953
    #   1.31 → −0.2902187, 0.9 → −1.2174108, 1.0 → −0.9912664, 1.62 → 0.4108290, 1.8 → 0.8178890, 2.0 → 1.2701779
    w = whiten_list([1.31, 0.9, 1.0, 1.62, 1.8, 2.0])
    assert_near(out.advantages, [[w[0], 0.0, w[1], w[2], 0.0], [w[3], w[4], w[5], 0.0, 0.0]])
    assert_near(out.advantages[0], [-0.2902187, 0.0, -1.2174108, -0.9912664, 0.0], atol=1e-6)
    # γ = 1 (default): plain suffix sums over valid tokens: row 0 [1.5, 0, 1, 1, 0], row 1 [2, 2, 2, 0, 0]
    assert_near(reinforce_pp_advantage(r, mask).returns, [[1.5, 0.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 0.0, 0.0]])
    # γ = 0: G = r at valid tokens
    assert_near(reinforce_pp_advantage(r, mask, gamma=0.0).returns, [[0.5, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]])


# row 0: r = [0, 0, 1], V = [0.5, 0.4, 0.6] on a full 3-token response (t = 3 is padding with NaN);
# row 1: the same response with a hole at t = 1 holding garbage (r = 7, V = 99) that must be skipped.
GAE_R = torch.tensor([[0.0, 0.0, 1.0, NAN], [0.0, 7.0, 0.0, 1.0]], dtype=F64)
GAE_V = torch.tensor([[0.5, 0.4, 0.6, NAN], [0.5, 99.0, 0.4, 0.6]], dtype=F64)
GAE_M = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)


def test_gae_golden():
    # γ = 0.9, λ = 0.95, γλ = 0.855
    # t=2: δ = 1 + 0.9·0 − 0.6 = 0.4;            A = 0.4
    # t=1: δ = 0 + 0.9·0.6 − 0.4 = 0.14;         A = 0.14 + 0.855·0.4 = 0.482
    # t=0: δ = 0 + 0.9·0.4 − 0.5 = −0.14;        A = −0.14 + 0.855·0.482 = 0.27211
    # returns = A + V = [0.77211, 0.882, 1.0]
    out = gae_advantage(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.95, whiten=False)
    assert_near(out.advantages, [[0.27211, 0.482, 0.4, 0.0], [0.27211, 0.0, 0.482, 0.4]])
    assert_near(out.returns, [[0.77211, 0.882, 1.0, 0.0], [0.77211, 0.0, 0.882, 1.0]])
    # whitened over the 6 valid A (each value twice): μ = 2·1.15411/6 = 0.3847033,
    # devs −0.1125933, 0.0972967, 0.0152967; Σ(dev²) = 2·(0.0126773 + 0.0094666 + 0.0002340) = 0.0447558,
    # unbiased var /5 = 0.0089512, std 0.0946105 → [−1.1900710, 1.0283908, 0.1616803]
    w = whiten_list([0.27211, 0.482, 0.4] * 2)
    assert_near(torch.tensor(w[:3], dtype=F64), [-1.1900710, 1.0283908, 0.1616803], atol=1e-6)
    ww = gae_advantage(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.95, whiten=True)
    assert_near(ww.advantages, [[w[0], w[1], w[2], 0.0], [w[0], 0.0, w[1], w[2]]])
    assert abs(ww.advantages[:, :].sum().item()) < 1e-12
    torch.testing.assert_close(ww.returns, out.returns, rtol=0, atol=0)  # returns are never whitened


def test_gae_golden_lambda_zero_is_td_error():
    # λ = 0 ⇒ A_t = δ_t = r_t + γ·V_next − V_t: [−0.14, 0.14, 0.4] (γ = 0.9)
    out = gae_advantage(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.0, whiten=False)
    assert_near(out.advantages, [[-0.14, 0.14, 0.4, 0.0], [-0.14, 0.0, 0.14, 0.4]])
    assert_near(out.returns, [[0.36, 0.54, 1.0, 0.0], [0.36, 0.0, 0.54, 1.0]])  # one-step targets r + γV'


def test_gae_golden_monte_carlo():
    # γ = λ = 1 ⇒ A_t = Σ_{k≥t} r_k − V_t: [1 − 0.5, 1 − 0.4, 1 − 0.6] = [0.5, 0.6, 0.4]; returns = 1 everywhere
    out = gae_advantage(GAE_R, GAE_V, GAE_M, gamma=1.0, lam=1.0, whiten=False)
    assert_near(out.advantages, [[0.5, 0.6, 0.4, 0.0], [0.5, 0.0, 0.6, 0.4]])
    assert_near(out.returns, [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    # γ = 1, λ = 0.5: t2 A = 0.4; t1 δ = 0.6 − 0.4 = 0.2, A = 0.2 + 0.5·0.4 = 0.4; t0 δ = −0.1, A = −0.1 + 0.2 = 0.1
    assert_near(gae_advantage(GAE_R, GAE_V, GAE_M, gamma=1.0, lam=0.5, whiten=False).advantages,
          [[0.1, 0.4, 0.4, 0.0], [0.1, 0.0, 0.4, 0.4]])


# ================================================================ loop references (c)


def gae_reference(r, v, m, gamma, lam):
    """Scalar GAE over valid tokens only; masked tokens are skipped (the chain carries over them)."""
    b, t = len(m), len(m[0])
    adv = [[0.0] * t for _ in range(b)]
    ret = [[0.0] * t for _ in range(b)]
    for i in range(b):
        next_v, last = 0.0, 0.0
        for j in reversed(range(t)):
            if not m[i][j]:
                continue
            delta = r[i][j] + gamma * next_v - v[i][j]
            last = delta + gamma * lam * last
            next_v = v[i][j]
            adv[i][j] = last
            ret[i][j] = last + v[i][j]
    return adv, ret


def returns_reference(r, m, gamma):
    b, t = len(m), len(m[0])
    g = [[0.0] * t for _ in range(b)]
    for i in range(b):
        run = 0.0
        for j in reversed(range(t)):
            if m[i][j]:
                run = r[i][j] + gamma * run
                g[i][j] = run
    return g


def whiten_reference(x, m, shift_mean=True):
    cells = [(i, j) for i in range(len(m)) for j in range(len(m[0])) if m[i][j]]
    w = whiten_list([x[i][j] for i, j in cells], shift_mean=shift_mean)
    out = [[0.0] * len(m[0]) for _ in m]
    for (i, j), val in zip(cells, w):
        out[i][j] = val
    return out


unit = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.9, 0.95, 0.99]), st.floats(0.0, 1.0))
junk_values = st.sampled_from([NAN, INF, -INF, 1e6, -3.5])


@st.composite
def token_batch(draw, n_tensors: int, min_valid: int = 0):
    """(clean tensors, dirty tensors (garbage at masked positions), mask) with holes inside responses."""
    b, t = draw(shapes(max_b=5, max_t=8))
    mask = draw(masks(b, t, contiguous=draw(st.booleans())))
    assume(int(mask.sum()) >= min_valid)
    clean = [draw(tensors(b, t)) for _ in range(n_tensors)]
    dirty = [torch.where(mask, x, torch.tensor(draw(st.lists(junk_values, min_size=b * t, max_size=b * t)),
                                               dtype=F64).reshape(b, t)) for x in clean]
    return clean, dirty, mask


@given(token_batch(2), unit, unit)
def test_gae_matches_loop_reference(batch, gamma, lam):
    (r, v), (dr, dv), mask = batch
    adv_ref, ret_ref = gae_reference(r.tolist(), v.tolist(), mask.tolist(), gamma, lam)
    out = gae_advantage(dr, dv, mask, gamma=gamma, lam=lam, whiten=False)
    assert_near(out.advantages, adv_ref, atol=1e-10)
    assert_near(out.returns, ret_ref, atol=1e-10)


@given(token_batch(2, min_valid=2), unit, unit)
def test_gae_whitened_matches_loop_reference(batch, gamma, lam):
    (r, v), (dr, dv), mask = batch
    adv_ref, ret_ref = gae_reference(r.tolist(), v.tolist(), mask.tolist(), gamma, lam)
    out = gae_advantage(dr, dv, mask, gamma=gamma, lam=lam, whiten=True)
    # whitening divides by sqrt(var + 1e-8) ≥ 1e-4, so rounding differences grow by at most 1e4
    assert_near(out.advantages, whiten_reference(adv_ref, mask.tolist()), atol=1e-9)
    assert_near(out.returns, ret_ref, atol=1e-10)


@given(token_batch(1, min_valid=2), unit)
def test_reinforce_pp_matches_loop_reference(batch, gamma):
    (r,), (dr,), mask = batch
    g = returns_reference(r.tolist(), mask.tolist(), gamma)
    out = reinforce_pp_advantage(dr, mask, gamma=gamma)
    assert_near(out.returns, g, atol=1e-10)
    assert_near(out.advantages, whiten_reference(g, mask.tolist()), atol=1e-9)


# ================================================================ (b) properties — token methods


@given(token_batch(2, min_valid=2), unit, unit, st.booleans())
def test_gae_mask_hygiene(batch, gamma, lam, whiten):
    (r, v), (dr, dv), mask = batch
    clean = gae_advantage(r, v, mask, gamma=gamma, lam=lam, whiten=whiten)
    dirty = gae_advantage(dr, dv, mask, gamma=gamma, lam=lam, whiten=whiten)
    for a, c in zip(dirty, clean):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        assert torch.equal(a[~mask], torch.zeros(int((~mask).sum()), dtype=F64))


@given(token_batch(1, min_valid=2), unit)
def test_reinforce_pp_mask_hygiene(batch, gamma):
    (r,), (dr,), mask = batch
    clean, dirty = reinforce_pp_advantage(r, mask, gamma=gamma), reinforce_pp_advantage(dr, mask, gamma=gamma)
    for a, c in zip(dirty, clean):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        assert torch.equal(a[~mask], torch.zeros(int((~mask).sum()), dtype=F64))


@given(token_batch(2), unit)
def test_gae_lambda_zero_is_td_error(batch, gamma):
    (r, v), _, mask = batch
    out = gae_advantage(r, v, mask, gamma=gamma, lam=0.0, whiten=False)
    for i in range(r.shape[0]):
        valid = [j for j in range(r.shape[1]) if mask[i, j]]
        for pos, j in enumerate(valid):
            v_next = v[i, valid[pos + 1]].item() if pos + 1 < len(valid) else 0.0
            delta = r[i, j].item() + gamma * v_next - v[i, j].item()
            assert abs(out.advantages[i, j].item() - delta) < 1e-12


@given(token_batch(2))
def test_gae_gamma_lambda_one_is_future_sum_minus_value(batch):
    (r, v), _, mask = batch
    out = gae_advantage(r, v, mask, gamma=1.0, lam=1.0, whiten=False)
    # A_t = Σ_{valid k ≥ t} r_k − V_t; returns = Σ_{valid k ≥ t} r_k (the Monte-Carlo return)
    future = torch.where(mask, r, torch.zeros((), dtype=F64)).flip(-1).cumsum(-1).flip(-1)
    assert_near(out.advantages, torch.where(mask, future - v, torch.zeros((), dtype=F64)), atol=1e-12)
    assert_near(out.returns, torch.where(mask, future, torch.zeros((), dtype=F64)), atol=1e-12)
    # and REINFORCE++ with γ = 1 gives the same returns
    if int(mask.sum()) >= 2:
        assert_near(reinforce_pp_advantage(r, mask, gamma=1.0).returns, out.returns, atol=1e-12)


@given(token_batch(2, min_valid=2), unit, unit, st.data())
def test_gae_and_reinforce_pp_permute_rows(batch, gamma, lam, data):
    (r, v), _, mask = batch
    perm = torch.tensor(data.draw(st.permutations(range(r.shape[0]))))
    for whiten in (False, True):
        a = gae_advantage(r, v, mask, gamma=gamma, lam=lam, whiten=whiten)
        b = gae_advantage(r[perm], v[perm], mask[perm], gamma=gamma, lam=lam, whiten=whiten)
        assert_near(b.advantages, a.advantages[perm], atol=1e-9)
        assert_near(b.returns, a.returns[perm], atol=1e-12)
    a, b = reinforce_pp_advantage(r, mask, gamma=gamma), reinforce_pp_advantage(r[perm], mask[perm], gamma=gamma)
    assert_near(b.advantages, a.advantages[perm], atol=1e-9)
    assert_near(b.returns, a.returns[perm], atol=1e-12)


@given(token_batch(2, min_valid=2), unit, unit)
def test_whitened_advantages_mean_zero_std_one(batch, gamma, lam):
    (r, v), _, mask = batch
    raw = gae_advantage(r, v, mask, gamma=gamma, lam=lam, whiten=False).advantages[mask]
    adv = gae_advantage(r, v, mask, gamma=gamma, lam=lam, whiten=True).advantages[mask]
    var = raw.var().item()
    assert abs(adv.mean().item()) < 1e-9
    assert abs(adv.std().item() - math.sqrt(var / (var + WHITEN_EPS))) < 1e-9


# ================================================================ (b) properties — outcome methods


@st.composite
def outcome_batch(draw, integer_rewards: bool = False, min_b: int = 1):
    b = draw(st.integers(min_b, 8))
    t = draw(st.integers(1, 4))
    groups = torch.tensor(draw(st.lists(st.integers(-2, 3), min_size=b, max_size=b)), dtype=torch.int64)
    if integer_rewards:
        rewards = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=b, max_size=b)), dtype=F64)
    else:
        rewards = draw(vectors(b))
    mask = draw(masks(b, t))
    return rewards, groups, mask


def seq_adv(fn, rewards, groups, **kw):
    """The per-sequence advantage (every row fully valid on a single token)."""
    return fn(rewards, groups, torch.ones(rewards.shape[0], 1, dtype=torch.bool), **kw).advantages[:, 0]


def loop_outcome_reference(rewards, groups, kind, eps=1e-6):
    r, g = rewards.tolist(), groups.tolist()
    out = []
    for i in range(len(r)):
        members = [r[j] for j in range(len(r)) if g[j] == g[i]]
        k = len(members)
        if k == 1 or min(members) == max(members):
            out.append(0.0)
            continue
        mu = sum(members) / k
        if kind == "grpo":
            std = math.sqrt(sum((x - mu) ** 2 for x in members) / (k - 1))
            out.append((r[i] - mu) / (std + eps))
        elif kind == "dr_grpo":
            out.append(r[i] - mu)
        else:  # rloo: leave-one-out mean of the others
            out.append(r[i] - (sum(members) - r[i]) / (k - 1))
    return out


@given(outcome_batch())
def test_outcome_methods_match_loop_reference(batch):
    rewards, groups, mask = batch
    for fn, kind in ((grpo_advantage, "grpo"), (dr_grpo_advantage, "dr_grpo"), (rloo_advantage, "rloo")):
        out = fn(rewards, groups, mask)
        assert_near(out.advantages, broadcast(loop_outcome_reference(rewards, groups, kind), mask), atol=1e-9)
        assert torch.equal(out.returns, out.advantages)


@given(outcome_batch())
def test_outcome_methods_zero_at_masked_and_constant_over_valid(batch):
    rewards, groups, mask = batch
    for fn in GROUPED:
        adv = fn(rewards, groups, mask).advantages
        assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
        # the mask only selects tokens, it never changes the statistics (rows with no valid token still count)
        assert torch.equal(adv, broadcast(seq_adv(fn, rewards, groups), mask))
    if int(mask.sum()) >= 2:
        adv = reinforce_pp_baseline_advantage(rewards, groups, mask).advantages
        assert torch.equal(adv[~mask], torch.zeros(int((~mask).sum()), dtype=F64))
        for i in range(adv.shape[0]):  # constant over the valid tokens of each row
            row = adv[i][mask[i]]
            assert row.numel() == 0 or torch.equal(row, row[:1].expand_as(row))


@given(outcome_batch(), st.data())
def test_outcome_methods_permute_rows(batch, data):
    rewards, groups, mask = batch
    perm = torch.tensor(data.draw(st.permutations(range(rewards.shape[0]))))
    for fn in GROUPED:
        a = fn(rewards, groups, mask).advantages
        b = fn(rewards[perm], groups[perm], mask[perm]).advantages
        assert_near(b, a[perm], atol=1e-9)
    s, sp = group_stats(rewards, groups), group_stats(rewards[perm], groups[perm])
    for x, y in zip(sp, s):
        if x.dtype == torch.bool:
            assert torch.equal(x, y[perm])
        else:
            assert_near(x, y[perm], atol=1e-12)
    if int(mask.sum()) >= 2:
        a = reinforce_pp_baseline_advantage(rewards, groups, mask).advantages
        b = reinforce_pp_baseline_advantage(rewards[perm], groups[perm], mask[perm]).advantages
        assert_near(b, a[perm], atol=1e-9)


@given(outcome_batch())
def test_outcome_group_sums_are_zero(batch):
    rewards, groups, _ = batch
    for fn in GROUPED:
        adv = seq_adv(fn, rewards, groups)
        for g in groups.unique():
            assert abs(adv[groups == g].sum().item()) < 1e-9


@given(outcome_batch(), st.floats(-3.0, 3.0))
def test_equal_rewards_in_a_group_give_exactly_zero(batch, c):
    rewards, groups, mask = batch
    # make group 0 (if present) constant: r = c for all its rows; singleton groups are constant too
    rewards = torch.where(groups == 0, torch.full_like(rewards, c), rewards)
    constant_rows = group_stats(rewards, groups).constant
    for fn in GROUPED:
        adv = fn(rewards, groups, mask).advantages
        assert (adv[constant_rows] == 0).all()  # exactly 0, not eps-small
    if int(mask.sum()) >= 2:  # REINFORCE++-baseline too (docs/algorithms.md: no comparison, no signal)
        adv = reinforce_pp_baseline_advantage(rewards, groups, mask).advantages
        assert (adv[constant_rows] == 0).all()
    # all rows in one constant group: everything is exactly 0 (GRPO would otherwise divide 0 by eps)
    same = torch.full_like(rewards, c)
    for fn in OUTCOME:
        if fn is reinforce_pp_baseline_advantage and int(mask.sum()) < 2:
            continue
        assert torch.equal(fn(same, groups, mask).advantages, torch.zeros_like(mask, dtype=F64))


@given(outcome_batch(integer_rewards=True), st.floats(0.25, 8.0), st.floats(-10.0, 10.0))
def test_grpo_affine_invariant(batch, a, b):
    rewards, groups, mask = batch
    # exact invariance needs eps → 0; integer rewards keep every non-constant group's std ≥ 0.35 (σ ≫ eps)
    base = grpo_advantage(rewards, groups, mask, eps=1e-12).advantages
    assert_near(grpo_advantage(a * rewards + b, groups, mask, eps=1e-12).advantages, base, atol=1e-9)
    # with the default eps the difference is (r − μ)·eps·|1/σ − 1/(aσ)|/(σ+eps) ≤ 3·1e-6·4/0.35 < 5e-5 … bound it tightly:
    dflt = grpo_advantage(rewards, groups, mask).advantages
    scaled = grpo_advantage(a * rewards + b, groups, mask).advantages
    st_ = group_stats(rewards, groups)
    bound = (rewards - st_.mean).abs() * 1e-6 * abs(1 - 1 / a) / st_.std.clamp(min=1e-3) ** 2 + 1e-12
    assert ((scaled - dflt).abs() <= broadcast(bound, mask) + 1e-12).all()


@given(outcome_batch())
def test_rloo_is_k_over_k_minus_1_dr_grpo(batch):
    rewards, groups, mask = batch
    k = group_stats(rewards, groups).size
    factor = torch.where(k > 1, k / (k - 1).clamp(min=1), torch.zeros_like(k))
    dr = dr_grpo_advantage(rewards, groups, mask).advantages
    assert_near(rloo_advantage(rewards, groups, mask).advantages, dr * factor[:, None], atol=1e-12)


@given(outcome_batch(integer_rewards=True))
def test_grpo_group_std_of_advantages(batch):
    rewards, groups, _ = batch
    adv, stats = seq_adv(grpo_advantage, rewards, groups), group_stats(rewards, groups)
    for g in groups.unique():
        rows = groups == g
        if rows.sum() < 2 or bool(stats.constant[rows][0]):
            continue
        sigma = stats.std[rows][0].item()
        # std_unbiased(A_g) = σ/(σ + eps) ≈ 1
        assert abs(adv[rows].std().item() - sigma / (sigma + 1e-6)) < 1e-12


@given(outcome_batch(min_b=2))
def test_reinforce_pp_baseline_is_scaled_dr_grpo(batch):
    rewards, groups, mask = batch
    assume(int(mask.sum()) >= 2)
    dr = broadcast(seq_adv(dr_grpo_advantage, rewards, groups), mask)
    scaled = whiten_reference(dr.tolist(), mask.tolist(), shift_mean=False)
    assert_near(reinforce_pp_baseline_advantage(rewards, groups, mask).advantages, scaled, atol=1e-9)
    whitened = whiten_reference(dr.tolist(), mask.tolist())
    assert_near(reinforce_pp_baseline_advantage(rewards, groups, mask, shift_mean=True).advantages, whitened,
                atol=1e-9)


def test_singleton_groups_are_zero_for_every_outcome_method():
    # all rows are singletons: no comparison, A = 0 everywhere (documented; verl's GRPO loop gives s/(1+1e-6))
    rewards = torch.tensor([3.0, -1.0, 0.5], dtype=F64)
    groups = torch.tensor([0, 1, 2])
    mask = torch.ones(3, 2, dtype=torch.bool)
    for fn in OUTCOME:
        assert torch.equal(fn(rewards, groups, mask).advantages, torch.zeros(3, 2, dtype=F64)), fn.__name__


def test_constant_group_is_exactly_zero_despite_rounding():
    # rewards {0.1, 0.1, 0.1}: the float mean is (0.1 + 0.1 + 0.1)/3 = 0.30000000000000004/3 = 0.10000000000000002,
    # so r − mean = −1.39e-17 ≠ 0 and the float std is 1.7e-17; only the explicit "constant group" rule gives
    # exactly 0 (GRPO would otherwise give −1.39e-17/(1.7e-17 + 1e-6), RLOO 1.5·(−1.39e-17)).
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7], dtype=F64)
    groups = torch.tensor([4, 4, 4, 1, 1])
    assert (rewards[:3] - group_stats(rewards, groups).mean[:3]).abs().max() > 0  # the premise above
    mask = torch.ones(5, 2, dtype=torch.bool)
    for fn in OUTCOME:
        assert torch.equal(fn(rewards, groups, mask).advantages, torch.zeros(5, 2, dtype=F64)), fn.__name__


def test_float_01_mask_equals_bool_mask():
    fmask = MASK.to(F64)
    for fn in GROUPED:
        assert torch.equal(fn(REWARDS, GROUPS, fmask).advantages, fn(REWARDS, GROUPS, MASK).advantages)
    a = gae_advantage(GAE_R, GAE_V, GAE_M.to(torch.float32), gamma=0.9, lam=0.95)
    b = gae_advantage(GAE_R, GAE_V, GAE_M, gamma=0.9, lam=0.95)
    assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)


def test_group_index_dtypes_and_values_group_by_value():
    # int32 ids, negative and sparse values: grouping is by value, not by position or dense range
    g64 = torch.tensor([100, -5, 100, -5, 7, 100])
    a = grpo_advantage(REWARDS, g64, MASK).advantages
    assert torch.equal(grpo_advantage(REWARDS, g64.to(torch.int32), MASK).advantages, a)
    relabelled = grpo_advantage(REWARDS, torch.tensor([1, 0, 1, 0, 2, 1]), MASK).advantages
    assert torch.equal(relabelled, a)


# ================================================================ (d) bad input


def _outcome_args(b=3, t=2):
    return dict(rewards=torch.zeros(b, dtype=F64), group_index=torch.zeros(b, dtype=torch.int64),
                response_mask=torch.ones(b, t, dtype=torch.bool))


OUTCOME_BAD = [
    (dict(rewards=torch.zeros(4, dtype=F64)), r"rewards must be a per-sequence tensor \[B\] with B=3, got shape \[4\]"),
    (dict(rewards=torch.zeros(3, 2, dtype=F64)), r"rewards must be a per-sequence tensor \[B\] with B=3, got shape \[3, 2\]"),
    (dict(rewards=torch.zeros(3, dtype=torch.int64)), r"rewards must be floating point"),
    (dict(rewards=torch.tensor([0.0, NAN, 1.0], dtype=F64)), r"rewards holds 1 non-finite"),
    (dict(rewards=torch.tensor([INF, 0.0, -INF], dtype=F64)), r"rewards holds 2 non-finite"),
    (dict(group_index=torch.zeros(3, dtype=F64)), r"group_index must be an integer tensor"),
    (dict(group_index=torch.zeros(3, dtype=torch.bool)), r"group_index must be an integer tensor"),
    (dict(group_index=torch.zeros(2, dtype=torch.int64)), r"group_index must be a per-sequence tensor \[B\] with B=3"),
    (dict(response_mask=torch.ones(3, dtype=torch.bool)), r"response_mask must be a per-token tensor \[B, T\], got shape \[3\]"),
    (dict(response_mask=torch.full((3, 2), 0.5)), r"response_mask must hold only 0 and 1"),
    (dict(response_mask=torch.tensor([[1.0, NAN]] * 3)), r"response_mask must hold only 0 and 1"),
    (dict(rewards=torch.zeros(0, dtype=F64), group_index=torch.zeros(0, dtype=torch.int64),
          response_mask=torch.ones(0, 2, dtype=torch.bool)), r"response_mask is empty \(B=0\)"),
]


@pytest.mark.parametrize("fn", OUTCOME, ids=lambda f: f.__name__)
@pytest.mark.parametrize("change, match", OUTCOME_BAD, ids=[m for _, m in OUTCOME_BAD])
def test_outcome_bad_input(fn, change, match):
    kwargs = _outcome_args()
    kwargs.update(change)
    with pytest.raises(ValueError, match=fn.__name__ + ": " + match):
        fn(**kwargs)


def test_outcome_rewards_batch_mismatch_with_mask():
    # [B] rewards with B=3 against a [2, T] mask: the rewards are named, with the batch size they must match
    with pytest.raises(ValueError, match=r"grpo_advantage: rewards must be a per-sequence tensor \[B\] with B=2"):
        grpo_advantage(torch.zeros(3, dtype=F64), torch.zeros(3, dtype=torch.int64), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("eps", [0.0, -1e-6])
def test_grpo_bad_eps(eps):
    with pytest.raises(ValueError, match=r"grpo_advantage: eps must be > 0"):
        grpo_advantage(**_outcome_args(), eps=eps)


def test_reinforce_pp_baseline_needs_two_valid_tokens():
    args = _outcome_args()
    args["response_mask"] = torch.tensor([[True, False], [False, False], [False, False]])
    with pytest.raises(ValueError, match=r"reinforce_pp_baseline_advantage: response_mask has 1 valid entry.*whitening"):
        reinforce_pp_baseline_advantage(**args)


def _token_args(fn, b=2, t=3):
    z = torch.zeros(b, t, dtype=F64)
    args = dict(token_rewards=z.clone(), response_mask=torch.ones(b, t, dtype=torch.bool))
    if fn is gae_advantage:
        args["values"] = z.clone()
    return args


TOKEN_BAD = [
    (dict(token_rewards=torch.zeros(2, dtype=F64)), r"token_rewards must be a per-token tensor \[B, T\], got shape \[2\]"),
    (dict(token_rewards=torch.zeros(2, 3, dtype=torch.int64)), r"token_rewards must be floating point"),
    (dict(response_mask=torch.ones(2, 4, dtype=torch.bool)), r"response_mask has shape \[2, 4\]"),
    (dict(response_mask=torch.ones(2, dtype=torch.bool)), r"response_mask has shape \[2\]"),
    (dict(response_mask=torch.tensor([[1.0, 2.0, 0.0], [1.0, 1.0, 1.0]])), r"response_mask must hold only 0 and 1"),
    (dict(token_rewards=torch.tensor([[0.0, INF, 0.0], [0.0, 0.0, 0.0]], dtype=F64)),
     r"token_rewards holds 1 non-finite value\(s\) at valid"),
    (dict(gamma=1.5), r"gamma must lie in \[0, 1\], got 1.5"),
    (dict(gamma=-0.1), r"gamma must lie in \[0, 1\]"),
    (dict(gamma=NAN), r"gamma must lie in \[0, 1\]"),
    (dict(token_rewards=torch.zeros(0, 3, dtype=F64), response_mask=torch.ones(0, 3, dtype=torch.bool)),
     r"response_mask is empty \(B=0\)"),
    (dict(response_mask=torch.tensor([[False, False, True], [False, False, False]])),
     r"response_mask has 1 valid entry but whitening needs at least 2"),
    (dict(response_mask=torch.zeros(2, 3, dtype=torch.bool)), r"response_mask has 0 valid entries"),
]


@pytest.mark.parametrize("fn", [gae_advantage, reinforce_pp_advantage], ids=lambda f: f.__name__)
@pytest.mark.parametrize("change, match", TOKEN_BAD, ids=[m for _, m in TOKEN_BAD])
def test_token_methods_bad_input(fn, change, match):
    kwargs = _token_args(fn)
    kwargs.update(change)
    if fn is gae_advantage and "token_rewards" in change and change["token_rewards"].shape[0] == 0:
        kwargs["values"] = torch.zeros(0, 3, dtype=F64)
    with pytest.raises(ValueError, match=fn.__name__ + ": " + match):
        fn(**kwargs)


@pytest.mark.parametrize("change, match", [
    (dict(values=torch.zeros(2, 2, dtype=F64)), r"values has shape \[2, 2\] but must match \[2, 3\]"),
    (dict(values=torch.zeros(2, dtype=F64)), r"values must be a per-token tensor \[B, T\]"),
    (dict(values=torch.tensor([[0.0, 0.0, 0.0], [NAN, 0.0, 0.0]], dtype=F64)), r"values holds 1 non-finite"),
    (dict(lam=1.01), r"lam must lie in \[0, 1\]"),
    (dict(lam=-0.5), r"lam must lie in \[0, 1\]"),
])
def test_gae_bad_values_and_lambda(change, match):
    kwargs = _token_args(gae_advantage)
    kwargs.update(change)
    with pytest.raises(ValueError, match="gae_advantage: " + match):
        gae_advantage(**kwargs)


def test_gae_without_whitening_accepts_a_single_valid_token():
    # whitening off: one valid token is fine (A = r − V = 2 − 0.5 = 1.5); whitening on: refused
    r = torch.tensor([[2.0, NAN]], dtype=F64)
    v = torch.tensor([[0.5, NAN]], dtype=F64)
    m = torch.tensor([[True, False]])
    assert_near(gae_advantage(r, v, m, whiten=False).advantages, [[1.5, 0.0]])
    with pytest.raises(ValueError, match=r"gae_advantage: response_mask has 1 valid entry.*turn whitening off"):
        gae_advantage(r, v, m, whiten=True)
