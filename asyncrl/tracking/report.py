"""Plots and a summary of a finished (or running) run, from its metrics.jsonl (`asyncrl report RUN_DIR`).

    paths = write_report("runs/cpu-demo")            # PNGs in runs/cpu-demo/report/, runs/cpu-demo/report.md

Figures (each skipped when the run logged none of its metrics):
  reward.png       critic/score/mean (and reward/accuracy) vs version and vs wall-clock seconds, with the
                   held-out evaluations (`val-core/<data_source>/reward/mean@N`, `--eval.*`) at their versions
  throughput.png   perf/throughput (trained tokens/s per version window) vs version
  version_lag.png  histogram of trained groups' version lag (training/version_lag/hist/<lag>, summed)
  lag_by_length.png  the trained samples' mean version lag against their response length
                   (training/version_lag/by_length/<bucket>/{count,lag_sum}, summed): where staleness lives
  idle.png         trainer/idle_ratio and rollouter/idle_ratio vs version
report.md (in the run directory) links the figures and tabulates first / last / best reward, total wall
time, mean idle ratios and mean param_sync time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Annotated

import tyro

from asyncrl.algos.staleness import LengthBucket
from asyncrl.tracking.tracker import read_metrics

__all__ = ["write_report", "summarize", "lag_by_length", "length_bucket_sums", "report_main"]

REWARD_KEYS = ("critic/score/mean", "reward/accuracy")
HELD_OUT_PREFIX = "val-core/"
LAG_PREFIX = "training/version_lag/hist/"
BY_LENGTH_PREFIX = "training/version_lag/by_length/"


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _series(rows: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) over the rows that logged a finite `key` (and a finite x)."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        xv = _number(row.get(x, i + 1 if x == "step" else None))
        yv = _number(row.get(key))
        if xv is not None and yv is not None:
            xs.append(xv)
            ys.append(yv)
    return xs, ys


def _lag_histogram(rows: list[dict]) -> dict[int, float]:
    hist: dict[int, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(LAG_PREFIX) and _number(value) is not None:
                try:
                    lag = int(key[len(LAG_PREFIX):])
                except ValueError:
                    continue
                hist[lag] = hist.get(lag, 0.0) + float(value)
    return dict(sorted(hist.items()))


def length_bucket_sums(rows: list[dict]) -> dict[int, LengthBucket]:
    """Per response-length bucket (tokens, a power of two): the trained samples and the sums of their lags, lengths
    and groups' longest lengths, over the rows (`asyncrl.algos.lag_by_length`; a field a run did not log is 0)."""
    sums: dict[int, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if not key.startswith(BY_LENGTH_PREFIX) or _number(value) is None:
                continue
            bucket, _, field = key[len(BY_LENGTH_PREFIX):].partition("/")
            if bucket.isdigit() and field in LengthBucket._fields:
                totals = sums.setdefault(int(bucket), [0.0] * len(LengthBucket._fields))
                totals[LengthBucket._fields.index(field)] += float(value)
    return {bucket: LengthBucket(*map(int, totals)) for bucket, totals in sorted(sums.items()) if totals[0]}


def lag_by_length(rows: list[dict]) -> dict[int, tuple[int, float]]:
    """Per response-length bucket (tokens, a power of two): trained samples and their mean version lag, over the
    run's rows."""
    return {bucket: (s.count, s.lag_sum / s.count) for bucket, s in length_bucket_sums(rows).items()}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def held_out_keys(rows: list[dict]) -> list[str]:
    """The held-out evaluation metrics the run logged (`val-core/...`), sorted."""
    return sorted({k for row in rows for k in row if k.startswith(HELD_OUT_PREFIX)})


def summarize(rows: list[dict], run_dir: str | pathlib.Path | None = None) -> dict:
    """The report's numbers: per reward key (and held-out metric, by evaluated version) first / last / best
    (value and version), wall time, means."""
    out: dict = {"versions": len({row.get("step", i) for i, row in enumerate(rows)})}
    for key in (*REWARD_KEYS, *held_out_keys(rows)):
        xs, ys = _series(rows, key, x="val/version" if key.startswith(HELD_OUT_PREFIX) else "step")
        if ys:
            best = max(range(len(ys)), key=ys.__getitem__)
            out[key] = {"first": ys[0], "last": ys[-1], "best": ys[best], "best_version": int(xs[best])}
    walls = _series(rows, "wall_s")[1]
    out["wall_s"] = max(walls) if walls else None  # launch to the last logged version
    out["run_wall_s"] = None  # train() start to end, start-up and shutdown included (summary.json)
    summary_file = pathlib.Path(run_dir) / "summary.json" if run_dir is not None else None
    if summary_file is not None and summary_file.is_file():
        try:
            out["run_wall_s"] = _number(json.loads(summary_file.read_text()).get("wall_s"))
        except (json.JSONDecodeError, AttributeError):
            pass
    for name, key in (("trainer_idle_ratio", "trainer/idle_ratio"), ("rollouter_idle_ratio", "rollouter/idle_ratio"),
                      ("param_sync_s", "timing_s/param_sync"), ("throughput", "perf/throughput"),
                      ("behaviour_k1", "actor/behaviour_k1"), ("behaviour_ess", "actor/behaviour_ess"),
                      ("running_rows", "rollouter/running_rows")):
        out[f"mean_{name}"] = _mean(_series(rows, key)[1])
    hist = _lag_histogram(rows)
    if hist:
        total = sum(hist.values())
        out["trained_groups"] = int(total)
        out["mean_version_lag"] = sum(k * v for k, v in hist.items()) / total if total else None
    by_length = length_bucket_sums(rows)
    if by_length:  # the mean lengths where the run logged them (since 2026-11-29)
        out["lag_by_length"] = {str(bucket): {"samples": s.count, "mean_lag": s.lag_sum / s.count, **(
            {"mean_length": s.length_sum / s.count, "mean_group_length": s.group_length_sum / s.count}
            if s.length_sum else {})} for bucket, s in by_length.items()}
    return out


# ------------------------------------------------------------------------------------------ figures
def _pyplot():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _plot_reward(rows, out: pathlib.Path, title: str) -> pathlib.Path | None:
    keys = [k for k in REWARD_KEYS if _series(rows, k)[1]]
    held_out = held_out_keys(rows)
    if not keys and not held_out:
        return None
    plt = _pyplot()
    fig, (by_version, by_time) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for key, style in zip(keys, ("-", "--")):
        by_version.plot(*_series(rows, key), style, marker="o", markersize=3, label=key)
        xs, ys = _series(rows, key, x="wall_s")
        if ys:
            by_time.plot(xs, ys, style, marker="o", markersize=3, label=key)
    for key in held_out:  # each evaluation at the version it evaluated, and when it ended
        by_version.plot(*_series(rows, key, x="val/version"), ":", marker="s", markersize=4, label=f"held-out {key}")
        xs, ys = _series(rows, key, x="wall_s")
        if ys:
            by_time.plot(xs, ys, ":", marker="s", markersize=4, label=f"held-out {key}")
    by_version.set(xlabel="version", ylabel="reward", title=f"{title}: reward vs version")
    by_time.set(xlabel="wall-clock (s)", title="reward vs wall-clock")
    for ax in (by_version, by_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, out / "reward.png")


def _plot_throughput(rows, out: pathlib.Path, title: str) -> pathlib.Path | None:
    xs, ys = _series(rows, "perf/throughput")
    if not ys:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(xs, ys, marker="o", markersize=3, color="tab:green")
    ax.set(xlabel="version", ylabel="trained tokens / s", title=f"{title}: throughput (perf/throughput)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return _save(fig, out / "throughput.png")


def _plot_lag(rows, out: pathlib.Path, title: str) -> pathlib.Path | None:
    hist = _lag_histogram(rows)
    if not hist or not sum(hist.values()):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.bar(list(hist), list(hist.values()), color="tab:purple")
    ax.set_xticks(list(hist))
    ax.set(xlabel="version lag of the oldest token (versions)", ylabel="trained groups",
           title=f"{title}: version lag of trained groups")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out / "version_lag.png")


def _plot_lag_by_length(rows, out: pathlib.Path, title: str) -> pathlib.Path | None:
    by_length = lag_by_length(rows)
    if not by_length:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    buckets = list(by_length)
    ax.bar(range(len(buckets)), [mean for _, mean in by_length.values()], color="tab:purple")
    ax.set_xticks(range(len(buckets)), [f"≤{b}\n({count})" for b, (count, _) in by_length.items()], fontsize=7)
    ax.set(xlabel="response length, tokens (trained samples)", ylabel="mean version lag (oldest token)",
           title=f"{title}: version lag by response length")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out / "lag_by_length.png")


