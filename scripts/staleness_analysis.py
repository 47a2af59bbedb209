"""The staleness experiment's analysis (docs/staleness.md, "The experiment"): reads learning-grid directories and
writes the report.

    python -m scripts.staleness_analysis runs/staleness/sums-* --out runs/staleness/sums-analysis

Each directory is one `scripts/learning_grid.py` output: its results.json holds the grid's args (--lag, --lr) and
every run with its held-out accuracy, its run-mean drift D (the mean over steps of actor/behaviour_kl, the k3
estimate of KL(μ‖π_θ)) and its mean version lag. Runs are keyed by (lr, forced lag, cell, seed); a key found in
several directories (the sync cell, which every directory runs at lag 0) is one observation, the mean of its runs,
so that a seed counts once. Then, with the statistics of `asyncrl_bench/staleness_stats.py`:

  1. the drift law: OLS of accuracy on log D over every run at a forced lag > 0, pooled, per lr and over the cells'
     means; and the partial F-test of the version lag (the run's mean lag trained on; the forced lag beside it)
     added to log D;
  2. equivalence to sync: TOST (two one-sided Welch t-tests, ±--margin, --alpha) of every cell at every lag
     against the sync runs of its lr;
  3. every (lr, lag, cell): mean accuracy with its percentile-bootstrap interval over seeds, the per-seed values,
     the mean drift, and the difference from sync with its bootstrap interval;
  4. the pre-registered goals G1–G5, each passed, failed or not measured.

Writes staleness_analysis.md, staleness_analysis.json and (where matplotlib is installed) staleness_analysis.png to
--out, and prints the markdown.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
from collections import defaultdict
from typing import NamedTuple

import numpy as np
import tyro

from asyncrl_bench.staleness_stats import bootstrap_ci, bootstrap_diff_ci, drift_fit, hinge_fit, lag_increment, tost
from asyncrl_bench.plots import pyplot_or_none

__all__ = ["AnalysisArgs", "Run", "read_runs", "drift_law", "equivalence", "cell_summary", "goals", "report",
           "analyse"]

BYPASS, IGNORE_MU = "lag-naive", "lag-ignore-mu"
COMPARED = ("model", "steps", "n", "mini_batch_size", "digits", "data_path", "eval_data_path", "eval_prompts",
            "eval_n", "eval_seed", "temperature", "max_new_tokens")
"""The grid args that must agree for runs of several directories to be compared (the factors --lag and --lr, and
the bookkeeping ones such as --out and --parallel, may differ)."""


@dataclasses.dataclass
class AnalysisArgs:
    dirs: tyro.conf.Positional[tuple[str, ...]]
    """Learning-grid output directories (each with its results.json), or results.json files."""
    out: str = "runs/staleness-analysis"
    reference: str = "sync"
    """The cell every other is compared with (its runs pooled per lr over the directories)."""
    margin: float = 0.03
    """TOST's equivalence margin, in accuracy."""
    alpha: float = 0.05
    bootstrap: int = 10_000
    """Bootstrap resamples of every interval."""
    seed: int = 0
    """Seed of the bootstrap resampling."""


class Run(NamedTuple):
    lr: float
    lag: float  # the forced lag: the cell's --async-training.staleness-threshold (0 for sync)
    cell: str
    seed: int
    accuracy: float  # held-out
    drift_kl: float | None  # run-mean actor/behaviour_kl (None: not recorded)
    drift_k1: float | None  # run-mean actor/behaviour_k1
    lag_mean: float  # the mean version lag trained on
    runs: int  # grid runs averaged into this observation


# ------------------------------------------------------------------------------------------ reading
def _results_file(path: str) -> pathlib.Path:
    p = pathlib.Path(path)
    p = p / "results.json" if p.is_dir() else p
    if not p.is_file():
        raise SystemExit(f"{path}: no results.json; point at a `scripts.learning_grid` --out directory")
    return p


def _forced_lag(run: dict, args: dict) -> float:
    if run.get("forced_lag") is not None:
        return float(run["forced_lag"])
    # written before runs recorded it: the sync cells run at 0, stale-partial at 0.5, the lag cells at --lag
    cell = run["cell"]
    return 0.0 if cell.startswith("sync") else 0.5 if cell == "stale-partial" else float(args["lag"])


def _run_drift(run: dict, key: str, column: str) -> float | None:
    if run.get(key) is not None:
        return float(run[key])
    values = [c[column] for c in run.get("curve", ()) if c.get(column) is not None]
    return statistics.fmean(values) if values else None


