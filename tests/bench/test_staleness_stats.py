"""The staleness experiment's statistics (asyncrl_bench/staleness_stats.py) and its analysis script
(scripts/staleness_analysis.py): the t and F tails against closed forms and tabulated quantiles, the fits, the
partial F-test and TOST on hand-computed examples, hypothesis properties of all of them, and the script on a tiny
synthetic grid."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from asyncrl_bench.staleness_stats import (
    betainc, bootstrap_ci, bootstrap_diff_ci, drift_fit, f_sf, hinge_fit, lag_increment, t_cdf, t_ppf, t_sf, tost,
)
from scripts import staleness_analysis
from tests.run_helpers import ROOT
from tests.timing import limit

finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False)


# ------------------------------------------------------------------------------------------ distributions
def _t_cdf_closed(t: float, df: int) -> float:
    """Student's t CDF in closed form for ν = 1, 2, 4 (Cauchy; ½ + t / (2√(2 + t²)); the ν = 4 polynomial)."""
    if df == 1:
        return 0.5 + math.atan(t) / math.pi
    if df == 2:
        return 0.5 + t / (2 * math.sqrt(2 + t * t))
    a = t / math.sqrt(1 + t * t / 4)
    return 0.5 + 0.375 * a * (1 - t * t / (12 * (1 + t * t / 4)))


@pytest.mark.parametrize("df", [1, 2, 4])
@pytest.mark.parametrize("t", [-30.0, -2.5, -0.4, 0.0, 0.7, 3.0, 12.0])
def test_the_t_cdf_matches_its_closed_forms(t, df):
    assert t_cdf(t, df) == pytest.approx(_t_cdf_closed(t, df), abs=1e-14)


def test_t_quantiles_match_the_tables():
    # two-sided 5 % and one-sided 5 % critical values of the t table (e.g. NIST/SEMATECH e-Handbook §1.3.6.7.2,
    # given to 3 decimals); ν = 5 also in closed form: t_{0.95,5} = 2.0150483733 solves the ν = 5 CDF
    # ½ + (θ + sinθ cosθ (1 + ⅔ cos²θ)) / π = 0.95 with θ = atan(t / √5)
    table = {(0.975, 1): 12.706, (0.975, 10): 2.228, (0.975, 30): 2.042, (0.95, 5): 2.015, (0.95, 20): 1.725}
    for (q, df), value in table.items():
        assert t_ppf(q, df) == pytest.approx(value, abs=5e-4), (q, df)
    theta = math.atan(t_ppf(0.95, 5) / math.sqrt(5))
    assert 0.5 + (theta + math.sin(theta) * math.cos(theta) * (1 + 2 / 3 * math.cos(theta) ** 2)) / math.pi == \
        pytest.approx(0.95, abs=1e-13)
    assert t_ppf(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-12)  # Cauchy: tan(π (q − ½))
    assert t_ppf(0.975, 1e7) == pytest.approx(1.959963985, abs=1e-6)  # → the normal's 97.5 % point
    assert t_ppf(0.5, 3) == pytest.approx(0.0, abs=1e-12)


def test_f_tails_match_closed_forms_and_the_tables():
    # P(F_{2,d} > f) = (1 + 2f/d)^(−d/2); P(F_{d,2} > f) = 1 − (d f / (2 + d f))^(d/2); F_{1,d} = T_d²
    for f in (0.1, 1.0, 3.5, 20.0):
        assert f_sf(f, 2, 7) == pytest.approx((1 + 2 * f / 7) ** -3.5, rel=1e-12)
        assert f_sf(f, 3, 2) == pytest.approx(1 - (3 * f / (2 + 3 * f)) ** 1.5, rel=1e-12)
        assert f_sf(f, 1, 4) == pytest.approx(2 * t_sf(math.sqrt(f), 4), rel=1e-12)
    # 5 % points of the F table (NIST/SEMATECH §1.3.6.7.3): F(1, 10) = 4.965, F(2, 20) = 3.493, F(4, 30) = 2.690
    for (d1, d2), crit in {(1, 10): 4.965, (2, 20): 3.493, (4, 30): 2.690}.items():
        assert f_sf(crit, d1, d2) == pytest.approx(0.05, abs=2e-4), (d1, d2)
    assert f_sf(0.0, 3, 5) == 1.0 and f_sf(math.inf, 3, 5) == 0.0