def _plot_idle(rows, out: pathlib.Path, title: str) -> pathlib.Path | None:
    keys = [k for k in ("trainer/idle_ratio", "rollouter/idle_ratio") if _series(rows, k)[1]]
    if not keys:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key in keys:
        ax.plot(*_series(rows, key), marker="o", markersize=3, label=key)
    ax.set(xlabel="version", ylabel="idle fraction of the window", title=f"{title}: idle ratios")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "idle.png")


def _plot_drift(rows, out: pathlib.Path, title: str) -> pathlib.Path | None:
    """The drift of the trained policy from the behaviour policy per version: KL(μ‖π_θ) (k1; its absolute value on a
    log axis, as a batch's estimate can be negative) and k3, and the ratios' effective sample size."""
    kls = [(k, lab) for k, lab in (("actor/behaviour_k1", "|k1| KL(μ‖π)"), ("actor/behaviour_kl", "k3"))
           if _series(rows, k)[1]]
    if not kls:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key, label in kls:
        xs, ys = _series(rows, key)
        ax.plot(xs, [max(abs(y), 1e-12) for y in ys], marker="o", markersize=3, label=label)
    ax.set_yscale("log")
    ax.set(xlabel="version", ylabel="drift from μ (nats a token)", title=f"{title}: drift from the behaviour policy")
    ax.grid(alpha=0.3)
    xs, ys = _series(rows, "actor/behaviour_ess")
    if ys:
        twin = ax.twinx()
        twin.plot(xs, ys, ":", color="tab:gray", label="ESS of π/μ")
        twin.set_ylim(0, 1.02)
        twin.set_ylabel("effective sample size (normalised)")
        twin.legend(fontsize=8, loc="lower right")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, out / "drift.png")


