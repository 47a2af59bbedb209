"""One run per run directory: a new run never writes into a directory that holds another.

    problem = run_dir_problem(cfg)    # preflight: None, or the message naming the directory and the fixes
    note = overwrite_note(cfg)        # what --overwrite will delete (for the preflight's notes)
    removed = clear_run_dir(path)     # --overwrite, in train(): delete what asyncrl wrote there

A run directory is *used* as soon as anything is in it. A new run (no `--resume` / `--resume-or-start`) into
a used one is refused before anything starts, because everything would mix: `metrics.jsonl` and
`samples.jsonl` are appended to, `config.json` replaced, and a later `--resume` could pick the other run's
checkpoint. The fixes: `--resume` (continue that run), `--overwrite` (delete it first) or another `--run-dir`.

`--overwrite` deletes exactly what asyncrl writes into a run directory (`RUN_FILES`) and nothing else: when
the directory holds anything more (a file of yours, another program's output), it is refused before anything
is deleted. Symbolic links among those names are removed, never followed. `--dry-run` deletes nothing.

Under torchrun every rank runs `asyncrl train`; only rank 0 checks and writes the run directory. When torchrun
starts the node's processes again (`--max-restarts`, after a process failed: trainer rank 0's death, say), the run
goes on in its directory rather than being refused there (`after_torchrun_restart`): from its newest checkpoint, or,
without one yet, from the start (what the failed attempt wrote is deleted, as --overwrite would).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
from typing import Mapping

from asyncrl.checkpoint import list_checkpoints
from asyncrl.config import RunConfig
from asyncrl.runtime.kill_points import TORCHRUN_RESTART_ENV

__all__ = ["RUN_FILES", "run_dir_problem", "overwrite_note", "clear_run_dir", "owns_run_dir", "after_torchrun_restart"]

RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl", "summary.json", "processes.json", "report.md",
             "report", "wandb", "checkpoints")
"""What asyncrl writes into a run directory: its config, metrics, samples, summary, process list, `asyncrl
report` output, wandb's files and the checkpoints. `--overwrite` deletes these and only these."""

_SHOWN = 6


def owns_run_dir(cfg: RunConfig) -> bool:
    """Whether this process checks and writes the run directory: always, but under torchrun only rank 0."""
    return cfg.placement.launcher != "torchrun" or os.environ.get("RANK", "0") == "0"


def _entries(path: pathlib.Path) -> list[str]:
    return sorted(p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in path.iterdir()) \
        if path.is_dir() else []


def _listed(names: list[str]) -> str:
    more = len(names) - _SHOWN
    return ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _foreign(names: list[str]) -> list[str]:
    return [n for n in names if n.rstrip("/") not in RUN_FILES]


def _checkpoints(path: pathlib.Path) -> list[pathlib.Path]:
    return list_checkpoints(path)


def _resumable(path: pathlib.Path) -> bool:
    """A checkpoint to resume from: a finished one, or one an interrupted save set aside (repaired on resume)."""
    return bool(_checkpoints(path)) or any((path / "checkpoints").glob("step_*.old"))


def _contents(path: pathlib.Path, names: list[str]) -> str:
    found = _checkpoints(path)
    described = (f"checkpoints/ with {len(found)} checkpoint{'s' * (len(found) != 1)}"
                 + (f", newest {found[-1].name}" if found else ""))
    return _listed([described if n == "checkpoints/" else n for n in names])