def test_the_incomplete_beta_at_its_edges_and_closed_forms():
    # I_x(a, 1) = x^a, I_x(1, b) = 1 − (1 − x)^b, I_x(2, 3) = 6x² − 8x³ + 3x⁴ (at 0.4: 0.96 − 0.512 + 0.0768)
    assert betainc(2.5, 1, 0.3) == pytest.approx(0.3 ** 2.5, rel=1e-13)
    assert betainc(1, 4.5, 0.2) == pytest.approx(1 - 0.8 ** 4.5, rel=1e-13)
    assert betainc(2, 3, 0.4) == pytest.approx(0.5248, rel=1e-13)
    assert (betainc(3, 4, 0.0), betainc(3, 4, 1.0)) == (0.0, 1.0)
    assert betainc(0.5, 0.5, 0.5) == pytest.approx(0.5, abs=1e-14)  # the arcsine law's median
    for bad in ((0, 1, 0.5), (1, 1, 1.5)):
        with pytest.raises(ValueError, match="betainc"):
            betainc(*bad)


@settings(max_examples=60, deadline=None)
@given(t=st.floats(-50, 50), df=st.floats(0.5, 500))
def test_t_tails_add_to_one_and_are_symmetric(t, df):
    assert t_sf(t, df) + t_cdf(t, df) == pytest.approx(1.0, abs=1e-12)
    assert t_sf(t, df) == pytest.approx(t_cdf(-t, df), abs=1e-15)
    assert 0.0 <= t_sf(t, df) <= 1.0
    assert t_cdf(t + 0.5, df) >= t_cdf(t, df)


@settings(max_examples=40, deadline=None)
@given(q=st.floats(0.001, 0.999), df=st.floats(1, 200))
def test_the_t_quantile_inverts_the_cdf(q, df):
    assert t_cdf(t_ppf(q, df), df) == pytest.approx(q, abs=1e-10)


# ------------------------------------------------------------------------------------------ the drift law
def test_a_fit_by_hand_and_against_polyfit():
    # x 0..3, y 1, 3, 2, 5: x̄ 1.5, ȳ 2.75, S_xx 5, S_xy 5.5, S_yy 8.75 -> slope 1.1, intercept 2.75 − 1.65 = 1.1,
    # R² = 5.5² / (5 · 8.75) = 30.25 / 43.75
    fit = drift_fit([1, 3, 2, 5], [0, 1, 2, 3])
    assert fit.slope == pytest.approx(1.1) and fit.intercept == pytest.approx(1.1) and fit.n == 4
    assert fit.r2 == pytest.approx(30.25 / 43.75)
    rng = np.random.default_rng(5)
    x = rng.normal(size=40)
    y = 0.7 - 0.05 * x + rng.normal(scale=0.02, size=40)
    slope, intercept = np.polyfit(x, y, 1)
    fit = drift_fit(y, x)
    assert (fit.slope, fit.intercept) == pytest.approx((slope, intercept), rel=1e-10)
    assert fit.r2 == pytest.approx(np.corrcoef(x, y)[0, 1] ** 2, rel=1e-10)


def test_a_hinge_is_found_where_accuracy_starts_to_fall():
    """Flat at 0.75 up to log D = −3, then −0.1 per e-fold: the knee lies between the drifts around −3, the fit is
    exact, and the line's R² on the same points is lower (the pilot's shape)."""
    x = np.array([-6.0, -5.0, -4.0, -3.5, -2.5, -2.0, -1.0, 0.0])
    y = 0.75 - 0.1 * np.maximum(x + 3.0, 0.0)
    hinge = hinge_fit(y, x)
    assert -3.5 < hinge.knee < -2.5 and hinge.r2 == pytest.approx(1.0) and hinge.adjusted_r2 == pytest.approx(1.0)
    assert hinge.slope == pytest.approx(-0.1) and hinge.plateau == pytest.approx(0.75)
    assert drift_fit(y, x).r2 < 0.9
    with pytest.raises(ValueError, match="3"):
        hinge_fit([0.5, 0.6, 0.7, 0.8], [1.0, 1.0, 2.0, 2.0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-8, 0), st.floats(0, 1)), min_size=5, max_size=30))