def _mean_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def read_runs(grids: list[tuple[dict, list[dict]]]) -> list[Run]:
    """One `Run` per (lr, forced lag, cell, seed) over the grids' (args, runs), repeated runs averaged."""
    keyed: dict[tuple, list[dict]] = defaultdict(list)
    for args, runs in grids:
        for run in runs:
            keyed[(float(args["lr"]), _forced_lag(run, args), run["cell"], int(run["seed"]))].append(run)
    return [Run(lr, lag, cell, seed, accuracy=statistics.fmean(r["eval"]["accuracy"] for r in runs),
                drift_kl=_mean_or_none([_run_drift(r, "drift_kl", "behaviour_kl") for r in runs]),
                drift_k1=_mean_or_none([_run_drift(r, "drift_k1", "behaviour_k1") for r in runs]),
                lag_mean=statistics.fmean(float(r["lag_mean"]) for r in runs), runs=len(runs))
            for (lr, lag, cell, seed), runs in sorted(keyed.items())]


def _disagreements(grids: list[tuple[dict, list[dict]]]) -> list[str]:
    """The COMPARED args whose values differ between the grids: 'steps: 48, 96'."""
    out = []
    for name in COMPARED:
        values = {json.dumps(args.get(name)) for args, _ in grids}
        if len(values) > 1:
            out.append(f"{name}: {', '.join(sorted(values))}")
    return out


# ------------------------------------------------------------------------------------------ analysis
def _try(fn, *args) -> dict:
    """fn(*args) as a dict, or {"error": why} when the data cannot answer."""
    try:
        return fn(*args)._asdict()
    except ValueError as err:
        return {"error": str(err)}


def drift_law(runs: list[Run], reference: str) -> dict:
    """Accuracy on log D over the runs at a forced lag > 0 with a positive drift: fits pooled, per lr and over
    the (lr, lag, cell) means, and the partial F-test of the lag (mean trained on, and forced) beside log D."""
    lagged = [r for r in runs if r.lag > 0 and r.cell != reference]
    points = [r for r in lagged if r.drift_kl is not None and r.drift_kl > 0]
    fits = {"every run": _try(drift_fit, [r.accuracy for r in points], [math.log(r.drift_kl) for r in points])}
    for lr in sorted({r.lr for r in points}):
        mine = [r for r in points if r.lr == lr]
        fits[f"runs at lr {lr:g}"] = _try(drift_fit, [r.accuracy for r in mine],
                                          [math.log(r.drift_kl) for r in mine])
    cells: dict[tuple, list[Run]] = defaultdict(list)
    for r in points:
        cells[(r.lr, r.lag, r.cell)].append(r)
    fits["cell means"] = _try(drift_fit, [statistics.fmean(r.accuracy for r in c) for c in cells.values()],
                              [math.log(statistics.fmean(r.drift_kl for r in c)) for c in cells.values()])
    acc, log_d = [r.accuracy for r in points], [math.log(r.drift_kl) for r in points]
    return {"points": len(points), "without_drift": len(lagged) - len(points), "fits": fits,
            "hinge": _try(hinge_fit, acc, log_d),
            "lag_mean": _try(lag_increment, acc, log_d, [r.lag_mean for r in points]),
            "lag_forced": _try(lag_increment, acc, log_d, [r.lag for r in points])}


def _groups(runs: list[Run]) -> dict[tuple, list[Run]]:
    """Runs by (lr, lag, cell), in that order."""
    out: dict[tuple, list[Run]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: (r.lr, r.lag, r.cell, r.seed)):
        out[(r.lr, r.lag, r.cell)].append(r)
    return dict(out)


def equivalence(runs: list[Run], reference: str, margin: float, alpha: float) -> list[dict]:
    """TOST of every (lr, lag > 0, cell) against the reference cell's runs of that lr."""
    rows = []
    for (lr, lag, cell), mine in _groups(runs).items():
        if cell == reference or lag == 0:
            continue
        ref = [r.accuracy for r in runs if r.cell == reference and r.lr == lr]
        result = _try(lambda a, b: tost(a, b, margin=margin, alpha=alpha), [r.accuracy for r in mine], ref)
        rows.append({"lr": lr, "lag": lag, "cell": cell, "n": len(mine), "n_reference": len(ref), **result})
    return rows


