"""From a `RunConfig` to a running job: check it, build its spec (`asyncrl.launch.run_spec`), prepare the run
directory, and train.

    about, cfg = PRESETS["cpu-demo"]
    summary = train(cfg)
"""

from __future__ import annotations

import json
import logging
import pathlib
import time

import torch

from asyncrl.config import RunConfig
from asyncrl.launch.hub_run import named_record
from asyncrl.tracking.console import Console, phase
from asyncrl.launch.preflight import CheckedRun, preflight
from asyncrl.launch.resume_check import config_record, run_record
from asyncrl.rpc.assembly import resolve_resume
from asyncrl.runtime.controller import RunSummary
from asyncrl.runtime.lifecycle import StopRequest, on_signals
from asyncrl.runtime.run_log import RunLog
from asyncrl.rpc.local import LocalRun
from asyncrl.rpc.spec import RunSpec
from asyncrl.rpc.supervise import launch
from asyncrl.rpc.torchrun import run_torchrun
from asyncrl.launch.run_dir import after_torchrun_restart, clear_run_dir, owns_run_dir, run_dir_problem
from asyncrl.tracking import Tracker, TrackingConfig

__all__ = ["train"]

log = logging.getLogger(__name__)


def _prepare_run_dir(cfg: RunConfig, spec: RunSpec, named: dict) -> tuple[pathlib.Path, RunSpec]:
    """Before anything starts (rank 0 of a torchrun job only): refuse a new run into a used run directory
    (`asyncrl.launch.run_dir`), delete the old run with --overwrite, settle the checkpoint a resume reads (and refuse
    a resume without one: the spec comes back with it chosen), and write config.json: the config (with the Hub
    names it was given, and their commits: `asyncrl.launch.hub_run`) and its data fingerprint (`asyncrl.launch.resume_check`),
    which each checkpoint copies."""
    run_dir = pathlib.Path(cfg.run_dir)
    if not owns_run_dir(cfg):
        return run_dir, spec
    problem = run_dir_problem(cfg)
    if problem is not None:
        raise ValueError(problem)
    if cfg.overwrite and (removed := clear_run_dir(run_dir)):
        phase(f"--overwrite: deleted {', '.join(removed)} from {run_dir}")
    spec = resolve_resume(spec)  # a resume without a checkpoint is refused before anything starts
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(named_record(run_record(cfg), named), indent=2))
    return run_dir, spec


def train(run: RunConfig | CheckedRun) -> RunSummary | None:
    """Run training as configured; write run_dir/config.json, metrics.jsonl and summary.json.

    Given a config, every up-front check (`asyncrl.launch.preflight`) runs first; given the `CheckedRun` those checks
    returned, its spec is launched. A bad config raises ValueError listing the problems and leaves no run
    directory behind. A new run into a run directory that holds one is refused unless `cfg.overwrite`
    (`asyncrl.launch.run_dir`); a resume that changes what cannot change is refused (`asyncrl.launch.resume_check`)."""
    checked = run
    if not isinstance(run, CheckedRun):
        run, restarted = after_torchrun_restart(run)
        if restarted is not None and owns_run_dir(run):
            log.warning("%s", restarted)
        checked = preflight(run)
    if not checked.ok:
        raise ValueError("\n  ".join(["the run cannot start:", *checked.problems]))
    if checked is not run:
        for note in checked.notes:
            log.info("note: %s", note)
    cfg = checked.config
    run_dir, spec = _prepare_run_dir(cfg, checked.spec, checked.named)
    console = Console(total=cfg.async_training.total_versions, time_budget_s=cfg.async_training.time_budget_s,
                      warn_share=cfg.reward.error_warn_share)
    tracker = Tracker(TrackingConfig(run_dir=cfg.run_dir, wandb=cfg.wandb),
                      run_config=named_record(config_record(cfg), checked.named),
                      console=console)
    _announce(spec, cfg.placement.launcher)
    start = time.time()
    try:
        summary = _launch(spec, cfg.placement.launcher, tracker)
    finally:
        tracker.close()
    if summary is None:  # a torchrun rank other than 0: nothing to report
        return None
    (run_dir / "summary.json").write_text(json.dumps(
        {"versions": summary.versions, "steps": summary.steps, "ledger": summary.ledger,
         "dead_agents": summary.dead_agents, "agents": summary.agents, "interrupted": summary.interrupted,
         "checkpoint": summary.checkpoint, "rewards": summary.rewards, "trainer_recoveries": summary.trainer_recoveries,
         "wall_s": time.time() - start}, indent=2))
    return summary


def _announce(spec: RunSpec, launcher: str) -> None:
    """The start-up line of the launch: which processes start where."""
    if launcher == "local":
        phase(f"running in this process: the trainer and {len(spec.agents)} rollout agent thread(s)")
        return
    if launcher == "torchrun":
        return  # every rank is its own process, started by torchrun
    trainers = ", ".join(f"trainer{r} on {d}" for r, d in enumerate(spec.trainer_devices))
    if spec.colocate:
        phase(f"starting {spec.num_trainers} processes: {trainers} (each hosts a rollout engine)")
        return
    agents = ", ".join(f"agent{i} on {a.device}" for i, a in enumerate(spec.agents))
    count = spec.num_trainers + len(spec.agents)
    phase(f"starting {count} process{'es' * (count != 1)}: {trainers}; {agents}")


def _launch(spec: RunSpec, launcher: str, run_log: RunLog) -> RunSummary | None:
    """Run `spec` with `launcher`, logging to `run_log`; the summary (None on a torchrun rank other than 0)."""
    if launcher == "rpc":
        return launch(spec, run_log=run_log)
    if launcher == "torchrun":
        return run_torchrun(spec, run_log=run_log)
    return _train_local(spec, run_log)


def _train_local(spec: RunSpec, run_log: RunLog) -> RunSummary:
    torch.set_num_threads(spec.placement.threads_per_process)
    stop = StopRequest()
    on_signals(stop.set)
    return LocalRun.from_spec(spec, run_log=run_log, stop=stop).run()