def test_a_hinge_fits_at_least_as_well_as_a_flat_line_and_its_r2_is_a_share(pairs):
    x, y = (np.array(c) for c in zip(*pairs))
    assume(np.ptp(y) > 1e-6 and len(np.unique(x)) >= 3)
    hinge = hinge_fit(y, x)
    assert 0.0 <= hinge.r2 <= 1.0 and hinge.adjusted_r2 <= hinge.r2 + 1e-12
    assert x.min() < hinge.knee < x.max()


def test_a_fit_refuses_what_has_no_answer():
    with pytest.raises(ValueError, match="log_drift is 1.0 in every run"):
        drift_fit([0.5, 0.6, 0.7], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="accuracy is 0.5 in every run"):
        drift_fit([0.5, 0.5, 0.5], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="one value per run in every column; got accuracy 3, log_drift 4"):
        drift_fit([0.5, 0.6, 0.7], [1.0, 2.0, 3.0, 4.0])
    with pytest.raises(ValueError, match="NaN or infinite"):
        drift_fit([0.5, 0.6, 0.7], [1.0, -math.inf, 3.0])  # log of a zero drift
    with pytest.raises(ValueError, match="needs at least 3"):
        drift_fit([0.5, 0.6], [1.0, 2.0])


@settings(max_examples=60, deadline=None)
@given(pairs=st.lists(st.tuples(finite, finite), min_size=3, max_size=30))
def test_r2_lies_in_zero_to_one_and_ignores_the_runs_order(pairs):
    y, x = zip(*pairs)
    assume(np.ptp(x) > 1e-3 and np.ptp(y) > 1e-3)
    fit = drift_fit(y, x)
    assert 0.0 <= fit.r2 <= 1.0 and fit.n == len(pairs)
    again = drift_fit(y[::-1], x[::-1])
    assert again.slope == pytest.approx(fit.slope, rel=1e-9, abs=1e-12)
    assert again.r2 == pytest.approx(fit.r2, rel=1e-9, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(x=st.lists(st.integers(-50, 50), min_size=3, max_size=20, unique=True),
       slope=st.floats(-2, 2), intercept=st.floats(-1, 1))
def test_an_exactly_linear_relation_is_fitted_exactly(x, slope, intercept):
    x = [v / 10 for v in x]
    assume(abs(slope) > 1e-3)
    fit = drift_fit([intercept + slope * v for v in x], x)
    assert fit.slope == pytest.approx(slope, rel=1e-9)
    assert fit.intercept == pytest.approx(intercept, rel=1e-9, abs=1e-12)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)


def test_the_lag_increment_by_hand():
    # (log D, lag) a 2 × 2 design, accuracy 0, 1, 1, 3 at (0,0), (1,0), (0,1), (1,1); ȳ 1.25, SS_tot 4.75.
    # log D alone: means 0.5 and 2 -> SS_res 0.25 + 0.25 + 1 + 1 = 2.5. Adding lag leaves the interaction contrast
    # 0 − 1 − 1 + 3 = 1 as ±¼ on each point -> SS_res 0.25; lag's coefficient 2 − 0.5 = 1.5.
    # F = (2.5 − 0.25) / (0.25 / (4 − 3)) = 9 on (1, 1) df: p = P(|T_1| > 3) = 1 − 2 atan(3) / π
    inc = lag_increment([0, 1, 1, 3], [0, 1, 0, 1], [0, 0, 1, 1])
    assert inc.r2_drift == pytest.approx(1 - 2.5 / 4.75) and inc.r2_both == pytest.approx(1 - 0.25 / 4.75)
    assert inc.delta_r2 == pytest.approx(2.25 / 4.75) and inc.f_stat == pytest.approx(9.0)
    assert inc.p_value == pytest.approx(1 - 2 * math.atan(3) / math.pi) and inc.lag_slope == pytest.approx(1.5)
    assert inc.n == 4