def cell_summary(runs: list[Run], reference: str, n: int, seed: int) -> list[dict]:
    """Every (lr, lag, cell): seeds, mean accuracy and its bootstrap interval, per-seed values, mean drift (k3,
    k1) and lag trained on, and the difference from the reference cell of its lr with its bootstrap interval."""
    rows = []
    for (lr, lag, cell), mine in _groups(runs).items():
        acc = [r.accuracy for r in mine]
        ref = [r.accuracy for r in runs if r.cell == reference and r.lr == lr]
        diff = (bootstrap_diff_ci(acc, ref, n=n, seed=seed) if ref and cell != reference else None)
        rows.append({"lr": lr, "lag": lag, "cell": cell, "seeds": [r.seed for r in mine], "per_seed": acc,
                     "accuracy": statistics.fmean(acc), "ci": tuple(bootstrap_ci(acc, n=n, seed=seed)),
                     "drift_kl": _mean_or_none([r.drift_kl for r in mine]),
                     "drift_k1": _mean_or_none([r.drift_k1 for r in mine]),
                     "lag_mean": statistics.fmean(r.lag_mean for r in mine),
                     "diff": statistics.fmean(acc) - statistics.fmean(ref) if diff is not None else None,
                     "diff_ci": tuple(diff) if diff is not None else None})
    return rows


# ------------------------------------------------------------------------------------------ the goals
GOALS = {"G1": "bypass at lag 2 and 4, lr 1e-5: TOST-equivalent to sync within ±margin",
         "G2": "high lag, lr 1e-5: the best cell at lag 8 ≥ 0.755",
         "G3": "high lag, lr 3e-5: the best cell at lag 8 ≥ 0.666",
         "G4": "drift law: R² ≥ 0.8 of accuracy on log D over every run, and the lag term p > 0.05",
         "G5": "ignore-μ collapses: ≥ 0.2 below bypass at lag 4"}
"""docs/staleness.md's goals, fixed before any run."""


def _at(rows: list[dict], lr: float, lag: float) -> list[dict]:
    return [r for r in rows if math.isclose(r["lr"], lr) and r["lag"] == lag]


def _best_at(cells: list[dict], lr: float, lag: float, floor: float, reference: str) -> tuple[str, bool | None]:
    here = [r for r in _at(cells, lr, lag) if r["cell"] != reference]
    if not here:
        return f"no runs at lr {lr:g}, lag {lag:g}", None
    best = max(here, key=lambda r: r["accuracy"])
    return f"{best['cell']} {best['accuracy']:.3f}", best["accuracy"] >= floor


def goals(cells: list[dict], equivalent: list[dict], law: dict, reference: str) -> list[dict]:
    """G1–G5 (GOALS): what was measured, and passed (True / False; None: not measured)."""
    g1 = [r for lag in (2.0, 4.0) for r in _at(equivalent, 1e-5, lag) if r["cell"] == BYPASS and "error" not in r]
    g1_text = "; ".join(f"lag {r['lag']:g}: diff {r['diff']:+.3f}, p {r['p_value']:.3f}" for r in g1)
    g1_pass = all(r["equivalent"] for r in g1) if len(g1) == 2 else None
    fit, inc = law["fits"]["every run"], law["lag_mean"]
    if "error" in fit or "error" in inc:
        g4_text, g4_pass = fit.get("error") or inc.get("error"), None
    else:
        g4_text, g4_pass = f"R² {fit['r2']:.3f}, lag p {inc['p_value']:.3f}", fit["r2"] >= 0.8 and inc["p_value"] > 0.05
    gaps = []
    for lr in sorted({r["lr"] for r in cells}):
        by = {r["cell"]: r["accuracy"] for r in _at(cells, lr, 4.0)}
        if BYPASS in by and IGNORE_MU in by:
            gaps.append((lr, by[BYPASS] - by[IGNORE_MU]))
    measured = {"G1": (g1_text or "bypass at lag 2 and 4, lr 1e-5 not both measured", g1_pass),
                "G2": _best_at(cells, 1e-5, 8.0, 0.755, reference), "G3": _best_at(cells, 3e-5, 8.0, 0.666, reference),
                "G4": (g4_text, g4_pass),
                "G5": ("; ".join(f"lr {lr:g}: bypass − ignore-μ {gap:+.3f}" for lr, gap in gaps) or
                       "bypass and ignore-μ at lag 4 not both measured",
                       all(gap >= 0.2 for _, gap in gaps) if gaps else None)}
    return [{"goal": g, "text": GOALS[g], "measured": m, "passed": p} for g, (m, p) in measured.items()]