def run_dir_problem(cfg: RunConfig) -> str | None:
    """Why this run may not start in --run-dir (None when it may): --overwrite with a resume, a new run into
    a used directory, or --overwrite of a directory holding more than asyncrl's files."""
    path = pathlib.Path(cfg.run_dir)
    if cfg.overwrite and (cfg.resume or cfg.resume_or_start):
        resume = "--resume" if cfg.resume else "--resume-or-start"
        return (f"--overwrite deletes the run in --run-dir {cfg.run_dir} that {resume} continues: pass {resume} "
                "to continue it, or --overwrite to delete it and start a new run, not both")
    names = _entries(path) if owns_run_dir(cfg) else []
    if not names or cfg.resume:
        return None  # --resume: the checkpoint is checked with the resume
    foreign = _foreign(names)
    if cfg.overwrite:
        return None if not foreign else (
            f"--overwrite: --run-dir {cfg.run_dir} also holds {_listed(foreign)}, which asyncrl did not write, so "
            "nothing will be deleted: move that out of it, or choose another --run-dir")
    if cfg.resume_or_start:
        if _resumable(path):
            return None
        return (f"--resume-or-start: --run-dir {cfg.run_dir} holds no checkpoint to resume from but is not empty "
                f"({_contents(path, names)}); a new run there would mix with it: pass --overwrite instead of "
                "--resume-or-start to delete it first, or choose another --run-dir")
    if len(foreign) == len(names):
        return (f"--run-dir {cfg.run_dir} is not empty ({_listed(names)}) and holds no asyncrl run; a run there "
                "would mix with what is in it: choose another --run-dir (or an empty one)")
    overwrite = ("--overwrite to delete it and start over" if not foreign else
                 f"--overwrite once you have moved out what asyncrl did not write ({_listed(foreign)})")
    return (f"--run-dir {cfg.run_dir} already holds a run ({_contents(path, names)}); a new run would mix with it: "
            f"pass --resume to continue it, {overwrite}, or another --run-dir")


def overwrite_note(cfg: RunConfig) -> str | None:
    """What --overwrite will delete, for the preflight's notes (None when nothing)."""
    path = pathlib.Path(cfg.run_dir)
    names = _entries(path)
    if not cfg.overwrite or not names or not owns_run_dir(cfg):
        return None
    return (f"--overwrite: the run starts by deleting {_contents(path, names)} from {cfg.run_dir}"
            + (" (not with --dry-run: nothing is deleted now)" if cfg.dry_run else ""))


def clear_run_dir(path: str | pathlib.Path) -> list[str]:
    """Delete what asyncrl wrote into `path` (`RUN_FILES`; links unlinked, not followed) and return the names
    deleted. Raises ValueError, deleting nothing, when `path` holds anything else."""
    path = pathlib.Path(path)
    names = _entries(path)
    foreign = _foreign(names)
    if foreign:
        raise ValueError(f"--overwrite: --run-dir {path} also holds {_listed(foreign)}, which asyncrl did not "
                         "write, so nothing was deleted: move that out of it, or choose another --run-dir")
    for name in names:
        entry = path / name.rstrip("/")
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return names


def after_torchrun_restart(cfg: RunConfig, env: Mapping[str, str] = os.environ) -> tuple[RunConfig, str | None]:
    """The config a process torchrun started again (`TORCHELASTIC_RESTART_COUNT` > 0) runs with, and the line that
    says what it does (None: not such a process, the config unchanged). The failed attempt left the run directory
    used, which a new run would be refused: the job goes on from the newest checkpoint (`--resume-or-start`, an
    `--overwrite` of the first attempt's command dropped: it would delete that checkpoint), or, with none yet,
    starts again with what the attempt wrote deleted (`--overwrite`). Every rank gets the same config; only rank 0
    reads the directory (`owns_run_dir`)."""
    restarts = int(env.get(TORCHRUN_RESTART_ENV) or 0)
    if cfg.placement.launcher != "torchrun" or restarts <= 0:
        return cfg, None
    path = pathlib.Path(cfg.run_dir)
    if not owns_run_dir(cfg) or _resumable(path):
        how = "resuming from its newest checkpoint"
        cfg = dataclasses.replace(cfg, resume=False, resume_or_start=True, overwrite=False)
    else:
        how = "no checkpoint yet: starting over, deleting what the failed attempt wrote"
        cfg = dataclasses.replace(cfg, resume=False, resume_or_start=False, overwrite=True)
    return cfg, f"torchrun started this job's processes again (restart {restarts}): {how} in {cfg.run_dir}"