def test_the_partial_f_is_the_square_of_the_lags_t_statistic():
    rng = np.random.default_rng(11)
    log_d, lag = rng.normal(size=30), rng.integers(0, 9, size=30).astype(float)
    y = 0.6 - 0.04 * log_d - 0.003 * lag + rng.normal(scale=0.01, size=30)
    inc = lag_increment(y, log_d, lag)
    design = np.column_stack([np.ones(30), log_d, lag])
    coef, ssr = np.linalg.lstsq(design, y, rcond=None)[:2]
    se = math.sqrt(ssr[0] / 27 * np.linalg.inv(design.T @ design)[2, 2])
    assert inc.f_stat == pytest.approx((coef[2] / se) ** 2, rel=1e-9)
    assert inc.p_value == pytest.approx(2 * t_sf(abs(coef[2] / se), 27), rel=1e-9)
    assert inc.r2_drift == pytest.approx(drift_fit(y, log_d).r2, rel=1e-9)
    with pytest.raises(ValueError, match="lag is constant or a linear function of log_drift"):
        lag_increment(y, log_d, 2 * log_d + 1)
    with pytest.raises(ValueError, match="lag is constant"):
        lag_increment(y, log_d, np.full(30, 4.0))


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(finite, finite, st.integers(0, 8)), min_size=5, max_size=25), seed=st.integers(0, 9))
def test_the_lag_increment_is_a_probability_and_ignores_the_runs_order(rows, seed):
    y, x, lag = (np.array(c, dtype=float) for c in zip(*rows))
    assume(np.ptp(y) > 1e-3 and np.ptp(x) > 1e-3)
    assume(np.linalg.matrix_rank(np.column_stack([np.ones_like(x), x, lag])) == 3)
    inc = lag_increment(y, x, lag)
    assert 0.0 <= inc.p_value <= 1.0 and inc.f_stat >= 0 and inc.delta_r2 >= -1e-9
    assert inc.r2_drift <= inc.r2_both + 1e-9
    order = np.random.default_rng(seed).permutation(len(y))
    again = lag_increment(y[order], x[order], lag[order])
    assert again.p_value == pytest.approx(inc.p_value, rel=1e-6, abs=1e-9)


# ------------------------------------------------------------------------------------------ equivalence
def test_tost_by_hand():
    # a 0.70, 0.72, 0.74 and b 0.71, 0.73, 0.75: diff −0.01, s² 0.0004 each, se² = 2 · 0.0004 / 3, Welch ν 4.
    # margin 0.05: p = max(P(T_4 > 0.04 / se), P(T_4 < −0.06 / se)) = max(P(T_4 > √6), P(T_4 < −√13.5))
    a, b = [0.70, 0.72, 0.74], [0.71, 0.73, 0.75]
    se = math.sqrt(2 * 0.0004 / 3)
    result = tost(a, b, margin=0.05)
    assert result.diff == pytest.approx(-0.01) and result.df == pytest.approx(4.0)
    p = max(1 - _t_cdf_closed(math.sqrt(6), 4), _t_cdf_closed(-math.sqrt(13.5), 4))
    assert result.p_value == pytest.approx(p, rel=1e-9) and result.p_value == pytest.approx(0.035242, abs=1e-6)
    assert result.equivalent
    half = 2.131847 * se  # t_{0.95, 4} of the table: the 90 % interval
    assert (result.ci_low, result.ci_high) == pytest.approx((-0.01 - half, -0.01 + half), abs=1e-6)
    # margin 0.03: the 90 % interval [−0.0448, 0.0248] leaves (−0.03, 0.03); p = P(T_4 > √1.5) = 0.143932
    narrow = tost(a, b, margin=0.03)
    assert not narrow.equivalent and narrow.p_value == pytest.approx(0.143932, abs=1e-6)
    flat = tost([0.5, 0.5], [0.52, 0.52], margin=0.03)  # no variance: the difference is exact
    assert flat.equivalent and flat.p_value == 0.0 and flat.ci_low == flat.ci_high == pytest.approx(-0.02)
    with pytest.raises(ValueError, match="b has 1 values; needs at least 2"):
        tost([0.1, 0.2], [0.3])
    with pytest.raises(ValueError, match="margin = 0"):
        tost([0.1, 0.2], [0.3, 0.4], margin=0)


