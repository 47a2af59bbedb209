"""The statistics of the staleness experiment (docs/staleness.md, "The experiment"): pure functions of per-run
values (one float per run, 1-D), no I/O; `scripts/staleness_analysis.py` reads the grids and calls them.

    fit = drift_fit(accuracy, np.log(drift))        # OLS of accuracy on log D: slope, intercept, R², n
    inc = lag_increment(accuracy, np.log(drift), lag)   # does lag explain more once drift is known? (partial F)
    eq = tost(accuracy_async, accuracy_sync, margin=0.03)   # equivalent within ±margin? (two one-sided Welch t)
    low, high = bootstrap_ci(values)                 # percentile interval of the mean over resampled runs
    low, high = bootstrap_diff_ci(a, b)              # ... of mean(a) − mean(b), each group resampled on its own

scipy is not a dependency, so the F and t tails come from the regularized incomplete beta function `betainc`
(Lentz's continued fraction, Numerical Recipes §6.4), which tests/bench/test_staleness_stats.py checks against
closed forms and tabulated quantiles:

    P(T_ν > t)      = ½ · I_{ν/(ν+t²)}(ν/2, ½)          for t ≥ 0 (Student's t, ν > 0 need not be an integer)
    P(F_{d1,d2} > f) = I_{d2/(d2+d1·f)}(d2/2, d1/2)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["Fit", "Hinge", "Increment", "Tost", "Interval", "drift_fit", "hinge_fit", "lag_increment", "tost", "bootstrap_ci",
           "bootstrap_diff_ci", "betainc", "t_sf", "t_cdf", "t_ppf", "f_sf"]

_TINY = 1e-300  # Lentz's guard against a zero denominator
_EPS = 1e-15  # the continued fraction's relative convergence
_MAX_TERMS = 100_000  # enough for shape parameters up to ~1e9 (the terms needed grow as their square root)


# ------------------------------------------------------------------------------------------ distributions
def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) = B(x; a, b) / B(a, b), for a, b > 0 and x in [0, 1]."""
    if not 0 <= x <= 1:
        raise ValueError(f"betainc: x = {x} must lie in [0, 1]")
    return _ibeta(a, b, x, 1.0 - x)


