"""Experiment tracking: a console line per version, a metrics JSONL in the run directory, and wandb.

    tracker = Tracker(TrackingConfig(run_dir="runs/demo", wandb="auto"), run_config=config_record)
    tracker(metrics, step)        # the run's `RunLog` (`asyncrl.runtime.run_log`): launch(spec, run_log=tracker)
    tracker.close()

wandb: "auto" logs online when an API key is configured and offline otherwise (sync later with
`wandb sync`); "off" disables it; "online" / "offline" force a mode. Nothing is opened until the first
log, so a Tracker pickles cleanly to the process that logs (rank 0), which closes its copy at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time
from typing import Literal

from asyncrl.tracking.console import Console

__all__ = ["TrackingConfig", "Tracker", "read_metrics"]


@dataclasses.dataclass
class TrackingConfig:
    """Where metrics go."""

    run_dir: str = "runs/default"
    """Metrics JSONL, checkpoints and the report land here."""
    wandb: Literal["auto", "online", "offline", "off"] = "auto"
    """wandb mode: auto = online when logged in, offline otherwise."""
    project: str = "asyncrl"
    """wandb project."""
    name: str | None = None
    """wandb run name (default: the run directory's name)."""
    console: bool = True
    """Print one line per version (`asyncrl.tracking.console`)."""


def _wandb_mode(requested: str) -> str | None:
    if requested == "off":
        return None
    try:
        import wandb  # noqa: F401
    except ImportError:
        return None
    if requested != "auto":
        return requested
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or (pathlib.Path.home() / ".netrc").is_file() and \
        "api.wandb.ai" in (pathlib.Path.home() / ".netrc").read_text(errors="ignore")
    return "online" if logged_in else "offline"


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


class Tracker:
    def __init__(self, config: TrackingConfig, *, run_config: dict | None = None, console: Console | None = None):
        self.config, self.run_config = config, run_config or {}
        self.console = console if console is not None or not config.console else Console()
        self._file = None
        self._samples = None
        self._wandb = None
        self._start = time.time()  # wall clock of the run (the tracker is made at launch)

    def _open(self) -> None:
        run_dir = pathlib.Path(self.config.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        mode = _wandb_mode(self.config.wandb)
        if mode is not None:
            import wandb
            self._wandb = wandb.init(project=self.config.project, name=self.config.name or run_dir.name,
                                     dir=str(run_dir), mode=mode, config=self.run_config, reinit=True)

    def wall_s(self) -> float:
        """Seconds since the run started (continued across resumes)."""
        return time.time() - self._start

    def resume(self, version: int, wall_s: float) -> None:
        """Continue a run from its checkpoint at `version`: rows logged after that checkpoint by the
        interrupted run are dropped from metrics.jsonl (they will be logged again), and the wall-clock goes on
        from `wall_s`."""
        self._start = time.time() - wall_s
        if self.console is not None:
            self.console.start(version, wall_s)
        path = pathlib.Path(self.config.run_dir) / "metrics.jsonl"
        if path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= version]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)

    def __call__(self, metrics: dict, step: int) -> None:
        if self._file is None:
            self._open()
        row = {"step": step, "wall_s": self.wall_s(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self.console is not None:
            self.console.version(metrics, step, row["wall_s"])

    def log_samples(self, groups: list, metrics: dict | None = None, *, per_step: int = 2) -> None:
        """Append a few decoded completions of a learner step to samples.jsonl (what the model writes)."""
        if self._file is None:
            self._open()
        if self._samples is None:
            self._samples = open(pathlib.Path(self.config.run_dir) / "samples.jsonl", "a", buffering=1)
        step = (metrics or {}).get("training/global_step")
        for g in groups[:per_step]:
            texts = g.info.texts or [""] * len(g.completions)
            best = max(range(len(g.rewards)), key=lambda i: g.rewards[i])
            worst = min(range(len(g.rewards)), key=lambda i: g.rewards[i])
            for i in sorted({best, worst}):
                self._samples.write(json.dumps({"step": step, "prompt_id": g.prompt_id,
                                                "prompt": g.info.prompt_text, "response": texts[i],
                                                "reward": g.rewards[i], "versions": [g.completions[i].min_version,
                                                                                     g.completions[i].max_version]})
                                    + "\n")

    def close(self) -> None:
        """Close the files and finish the wandb run; closing again does nothing (a log that is opened again
        appends)."""
        if self.console is not None:
            self.console.close()
        for f in (self._file, self._samples):
            if f is not None:
                f.close()
        self._file = self._samples = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(run_dir: str | pathlib.Path, *, live: bool = False) -> list[dict]:
    """The rows of a run's metrics JSONL (raises naming the file when it is missing or malformed). `live`: the run
    may still be writing it: a last line not yet ended is left out, and a missing file has no rows."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        if live:
            return []
        raise ValueError(f"{path}: no metrics file; point at a run directory written by `asyncrl train`")
    text = path.read_text()
    lines = text.split("\n")[:-1] if live else text.splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{i}: not a JSON line ({err.msg})") from None
    return rows