values = st.lists(st.floats(0, 1), min_size=2, max_size=20)


@settings(max_examples=60, deadline=None)
@given(a=values)
def test_tost_of_identical_samples_is_equivalent_for_a_wide_margin_and_not_a_tiny_one(a):
    assume(np.ptp(a) > 1e-6)
    se = math.sqrt(2 * np.var(a, ddof=1) / len(a))
    assert tost(a, a, margin=10 * se * t_ppf(0.95, 2 * (len(a) - 1))).equivalent
    tiny = tost(a, a, margin=0.01 * se)
    assert not tiny.equivalent and tiny.p_value > 0.4 and tiny.diff == 0.0


@settings(max_examples=40, deadline=None)
@given(a=values, b=values, seed=st.integers(0, 99))
def test_tost_agrees_with_its_interval_and_ignores_the_runs_order(a, b, seed):
    result = tost(a, b)
    if math.isfinite(result.df):
        inside = -0.03 < result.ci_low and result.ci_high < 0.03
        if abs(result.p_value - 0.05) > 1e-9:
            assert inside == result.equivalent
    rng = np.random.default_rng(seed)
    again = tost(rng.permutation(a), rng.permutation(b))
    assert again.p_value == pytest.approx(result.p_value, abs=1e-9)
    assert again.diff == pytest.approx(result.diff, abs=1e-12)


# ------------------------------------------------------------------------------------------ bootstrap
def test_bootstrap_intervals_by_hand_and_by_the_normal_approximation():
    # two values 0 and 1: a resample's mean is 0, ½, 1 with probability ¼, ½, ¼, so the 2.5 % and 97.5 % points
    # are 0 and 1
    assert tuple(bootstrap_ci([0.0, 1.0])) == (0.0, 1.0)
    assert tuple(bootstrap_diff_ci([0.8, 0.8], [0.5])) == pytest.approx((0.3, 0.3))
    rng = np.random.default_rng(3)
    x = rng.normal(0.7, 0.05, size=400)
    low, high = bootstrap_ci(x)
    half = 1.96 * x.std(ddof=1) / math.sqrt(len(x))
    assert (low, high) == pytest.approx((x.mean() - half, x.mean() + half), abs=0.1 * half)
    y = rng.normal(0.6, 0.05, size=400)
    low, high = bootstrap_diff_ci(x, y)
    half = 1.96 * math.sqrt(x.var(ddof=1) / 400 + y.var(ddof=1) / 400)
    assert (low, high) == pytest.approx((x.mean() - y.mean() - half, x.mean() - y.mean() + half), abs=0.1 * half)
    assert bootstrap_ci(x, stat=np.median, seed=4) == bootstrap_ci(x, stat=np.median, seed=4)  # seeded
    with pytest.raises(ValueError, match="level = 1.5"):
        bootstrap_ci(x, level=1.5)


@settings(max_examples=40, deadline=None)
@given(v=st.lists(st.floats(0, 1), min_size=1, max_size=30), seed=st.integers(0, 99))
def test_bootstrap_contains_the_mean_ignores_the_order_and_narrows_with_more_runs(v, seed):
    low, high = bootstrap_ci(v, n=2000, seed=seed)
    mean = float(np.mean(v))
    assert low - 1e-12 <= mean <= high + 1e-12
    shuffled = np.random.default_rng(seed).permutation(v)
    assert tuple(bootstrap_ci(shuffled, n=2000, seed=seed)) == (low, high)
    if np.ptp(v) > 1e-3:
        low16, high16 = bootstrap_ci(np.tile(v, 16), n=2000, seed=seed)  # 16 × the runs: about ¼ as wide
        assert high16 - low16 < high - low
    d_low, d_high = bootstrap_diff_ci(v, v[::-1], n=2000, seed=seed)
    assert d_low <= 1e-12 and d_high >= -1e-12  # a sample against itself: the interval holds 0