# ------------------------------------------------------------------------------------------ the report
def _f(value, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


def _law_lines(law: dict) -> list[str]:
    left_out = f" ({law['without_drift']} without a drift left out)" if law["without_drift"] else ""
    lines = [f"OLS of held-out accuracy on log D (D: the run-mean KL(μ‖π_θ), k3) over the {law['points']} runs at a "
             f"forced lag > 0{left_out}.", "", "| points | n | slope per e-fold of D | intercept | R² |",
             "|---|---|---|---|---|"]
    for name, fit in law["fits"].items():
        lines.append(f"| {name} | – | {fit['error']} | | |" if "error" in fit else
                     f"| {name} | {fit['n']} | {fit['slope']:+.4f} | {fit['intercept']:.4f} | {fit['r2']:.3f} |")
    hinge = law["hinge"]
    lines += ["", "Exploratory, not pre-registered (chosen after the pilot's plot): flat up to a knee, then a line in "
              "log D.", ""] + ([f"Hinge: {hinge['error']}"] if "error" in hinge else [
        f"Hinge over every run (n {hinge['n']}): accuracy {hinge['plateau']:.3f} up to D = {math.exp(hinge['knee']):.3g}, "
        f"then {hinge['slope']:+.4f} per e-fold; R² {hinge['r2']:.3f} (adjusted for its 3 parameters "
        f"{hinge['adjusted_r2']:.3f})."])
    lines += ["", "Does the lag explain accuracy once log D is known (nested OLS, partial F on (1, n − 3) df)?", "",
              "| lag | n | R² log D | R² log D + lag | ΔR² | lag coefficient | F | p |", "|" + "---|" * 8]
    for name, key in (("mean lag trained on (primary)", "lag_mean"), ("forced lag", "lag_forced")):
        inc = law[key]
        lines.append(f"| {name} | – | {inc['error']} | | | | | |" if "error" in inc else
                     f"| {name} | {inc['n']} | {inc['r2_drift']:.3f} | {inc['r2_both']:.3f} | {inc['delta_r2']:+.3f} | "
                     f"{inc['lag_slope']:+.4f} | {inc['f_stat']:.3f} | {inc['p_value']:.4f} |")
    return lines


def _tost_lines(rows: list[dict], reference: str, margin: float, alpha: float) -> list[str]:
    level = f"{1 - 2 * alpha:.0%}"
    lines = [f"Every cell against {reference} of its lr: TOST, margin ±{margin}, α = {alpha} (equivalent when the "
             f"{level} interval of the difference lies inside the margin).", "",
             f"| lr | lag | cell | n / n {reference} | diff | {level} interval | Welch df | p | equivalent |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['lr']:g} | {r['lag']:g} | {r['cell']} | {r['n']} / {r['n_reference']} |"
        lines.append(f"{head} {r['error']} | | | | |" if "error" in r else
                     f"{head} {r['diff']:+.3f} | [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] | {r['df']:.1f} | "
                     f"{r['p_value']:.4f} | {'yes' if r['equivalent'] else 'no'} |")
    return lines


def _cell_lines(rows: list[dict], reference: str) -> list[str]:
    lines = ["| lr | lag | cell | seeds | accuracy | 95 % bootstrap | per seed | D (k3) | k1 | lag trained on | "
             f"− {reference} | 95 % bootstrap |", "|" + "---|" * 12]
    for r in rows:
        diff_ci = r["diff_ci"]
        lines.append(f"| {r['lr']:g} | {r['lag']:g} | {r['cell']} | {len(r['seeds'])} | {r['accuracy']:.3f} | "
                     f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] | {' / '.join(f'{a:.3f}' for a in r['per_seed'])} | "
                     f"{_f(r['drift_kl'], '.2e')} | {_f(r['drift_k1'], '.2e')} | {r['lag_mean']:.2f} | "
                     f"{_f(r['diff'], '+.3f')} | "
                     + ("– |" if diff_ci is None else f"[{diff_ci[0]:+.3f}, {diff_ci[1]:+.3f}] |"))
    return lines


def report(result: dict) -> str:
    """The markdown of `analyse`'s result."""
    args = result["args"]
    verdict = {True: "pass", False: "FAIL", None: "not measured"}
    lines = ["# Staleness: the analysis", "", f"{len(result['runs'])} observations (lr, forced lag, cell, seed) "
             f"from {len(args['dirs'])} grid directories: {', '.join(args['dirs'])}."]
    merged = sum(r["runs"] > 1 for r in result["runs"])
    if merged:
        lines.append(f"{merged} of them were run in several directories (the {args['reference']} cell in each): "
                     "each is the mean of its runs, counted once.")
    for problem in result["disagreements"]:
        lines.append(f"**The directories differ in {problem}**: their runs are not comparable as they stand.")
    lines += ["", "## Goals", "", "| goal | what | measured | verdict |", "|---|---|---|---|"]
    lines += [f"| {g['goal']} | {g['text']} | {g['measured']} | {verdict[g['passed']]} |" for g in result["goals"]]
    lines += ["", "## 1. The drift law", "", *_law_lines(result["drift_law"])]
    lines += ["", "## 2. Equivalence to sync", "",
              *_tost_lines(result["equivalence"], args["reference"], args["margin"], args["alpha"])]
    lines += ["", "## 3. Every cell", "", f"Percentile bootstrap over seeds ({args['bootstrap']:,} resamples, seed "
              f"{args['seed']}); the difference resamples each cell and {args['reference']} on its own.", "",
              *_cell_lines(result["cells"], args["reference"])]
    return "\n".join(lines) + "\n"


def _plot(runs: list[Run], result: dict, path: pathlib.Path) -> None:
    plt = pyplot_or_none(path, "analysis")
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    cells = sorted({r.cell for r in runs})
    lrs = sorted({r.lr for r in runs})
    for i, cell in enumerate(cells):
        for j, lr in enumerate(lrs):
            mine = [r for r in runs if r.cell == cell and r.lr == lr and r.drift_kl and r.drift_kl > 0 and r.lag > 0]
            if mine:
                left.scatter([r.drift_kl for r in mine], [r.accuracy for r in mine], color=f"C{i}", s=18,
                             marker="os^D"[j % 4], label=f"{cell}, lr {lr:g}")
    fit = result["drift_law"]["fits"]["every run"]
    drifts = [r.drift_kl for r in runs if r.drift_kl and r.drift_kl > 0 and r.lag > 0]
    if "error" not in fit:
        xs = np.geomspace(min(drifts), max(drifts))
        left.plot(xs, fit["intercept"] + fit["slope"] * np.log(xs), color="k", lw=1, label=f"OLS, R² {fit['r2']:.2f}")
    left.set(xscale="log", xlabel="run-mean drift D = KL(μ‖π_θ), k3", ylabel="held-out accuracy",
             title="accuracy against drift, one point per run")
    left.legend(fontsize=7)
    for i, cell in enumerate(cells):
        for j, lr in enumerate(lrs):
            rows = sorted((r for r in result["cells"] if r["cell"] == cell and r["lr"] == lr), key=lambda r: r["lag"])
            if rows:
                means = [r["accuracy"] for r in rows]
                err = [[m - r["ci"][0] for m, r in zip(means, rows)], [r["ci"][1] - m for m, r in zip(means, rows)]]
                right.errorbar([r["lag"] for r in rows], means, yerr=err, color=f"C{i}", ls="-:"[j % 2], marker="o",
                               capsize=3, label=f"{cell}, lr {lr:g}")
    right.set(xlabel="forced lag (versions)", ylabel="held-out accuracy (mean, 95 % bootstrap)",
              title="accuracy against lag")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyse(args: AnalysisArgs) -> dict:
    """Read the grids, run the analysis, write and print the report; returns the result written as JSON."""
    grids = []
    for d in args.dirs:
        data = json.loads(_results_file(d).read_text())
        grids.append((data["args"], data["runs"]))
    runs = read_runs(grids)
    law = drift_law(runs, args.reference)
    equivalent = equivalence(runs, args.reference, args.margin, args.alpha)
    cells = cell_summary(runs, args.reference, args.bootstrap, args.seed)
    result = {"args": dataclasses.asdict(args), "disagreements": _disagreements(grids),
              "runs": [r._asdict() for r in runs], "drift_law": law, "equivalence": equivalent, "cells": cells,
              "goals": goals(cells, equivalent, law, args.reference)}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = report(result)
    (out / "staleness_analysis.md").write_text(text)
    (out / "staleness_analysis.json").write_text(json.dumps(result, indent=1))
    if runs:
        _plot(runs, result, out / "staleness_analysis.png")
    print(text)
    return result


if __name__ == "__main__":
    analyse(tyro.cli(AnalysisArgs))