FIGURES = (("reward.png", "Reward vs version and wall-clock", _plot_reward),
           ("throughput.png", "Throughput vs version", _plot_throughput),
           ("version_lag.png", "Version lag of trained groups", _plot_lag),
           ("lag_by_length.png", "Version lag by response length", _plot_lag_by_length),
           ("drift.png", "Drift from the behaviour policy", _plot_drift),
           ("idle.png", "Trainer and rollouter idle ratios", _plot_idle))


# ------------------------------------------------------------------------------------------ markdown
def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}g}"


def _markdown(run_dir: pathlib.Path, figures: list[tuple[str, pathlib.Path]], summary: dict) -> str:
    lines = [f"# Run report: `{run_dir.name}`", "", f"{summary['versions']} versions logged in "
             f"`{run_dir / 'metrics.jsonl'}`.", "", "## Summary", "", "| metric | value |", "|---|---|"]
    for key in (*REWARD_KEYS, *(k for k in summary if k.startswith(HELD_OUT_PREFIX))):
        if key in summary:
            s = summary[key]
            lines += [f"| {key} first | {_fmt(s['first'])} |", f"| {key} last | {_fmt(s['last'])} |",
                      f"| {key} best | {_fmt(s['best'])} (version {s['best_version']}) |"]
        else:
            lines.append(f"| {key} | — (not logged) |")
    lines += [f"| total wall time to the last version (s) | {_fmt(summary.get('wall_s'), 5)} |"]
    if summary.get("run_wall_s") is not None:
        lines.append(f"| whole run incl. start-up and shutdown (s, summary.json) | {_fmt(summary['run_wall_s'], 5)} |")
    lines += [
              f"| mean trainer/idle_ratio | {_fmt(summary.get('mean_trainer_idle_ratio'), 3)} |",
              f"| mean rollouter/idle_ratio | {_fmt(summary.get('mean_rollouter_idle_ratio'), 3)} |",
              f"| mean timing_s/param_sync (s) | {_fmt(summary.get('mean_param_sync_s'), 3)} |",
              f"| mean perf/throughput (tok/s) | {_fmt(summary.get('mean_throughput'), 4)} |",
              f"| mean actor/behaviour_k1, KL(μ‖π) | {_fmt(summary.get('mean_behaviour_k1'), 3)} |",
              f"| mean actor/behaviour_ess | {_fmt(summary.get('mean_behaviour_ess'), 3)} |",
              f"| mean rollouter/running_rows (rows generating a decode step, per agent) | "
              f"{_fmt(summary.get('mean_running_rows'), 3)} |"]
    if "trained_groups" in summary:
        lines += [f"| trained groups (lag histogram) | {summary['trained_groups']} |",
                  f"| mean version lag | {_fmt(summary.get('mean_version_lag'), 3)} |"]
    if summary.get("lag_by_length"):
        lines += ["", "## Version lag by response length", "",
                  "A sample's lag follows its group's longest response, which its agent waits for to deliver the group "
                  "(docs/staleness.md, \"Lag and response length\").", "",
                  "| response tokens | trained samples | mean version lag | mean length | mean group longest |",
                  "|---|---|---|---|---|"]
        lines += [f"| ≤ {bucket} | {cell['samples']} | {cell['mean_lag']:.2f} | {_fmt(cell.get('mean_length'), 4)} | "
                  f"{_fmt(cell.get('mean_group_length'), 4)} |" for bucket, cell in summary["lag_by_length"].items()]
    lines += ["", "## Figures", ""]
    if not figures:
        lines.append("No figure: the run logged none of the plotted metrics.")
    for caption, path in figures:
        rel = pathlib.Path(os.path.relpath(path, run_dir)).as_posix()
        lines += [f"### {caption}", "", f"![{caption}]({rel})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Render the run's figures into `out_dir` (default `run_dir/report`) and write `run_dir/report.md`.

    Returns the written paths (the PNGs, then report.md). Metrics the run did not log are skipped; a run
    directory without metrics.jsonl raises ValueError naming the file."""
    run_dir = pathlib.Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: no rows yet; the run has not finished a version")
    out = pathlib.Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    title = run_dir.resolve().name
    figures = []
    for _, caption, plot in FIGURES:
        path = plot(rows, out, title)
        if path is not None:
            figures.append((caption, path))
    report = run_dir / "report.md"
    report.write_text(_markdown(run_dir, figures, summarize(rows, run_dir)))
    return [path for _, path in figures] + [report]


# ------------------------------------------------------------------------------------------ CLI
@dataclasses.dataclass
class ReportArgs:
    """Plot a run's metrics and write report.md into its directory."""

    run_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR")]
    """A run directory written by `asyncrl train` (holds metrics.jsonl)."""
    out: Annotated[str | None, tyro.conf.arg(metavar="DIR")] = None
    """Where the PNGs go (default: RUN_DIR/report)."""


def report_main(args: list[str]) -> None:
    """`asyncrl report RUN_DIR [--out DIR]`: print the written paths, one per line."""
    parsed = tyro.cli(ReportArgs, args=args, prog="asyncrl report")
    try:
        paths = write_report(parsed.run_dir, parsed.out)
    except ValueError as err:
        raise SystemExit(f"asyncrl report: {err}") from None
    for path in paths:
        print(path)