def _ibeta(a: float, b: float, x: float, y: float) -> float:
    """I_x(a, b) with y = 1 − x given as well, computed by the caller without cancellation (for t near 0, x =
    ν / (ν + t²) rounds to 1 but y = t² / (ν + t²) keeps t). The continued fraction converges fast for
    x < (a + 1) / (a + b + 2); above that the symmetry I_x(a, b) = 1 − I_y(b, a) is used, so a small tail is
    computed directly, never as 1 minus something."""
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc: a = {a} and b = {b} must be > 0")
    if x <= 0 or y <= 0:
        return 0.0 if x <= 0 else 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, y) / b


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (Numerical Recipes' betacf), by the modified Lentz method."""
    def guarded(v: float) -> float:
        return _TINY if abs(v) < _TINY else v

    c, d = 1.0, 1.0 / guarded(1.0 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, _MAX_TERMS):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 / guarded(1.0 + even * d)
        c = guarded(1.0 + even / c)
        h *= d * c
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 / guarded(1.0 + odd * d)
        c = guarded(1.0 + odd / c)
        h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"betainc: the continued fraction for a = {a}, b = {b}, x = {x} did not converge")


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` > 0 degrees of freedom (a Welch df need not be an integer)."""
    if not df > 0:
        raise ValueError(f"t_sf: df = {df} must be > 0")
    if math.isnan(t):
        raise ValueError("t_sf: t is NaN")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    t2 = t * t
    tail = 0.5 * _ibeta(df / 2, 0.5, df / (df + t2), t2 / (df + t2))  # P(T > |t|)
    return tail if t > 0 else 1.0 - tail


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with `df` degrees of freedom."""
    return t_sf(-t, df)


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t (q in (0, 1)): the t with P(T ≤ t) = q, by bisection on `t_cdf`."""
    if not 0 < q < 1:
        raise ValueError(f"t_ppf: q = {q} must lie in (0, 1)")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > q:
        lo *= 2
    while t_cdf(hi, df) < q:
        hi *= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return 0.5 * (lo + hi)


def f_sf(f: float, d1: float, d2: float) -> float:
    """P(F > f) for the F distribution with (d1, d2) > 0 degrees of freedom."""
    if not (d1 > 0 and d2 > 0):
        raise ValueError(f"f_sf: d1 = {d1} and d2 = {d2} must be > 0")
    if math.isnan(f):
        raise ValueError("f_sf: f is NaN")
    if f <= 0:
        return 1.0
    if math.isinf(f):
        return 0.0
    return _ibeta(d2 / 2, d1 / 2, d2 / (d2 + d1 * f), d1 * f / (d2 + d1 * f))


# ------------------------------------------------------------------------------------------ checks
def _sample(fn: str, name: str, values: Sequence[float], at_least: int) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{fn}: {name} must be 1-D, one value per run; got shape {tuple(x.shape)}")
    if len(x) < at_least:
        raise ValueError(f"{fn}: {name} has {len(x)} values; needs at least {at_least}")
    if not np.isfinite(x).all():
        raise ValueError(f"{fn}: {name} has a NaN or infinite value (a drift of 0 has no log: leave such runs out)")
    return x


def _paired(fn: str, at_least: int, **columns: Sequence[float]) -> list[np.ndarray]:
    arrays = [_sample(fn, name, values, at_least) for name, values in columns.items()]
    if len({len(a) for a in arrays}) > 1:
        shapes = ", ".join(f"{name} {len(a)}" for name, a in zip(columns, arrays))
        raise ValueError(f"{fn}: one value per run in every column; got {shapes}")
    return arrays


def _not_constant(fn: str, name: str, x: np.ndarray, why: str) -> None:
    if np.ptp(x) == 0:
        raise ValueError(f"{fn}: {name} is {x[0]} in every run: {why}")


# ------------------------------------------------------------------------------------------ the drift law
class Fit(NamedTuple):
    slope: float  # accuracy per unit of log drift (per factor e of D)
    intercept: float  # the accuracy the line gives at log D = 0 (D = 1 nat a token)
    r2: float  # the share of the accuracy's variance the line explains, in [0, 1]
    n: int  # runs (or cells) fitted


def drift_fit(accuracy: Sequence[float], log_drift: Sequence[float]) -> Fit:
    """Ordinary least squares of held-out accuracy on the log of the drift: accuracy ≈ intercept + slope · log D.

    Args:
      accuracy: [n] one held-out accuracy per run (or per cell, its mean), n ≥ 3.
      log_drift: [n] log of the same runs' drift D (run-mean KL(μ‖π_θ)), not all equal.
    Returns a `Fit`; R² = S_xy² / (S_xx · S_yy), the squared correlation (the same as 1 − SS_res / SS_tot for a
    line with an intercept). Raises ValueError when every accuracy or every drift is the same (no R²)."""
    fn = "drift_fit"
    y, x = _paired(fn, 3, accuracy=accuracy, log_drift=log_drift)
    _not_constant(fn, "log_drift", x, "a line needs at least two drifts")
    _not_constant(fn, "accuracy", y, "there is no variance to explain (R² undefined)")
    dx, dy = x - x.mean(), y - y.mean()
    sxx, sxy, syy = float(dx @ dx), float(dx @ dy), float(dy @ dy)
    slope = sxy / sxx
    return Fit(slope=slope, intercept=float(y.mean() - slope * x.mean()),
               r2=min(max(sxy * sxy / (sxx * syy), 0.0), 1.0), n=len(y))


class Hinge(NamedTuple):
    knee: float  # log D where accuracy starts to fall
    plateau: float  # the accuracy at and below the knee
    slope: float  # accuracy per unit of log D past the knee
    r2: float  # share of the accuracy's variance explained (3 parameters: compare with adjusted_r2)
    adjusted_r2: float  # 1 − (1 − R²)(n − 1)/(n − 3): R² charged for the knee and slope
    n: int


def hinge_fit(accuracy: Sequence[float], log_drift: Sequence[float]) -> Hinge:
    """Least squares of accuracy on a flat line that bends at a knee: accuracy ≈ plateau + slope · max(log D − knee, 0).
    The knee is searched over the midpoints between distinct log drifts (each candidate's plateau and slope by OLS;
    the smallest residual wins), so at least one run lies on each side of it. An exploratory model, not the
    pre-registered line (`drift_fit`): it was chosen after the pilot's plot showed accuracy flat below a drift.

    Args: accuracy, log_drift: [n] per run (or cell mean), n ≥ 4, at least three distinct drifts.
    Raises ValueError when accuracy is constant or fewer than three drifts differ."""
    fn = "hinge_fit"
    y, x = _paired(fn, 4, accuracy=accuracy, log_drift=log_drift)
    _not_constant(fn, "accuracy", y, "there is no variance to explain (R² undefined)")
    distinct = np.unique(x)
    if len(distinct) < 3:
        raise ValueError(f"{fn}: {len(distinct)} distinct drifts; a knee between a flat and a sloped part needs 3")
    best = None
    for knee in (distinct[:-1] + distinct[1:]) / 2:
        ssr, coef = _ols_ssr(y, [np.maximum(x - knee, 0.0)])
        if best is None or ssr < best[0]:
            best = (ssr, float(knee), coef)
    ssr, knee, coef = best
    n, sst = len(y), float(((y - y.mean()) ** 2).sum())
    r2 = min(max(1 - ssr / sst, 0.0), 1.0)
    return Hinge(knee=knee, plateau=float(coef[0]), slope=float(coef[1]), r2=r2,
                 adjusted_r2=1 - (1 - r2) * (n - 1) / (n - 3), n=n)


class Increment(NamedTuple):
    r2_drift: float  # R² of accuracy ~ 1 + log D
    r2_both: float  # R² of accuracy ~ 1 + log D + lag
    delta_r2: float  # r2_both − r2_drift: what lag adds
    f_stat: float  # the partial F statistic of the lag term, on (1, n − 3) degrees of freedom
    p_value: float  # P(F_{1, n−3} > f_stat): small says lag matters beyond drift
    lag_slope: float  # the lag's coefficient in the larger model (accuracy per version of lag at equal drift)
    n: int


def _ols_ssr(y: np.ndarray, columns: list[np.ndarray]) -> tuple[float, np.ndarray]:
    """Residual sum of squares and coefficients of y on an intercept and `columns`."""
    design = np.column_stack([np.ones_like(y), *columns])
    coef = np.linalg.lstsq(design, y, rcond=None)[0]
    residual = y - design @ coef
    return float(residual @ residual), coef


def lag_increment(accuracy: Sequence[float], log_drift: Sequence[float], lag: Sequence[float]) -> Increment:
    """Does the version lag explain accuracy once the drift is known? Nested OLS, accuracy ~ 1 + log D against
    accuracy ~ 1 + log D + lag, and the partial F-test of the added term:

        F = (SS_res(drift) − SS_res(both)) / (SS_res(both) / (n − 3)),   p = P(F_{1, n−3} > F)   (`f_sf`)

    Args:
      accuracy, log_drift, lag: [n] per run, n ≥ 4 (the larger model needs a residual degree of freedom); lag
        the run's version lag (e.g. its mean over steps).
    Raises ValueError when accuracy is constant, or lag is constant or a linear function of log D (then the
    larger model is the smaller one and the test says nothing)."""
    fn = "lag_increment"
    y, x, lag_ = _paired(fn, 4, accuracy=accuracy, log_drift=log_drift, lag=lag)
    _not_constant(fn, "accuracy", y, "there is no variance to explain")
    _not_constant(fn, "log_drift", x, "a line needs at least two drifts")
    both = np.column_stack([np.ones_like(y), x, lag_])
    if np.linalg.matrix_rank(both) < 3:
        raise ValueError(f"{fn}: lag is constant or a linear function of log_drift over these {len(y)} runs: the "
                         "models are the same; it needs runs whose lag and drift vary apart")
    n = len(y)
    sst = float(((y - y.mean()) ** 2).sum())
    ssr_drift, _ = _ols_ssr(y, [x])
    ssr_both, coef = _ols_ssr(y, [x, lag_])
    gained = max(ssr_drift - ssr_both, 0.0)  # never below 0 but for round-off: the larger model nests the smaller
    if ssr_both > 0:
        f_stat = gained / (ssr_both / (n - 3))
    else:  # the larger model fits exactly
        f_stat = math.inf if gained > 0 else 0.0
    r2_drift, r2_both = 1 - ssr_drift / sst, 1 - ssr_both / sst
    return Increment(r2_drift=r2_drift, r2_both=r2_both, delta_r2=r2_both - r2_drift, f_stat=f_stat,
                     p_value=f_sf(f_stat, 1, n - 3), lag_slope=float(coef[2]), n=n)


# ------------------------------------------------------------------------------------------ equivalence
class Tost(NamedTuple):
    diff: float  # mean(a) − mean(b)
    ci_low: float  # the (1 − 2α) Welch interval of diff: equivalent exactly when it lies inside (−margin, margin)
    ci_high: float
    equivalent: bool  # p_value < α
    p_value: float  # the larger of the two one-sided p-values
    df: float  # Welch–Satterthwaite degrees of freedom (inf when neither group varies)


def tost(a: Sequence[float], b: Sequence[float], margin: float = 0.03, alpha: float = 0.05) -> Tost:
    """Two one-sided Welch t-tests: are the means of `a` and `b` equivalent within ±margin?

    H0: |mean(a) − mean(b)| ≥ margin against H1: it is below; rejected (equivalent) when both one-sided tests
    reject at `alpha`, i.e. the (1 − 2·alpha) confidence interval of the difference lies inside (−margin, margin).
    With se² = s_a²/n_a + s_b²/n_b and Welch's ν:

        p = max(P(T_ν > (diff + margin) / se), P(T_ν < (diff − margin) / se))

    Args:
      a, b: [n_a], [n_b] one value per run (e.g. held-out accuracy per seed), at least 2 each.
      margin: > 0, in the values' units.  alpha: in (0, 0.5).
    Neither group varying (se = 0): the difference is exact; equivalent iff |diff| < margin (p 0, else 1)."""
    fn = "tost"
    x, y = _sample(fn, "a", a, 2), _sample(fn, "b", b, 2)
    if not margin > 0:
        raise ValueError(f"{fn}: margin = {margin} must be > 0")
    if not 0 < alpha < 0.5:
        raise ValueError(f"{fn}: alpha = {alpha} must lie in (0, 0.5)")
    diff = float(x.mean() - y.mean())
    va, vb = float(x.var(ddof=1)) / len(x), float(y.var(ddof=1)) / len(y)
    se = math.sqrt(va + vb)
    if se == 0:
        inside = abs(diff) < margin
        return Tost(diff, diff, diff, inside, 0.0 if inside else 1.0, math.inf)
    wa, wb = va / (va + vb), vb / (va + vb)  # Welch's ν in shares of se², which cannot underflow as va² can
    df = 1.0 / (wa * wa / (len(x) - 1) + wb * wb / (len(y) - 1))
    p = max(t_sf((diff + margin) / se, df), t_cdf((diff - margin) / se, df))
    half = t_ppf(1 - alpha, df) * se
    return Tost(diff, diff - half, diff + half, p < alpha, p, df)


# ------------------------------------------------------------------------------------------ bootstrap
class Interval(NamedTuple):
    low: float
    high: float


Stat = Callable[..., np.ndarray]
"""A numpy reduction called as stat(resamples, axis=1) on an [n, len] array of resamples: np.mean, np.median."""


def _percentiles(stats: np.ndarray, level: float) -> Interval:
    low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return Interval(float(low), float(high))


def _check_bootstrap(fn: str, n: int, level: float) -> None:
    if n < 1:
        raise ValueError(f"{fn}: n = {n} resamples must be >= 1")
    if not 0 < level < 1:
        raise ValueError(f"{fn}: level = {level} must lie in (0, 1)")


def bootstrap_ci(values: Sequence[float], stat: Stat = np.mean, n: int = 10_000, level: float = 0.95,
                 seed: int = 0) -> Interval:
    """The percentile bootstrap interval of stat(values): `n` resamples of len(values) values drawn with
    replacement (numpy's PCG64 seeded with `seed`), and the (1 − level)/2 and (1 + level)/2 quantiles of their
    stat. The values are sorted first, so the interval depends on them, not on their order.

    Args:
      values: [m] one value per run, m ≥ 1.
    Memory: an [n, m] array of resamples (10,000 × 100 runs: 8 MB)."""
    fn = "bootstrap_ci"
    x = np.sort(_sample(fn, "values", values, 1))
    _check_bootstrap(fn, n, level)
    rng = np.random.default_rng(seed)
    return _percentiles(stat(x[rng.integers(0, len(x), size=(n, len(x)))], axis=1), level)


def bootstrap_diff_ci(a: Sequence[float], b: Sequence[float], stat: Stat = np.mean, n: int = 10_000,
                      level: float = 0.95, seed: int = 0) -> Interval:
    """The percentile bootstrap interval of stat(a) − stat(b), each group resampled on its own (independent
    groups: different runs), as `bootstrap_ci`.

    Args:
      a, b: [m_a], [m_b] one value per run, at least 1 each."""
    fn = "bootstrap_diff_ci"
    x, y = np.sort(_sample(fn, "a", a, 1)), np.sort(_sample(fn, "b", b, 1))
    _check_bootstrap(fn, n, level)
    rng = np.random.default_rng(seed)
    resampled_a = x[rng.integers(0, len(x), size=(n, len(x)))]
    resampled_b = y[rng.integers(0, len(y), size=(n, len(y)))]
    return _percentiles(stat(resampled_a, axis=1) - stat(resampled_b, axis=1), level)