# ------------------------------------------------------------------------------------------ the script
def _run(cell: str, seed: int, accuracy: float, drift: float | None, lag_mean: float, forced: float) -> dict:
    curve = [{"behaviour_kl": drift, "behaviour_k1": None if drift is None else drift / 2}]
    return {"cell": cell, "seed": seed, "forced_lag": forced, "lag_mean": lag_mean, "eval": {"accuracy": accuracy},
            "drift_kl": drift, "drift_k1": None if drift is None else drift / 2, "curve": curve}


def _grid(tmp_path, name: str, lag: float, lr: float, drift_of) -> str:
    """A results.json of sync and three lag cells × 3 seeds whose accuracy is 0.6 − 0.05 log10 D plus seed noise."""
    runs = []
    for seed, noise in enumerate((-0.004, 0.0, 0.004)):
        runs.append(_run("sync", seed, 0.78 + noise, 1e-6, 0.0, 0.0))
        for cell, scale in (("lag-naive", 1.0), ("lag-ignore-mu", 8.0), ("lag-opsm", 0.7)):
            d = drift_of(lag) * scale * (1 + 0.1 * seed)
            runs.append(_run(cell, seed, 0.6 - 0.05 * math.log10(d) + noise, d, lag * (0.9 + 0.05 * seed), lag))
    out = tmp_path / name
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"args": {"lag": lag, "lr": lr, "steps": 96}, "runs": runs}))
    return str(out)


def test_the_analysis_of_a_synthetic_grid(tmp_path):
    dirs = [_grid(tmp_path, f"lag{lag}", lag, 1e-5, lambda lag: 0.002 * lag) for lag in (2.0, 4.0, 8.0)]
    result = staleness_analysis.analyse(staleness_analysis.AnalysisArgs(dirs=tuple(dirs), out=str(tmp_path / "a"),
                                                                        bootstrap=500))
    sync = [r for r in result["runs"] if r["cell"] == "sync"]
    assert len(sync) == 3 and all(r["runs"] == 3 for r in sync)  # one per seed, pooled over the directories
    law = result["drift_law"]
    assert law["points"] == 27 and law["fits"]["every run"]["r2"] > 0.95  # the accuracy is a function of D
    assert law["fits"]["every run"]["slope"] == pytest.approx(-0.05 / math.log(10), rel=0.1)
    assert law["lag_mean"]["p_value"] > 0.05  # lag adds nothing once D is known
    tost_rows = {(r["lag"], r["cell"]): r for r in result["equivalence"]}
    assert tost_rows[(8.0, "lag-ignore-mu")]["equivalent"] is False and tost_rows[(2.0, "lag-naive")]["n"] == 3
    goals = {g["goal"]: g for g in result["goals"]}
    assert goals["G3"]["passed"] is None and "no runs at lr 3e-05, lag 8" in goals["G3"]["measured"]
    assert goals["G5"]["passed"] is False and "+0.045" in goals["G5"]["measured"]  # 8 × D costs 0.05 log10 8
    text = (tmp_path / "a" / "staleness_analysis.md").read_text()
    assert "## 1. The drift law" in text and "| every run | 27 |" in text and "| 1e-05 | 8 | lag-naive | 3 |" in text
    assert json.loads((tmp_path / "a" / "staleness_analysis.json").read_text())["goals"][0]["goal"] == "G1"


@pytest.mark.e2e
def test_the_script_runs_from_the_command_line(tmp_path):
    dirs = [_grid(tmp_path, f"g{lag}", lag, 3e-5, lambda lag: 0.004 * lag) for lag in (2.0, 8.0)]
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "scripts.staleness_analysis", *dirs, "--out", str(out),
                           "--bootstrap", "200"], cwd=ROOT, capture_output=True, text=True, timeout=limit(120),
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "# Staleness: the analysis" in proc.stdout and (out / "staleness_analysis.md").is_file()
    assert (out / "staleness_analysis.png").stat().st_size > 10_000
    missing = subprocess.run([sys.executable, "-m", "scripts.staleness_analysis", str(tmp_path / "none")],
                             cwd=ROOT, capture_output=True, text=True, timeout=limit(60),
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert missing.returncode != 0 and "no results.json" in missing.stderr
