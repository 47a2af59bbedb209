"""What a run prints: start-up phases, one short line per version, and a progress bar on a terminal.

    line = version_line(metrics, version=12, total=20, wall_s=96.0, eta_s=64.0)
    # 'v 12/20   96s  ETA 1m04s  reward 0.875  len 8.0  lag 1  drift 2.1e-04  sync 0.68s  77 tok/s'

A version line stays under 120 characters. When more than `warn_share` of the version's rewards errored or
timed out, the line ends with a warning (red on a terminal) naming the share. On an interactive terminal
(stdout is a TTY and rich is installed) a progress bar with the ETA sits under the lines.
"""

from __future__ import annotations

import math
import sys
from typing import TextIO

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

__all__ = ["Console", "version_line", "format_seconds", "eta_seconds", "phase"]

LINE_WIDTH = 120
RED, RESET = "\033[31m", "\033[0m"


def format_seconds(seconds: float) -> str:
    """'45s', '3m05s', '2h07m'."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta_seconds(*, version: int, total: int, wall_s: float, first_version: int = 0,
                start_s: float = 0.0, time_budget_s: float | None = None) -> float | None:
    """Seconds left: the mean time per version since `first_version` (at `start_s`) times the versions left,
    capped by what is left of the time budget. None before there is a rate."""
    done = version - first_version
    if done <= 0:
        return None
    left = (wall_s - start_s) / done * max(total - version, 0)
    if time_budget_s is not None:
        left = min(left, max(time_budget_s - wall_s, 0.0))
    return left


def _num(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


_FIELDS = (  # (metric, label, format)
    ("critic/score/mean", "reward", lambda v: f"{v:.3f}"),
    ("response_length/mean", "len", lambda v: f"{v:.1f}"),
    ("actor/entropy", "ent", _num),
    ("training/version_lag/max", "lag", lambda v: f"{v:.0f}"),
    ("actor/behaviour_k1", "drift", lambda v: f"{v:.1e}"),  # KL(μ‖π_θ), k1 (asyncrl.algos.drift)
    ("timing_s/param_sync", "sync", lambda v: f"{v:.2f}s"),
    ("perf/throughput", "tok/s", lambda v: f"{v:.0f}"),
)


def version_line(metrics: dict, *, version: int, total: int | None, wall_s: float, eta_s: float | None,
                 warn_share: float = 0.5, color: bool = False) -> str:
    """One line per version, under LINE_WIDTH characters (see the module docstring); `total` None: open-ended."""
    count = f"{version:{len(str(total))}d}/{total}" if total else f"{version}"
    head = f"v {count}  {format_seconds(wall_s):>6s}"
    if eta_s is not None:
        head += f"  ETA {format_seconds(eta_s)}"
    parts = [head]
    for key, label, fmt in _FIELDS:
        if key in metrics and isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]):
            parts.append(f"{fmt(metrics[key])} {label}" if label == "tok/s" else f"{label} {fmt(metrics[key])}")
    share = metrics.get("reward/error_share")
    warning = ""
    if isinstance(share, (int, float)) and share > warn_share:
        warning = f"  ! {share:.0%} of rewards failed"
        if color:
            warning = f"  {RED}! {share:.0%} of rewards failed{RESET}"
    line = "  ".join(parts)
    room = LINE_WIDTH - 1 - len(warning.replace(RED, "").replace(RESET, ""))
    while len(line) > room and len(parts) > 1:  # drop fields from the end rather than wrap
        parts.pop()
        line = "  ".join(parts)
    return line + warning


def phase(text: str, out: TextIO | None = None) -> None:
    """A start-up line: what the launcher is doing now."""
    print(f"[asyncrl] {text}", file=out or sys.stderr, flush=True)


class Console:
    """The per-version output of a run: a line each, a progress bar on an interactive terminal.

    `total` is the run's --async-training.total-versions; `first_version` the version it starts (or resumes)
    at; `time_budget_s` caps the ETA."""

    def __init__(self, *, total: int | None = None, first_version: int = 0, time_budget_s: float | None = None,
                 warn_share: float = 0.5, out: TextIO | None = None, interactive: bool | None = None):
        self.total, self.first_version, self.time_budget_s = total, first_version, time_budget_s
        self.warn_share, self.out = warn_share, out or sys.stdout
        self.interactive = self.out.isatty() if interactive is None else interactive
        self.start_s: float | None = None
        self.warned_versions: list[tuple[int, float]] = []
        """(version, share) of the versions whose rewards failed beyond warn_share, for the summary."""
        self._bar = None

    def start(self, version: int, wall_s: float) -> None:
        """Where the rate is measured from (a resumed run starts at its checkpoint's version)."""
        self.first_version, self.start_s = version, wall_s

    def _progress(self):
        if self._bar is None and self.interactive and self.total:
            self._bar = Progress(TextColumn("versions"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 transient=True)
            self._bar.start()
            self._task = self._bar.add_task("train", total=self.total, completed=self.first_version)
        return self._bar

    def version(self, metrics: dict, version: int, wall_s: float) -> str:
        if self.start_s is None:  # the rate is measured from the first version on (start-up is not a version)
            self.start(version, wall_s)
        eta = None if not self.total else eta_seconds(version=version, total=self.total, wall_s=wall_s, first_version=self.first_version,
                          start_s=self.start_s, time_budget_s=self.time_budget_s)
        share = metrics.get("reward/error_share")
        if isinstance(share, (int, float)) and share > self.warn_share:
            self.warned_versions.append((version, float(share)))
        line = version_line(metrics, version=version, total=self.total, wall_s=wall_s, eta_s=eta,
                            warn_share=self.warn_share, color=self.interactive)
        bar = self._progress()
        if bar is not None:
            bar.console.print(line, markup=False, highlight=False)
            bar.update(self._task, completed=min(version, self.total))
        else:
            print(line, file=self.out, flush=True)
        return line

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __getstate__(self):  # a Console travels to rank 0 before it prints anything
        state = dict(self.__dict__)
        state["out"], state["_bar"] = None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.out = sys.stdout
        self.interactive = self.out.isatty() and self.interactive
