"""`asyncrl.policies.sampling`: inverse-CDF sampling with one uniform per token, top-k / top-p, behaviour
log-probs, and `SamplingParams.validate`."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.policies import SamplingParams, sample_tokens
from tests.tolerances import close_tol

ONE_MINUS = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))  # largest float32 below 1


def _logits(b: int, v: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale


def _truncated(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Reference (float64): softmax(z) restricted to the top-k tokens and to the smallest prefix (by
    descending probability) whose mass reaches top_p, renormalised. One row z [V]."""
    p = torch.softmax(z.double(), -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or (rank > 0 and mass >= top_p):
            break
        keep[i] = True
        mass += p[i].item()
    q = torch.where(keep, p, torch.zeros_like(p))
    return q / q.sum()


def test_greedy_rows_return_argmax_with_softmax_logprob():
    logits = _logits(6, 50, seed=1)
    temp = torch.tensor([0.0, 1.0, 0.0, 0.5, 0.0, 2.0])
    u = torch.rand(6, generator=torch.Generator().manual_seed(2))
    argmax = logits.argmax(-1)
    greedy = temp == 0
    logp_full = torch.log_softmax(logits, -1)
    for kw in ({}, dict(top_k=torch.tensor([5, -1, 1, 3, 0, -1]), top_p=torch.tensor([0.9, 1.0, 0.5, 1.0, 0.2, 0.3]))):
        tokens, logp = sample_tokens(logits, temp, u, **kw)
        assert tokens.dtype == torch.int64 and logp.dtype == torch.float32
        assert torch.equal(tokens[greedy], argmax[greedy])
        # greedy rows report log softmax(logits) of the argmax, whatever top-k / top-p say
        torch.testing.assert_close(logp[greedy], logp_full[greedy].gather(-1, argmax[greedy, None])[:, 0])
    # greedy ignores the uniform entirely
    tokens0, _ = sample_tokens(logits, torch.zeros(6), torch.zeros(6))
    tokens1, _ = sample_tokens(logits, torch.zeros(6), torch.full((6,), ONE_MINUS))
    assert torch.equal(tokens0, argmax) and torch.equal(tokens1, argmax)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_stratified_uniforms_reproduce_softmax_exactly(temperature):
    """Inverse CDF: N evenly spaced uniforms hit token i about N·p_i times (error ≤ 1 per token)."""
    v, n = 12, 6000
    logits = _logits(1, v, seed=3).expand(n, v)
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens, logp = sample_tokens(logits, torch.full((n,), temperature), u.float())
    p = torch.softmax(logits[0].double() / temperature, -1)
    counts = torch.bincount(tokens, minlength=v).double()
    assert (counts - n * p).abs().max() <= 1.0 + 1e-6
    # and tokens come out in vocabulary order (the CDF is monotone in u)
    assert bool((tokens[1:] >= tokens[:-1]).all())
    # float32 log-softmax against float64: z / T and a log-sum-exp over v terms (≤ 2e-5; a wrong T is O(0.1))
    atol = close_tol(torch.float32, logits[0] / temperature, terms=v, depth=2)
    torch.testing.assert_close(logp.double(), torch.log(p)[tokens], atol=atol, rtol=0)


@pytest.mark.parametrize("kw", [dict(), dict(top_k=4), dict(top_p=0.7), dict(top_k=6, top_p=0.8)],
                         ids=["full", "top_k", "top_p", "top_k+top_p"])
def test_random_uniforms_match_the_truncated_distribution(kw):
    """Seeded random uniforms: a chi-square test against the (truncated) softmax at p ≈ 0.001."""
    v, n, temp = 10, 20000, 0.8
    logits = _logits(1, v, seed=4, scale=1.0).expand(n, v)
    u = torch.rand(n, generator=torch.Generator().manual_seed(5))
    top_k = torch.full((n,), kw["top_k"]) if "top_k" in kw else None
    top_p = torch.full((n,), kw["top_p"]) if "top_p" in kw else None
    if top_k is not None and top_p is None:
        top_p = torch.ones(n)
    tokens, _ = sample_tokens(logits, torch.full((n,), temp), u, top_k=top_k, top_p=top_p)
    q = _truncated(logits[0] / temp, kw.get("top_k", -1), kw.get("top_p", 1.0))
    support = q > 0
    counts = torch.bincount(tokens, minlength=v).double()
    assert counts[~support].sum() == 0, "sampled a token outside the top-k / top-p set"
    expected = n * q[support]
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    dof = int(support.sum()) - 1
    critical = {0: 0.0, 1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}[dof]
    assert chi2 <= critical + 1e-9, f"chi2={chi2:.2f} with {dof} dof"
    if kw:
        assert int(support.sum()) < v  # the filter did cut something


def test_top_k_one_and_tiny_top_p_are_greedy():
    b, v = 64, 40
    logits = _logits(b, v, seed=6)
    temp = torch.rand(b, generator=torch.Generator().manual_seed(7)) * 2 + 0.1
    u = torch.rand(b, generator=torch.Generator().manual_seed(8))
    argmax = logits.argmax(-1)
    t_k, lp_k = sample_tokens(logits, temp, u, top_k=torch.ones(b, dtype=torch.long), top_p=torch.ones(b))
    t_p, lp_p = sample_tokens(logits, temp, u, top_k=torch.full((b,), -1), top_p=torch.full((b,), 1e-6))
    assert torch.equal(t_k, argmax) and torch.equal(t_p, argmax)
    # a one-token support has probability 1
    assert torch.equal(lp_k, torch.zeros(b)) and torch.equal(lp_p, torch.zeros(b))
    # whereas plain sampling at these temperatures does not always pick the argmax
    t_full, _ = sample_tokens(logits, temp, u)
    assert not torch.equal(t_full, argmax)


def test_rows_without_filters_do_not_depend_on_other_rows_filtering():
    """A row with top_k off and top_p = 1 gets exactly the unfiltered result even when other rows of the batch
    filter (the engine passes top_k / top_p for the whole batch as soon as one request filters). Before the
    fix the filtered path walked the CDF in sorted order for every row, so a seeded request's tokens changed
    with the batch composition."""
    b, v = 32, 30
    logits = _logits(b, v, seed=9)
    temp = torch.full((b,), 0.9)
    temp[::7] = 0.0
    u = torch.rand(b, generator=torch.Generator().manual_seed(10))
    t_plain, lp_plain = sample_tokens(logits, temp, u)
    torch.testing.assert_close(lp_plain, torch.log_softmax(logits / torch.where(temp > 0, temp, 1.0)[:, None], -1)
                               .gather(-1, t_plain[:, None])[:, 0])
    filtering = torch.arange(b) % 3 == 0
    for off_k in (-1, 0):
        top_k = torch.where(filtering, 3, off_k)
        top_p = torch.where(filtering, 0.5, 1.0)
        t, lp = sample_tokens(logits, temp, u, top_k=top_k, top_p=top_p)
        assert torch.equal(t[~filtering], t_plain[~filtering])
        assert torch.equal(lp[~filtering], lp_plain[~filtering])
        t_all_off, lp_all_off = sample_tokens(logits, temp, u, top_k=torch.full((b,), off_k), top_p=torch.ones(b))
        assert torch.equal(t_all_off, t_plain) and torch.equal(lp_all_off, lp_plain)
        # the filtering rows are still filtered
        for i in torch.nonzero(filtering & (temp > 0))[:, 0].tolist():
            assert t[i] in torch.topk(logits[i], 3).indices


def test_filtered_logprobs_are_log_of_the_renormalised_truncated_distribution():
    b, v = 40, 25
    logits = _logits(b, v, seed=11)
    gen = torch.Generator().manual_seed(12)
    temp = torch.rand(b, generator=gen) * 1.5 + 0.3
    top_k = torch.randint(-1, 8, (b,), generator=gen)
    top_p = torch.rand(b, generator=gen) * 0.9 + 0.05
    top_p[::4] = 1.0
    u = torch.rand(b, generator=gen)
    tokens, logp = sample_tokens(logits, temp, u, top_k=top_k, top_p=top_p)
    for i in range(b):
        q = _truncated(logits[i] / temp[i], int(top_k[i]), float(top_p[i]))
        assert q[tokens[i]] > 0, f"row {i}: token outside the kept set"
        # float32 against float64: z / T, log-sum-exp, renormalisation over the kept set (≤ ~1e-4 here; a
        # missing renormalisation is off by -log(kept mass), O(0.1))
        atol = close_tol(torch.float32, logits[i] / temp[i], terms=v, depth=3)
        assert logp[i].item() == pytest.approx(math.log(q[tokens[i]].item()), abs=atol)
        # inverse CDF over the kept tokens in descending-probability order
        order = torch.argsort(q, descending=True)
        cdf = torch.cumsum(q[order], 0)
        expected = order[int(torch.searchsorted(cdf, torch.tensor(float(u[i]), dtype=torch.float64), right=True))]
        assert tokens[i].item() == expected.item()


def test_one_uniform_per_token_makes_rows_independent():
    """A row's token depends only on its own logits, temperature and uniform, not on the other rows."""
    logits = _logits(8, 64, seed=13)
    temp = torch.full((8,), 1.0)
    u = torch.rand(8, generator=torch.Generator().manual_seed(14))
    tokens, logp = sample_tokens(logits, temp, u)
    for i in range(8):
        t_i, lp_i = sample_tokens(logits[i:i + 1], temp[i:i + 1], u[i:i + 1])
        atol = close_tol(torch.float32, logits[i] / temp[i], terms=64, depth=2)  # another batch shape: rounding
        assert t_i.item() == tokens[i].item() and lp_i.item() == pytest.approx(logp[i].item(), abs=atol)


def test_large_vocab_extreme_uniforms():
    v = 49152
    logits = _logits(4, v, seed=15, scale=3.0)
    temp = torch.ones(4)
    for uv in (0.0, ONE_MINUS):
        u = torch.full((4,), uv)
        for kw in ({}, dict(top_k=torch.full((4,), 50), top_p=torch.full((4,), 0.95))):
            tokens, logp = sample_tokens(logits, temp, u, **kw)
            assert bool(((tokens >= 0) & (tokens < v)).all())
            assert torch.isfinite(logp).all() and (logp <= 0).all()


_LOGIT = st.one_of(st.floats(-60, 60, allow_nan=False, width=32), st.sampled_from([0.0, -1e4, 1e4, 88.0, -88.0]))
_UNIFORM = st.one_of(st.floats(0.0, 1.0, exclude_max=True, width=32), st.sampled_from([0.0, ONE_MINUS, 0.5]))


@given(data=st.data(), v=st.integers(1, 24), rows=st.integers(1, 4))
def test_sampled_token_has_positive_probability(data, v, rows):
    logits = torch.tensor(data.draw(st.lists(_LOGIT, min_size=rows * v, max_size=rows * v)),
                          dtype=torch.float32).reshape(rows, v)
    temp = torch.tensor(data.draw(st.lists(st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
                                           min_size=rows, max_size=rows)), dtype=torch.float32)
    u = torch.tensor(data.draw(st.lists(_UNIFORM, min_size=rows, max_size=rows)), dtype=torch.float32)
    filtered = data.draw(st.booleans())
    kw = {}
    if filtered:
        kw["top_k"] = torch.tensor(data.draw(st.lists(st.integers(-1, v + 2), min_size=rows, max_size=rows)))
        kw["top_p"] = torch.tensor(data.draw(st.lists(st.floats(1e-6, 1.0), min_size=rows, max_size=rows)),
                                   dtype=torch.float32)
    tokens, logp = sample_tokens(logits, temp, u, **kw)
    assert tokens.shape == logp.shape == (rows,)
    for i in range(rows):
        t = int(tokens[i])
        assert 0 <= t < v
        z = logits[i].double() / (temp[i].item() if temp[i] > 0 else 1.0)
        p = torch.softmax(z, -1)
        assert math.isfinite(logp[i].item()) and logp[i].item() <= 1e-6
        if temp[i] == 0:
            assert z[t] == z.max()
            continue
        assert p[t] > 0, f"row {i}: sampled token {t} has probability 0"
        # truncation only moves mass onto kept tokens: log q(t) >= log p(t)
        assert logp[i].item() >= math.log(p[t].item()) - 1e-4
        if filtered:
            k, top_p = int(kw["top_k"][i]), float(kw["top_p"][i])
            higher = z > z[t]
            if k > 0:
                assert int(higher.sum()) < k, "token outside the top-k"
            assert p[higher].sum().item() < top_p + 1e-5, "token outside the top-p nucleus"


def test_sampling_params_validate_names_the_field():
    SamplingParams().validate(256)
    SamplingParams(temperature=0, top_k=0, top_p=1.0, stop_token_ids=(0, 255)).validate(256)
    bad = [(dict(n=0), "n"), (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
           (dict(top_k=-5), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
           (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop_token_ids=(256,)), "stop_token_ids")]
    for kw, field in bad:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
            SamplingParams(**kw).validate(256)
    assert SamplingParams(top_k=3).filtered and SamplingParams(top_p=0.9).filtered
    assert not SamplingParams(top_k=-1).filtered and not SamplingParams(top_k=0).filtered
