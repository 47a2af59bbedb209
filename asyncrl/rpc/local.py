"""The in-process launcher: the trainer in this thread, each rollout agent in its own thread, no network.

Same objects as the multi-process launcher (`SampleQueue`, `Roster`, `Controller`, `RolloutAgent`); only the
transport differs: agents call the roster directly and weights are copied tensor by tensor
(`LocalPublisher`). Use it for tests, debugging and single-machine runs where every engine fits in one
process (several GPUs included: put each engine on its own device).

    run = LocalRun.from_spec(spec, run_log=tracker)     # built like the multi-process run (assembly)
    run = LocalRun(state, engines, source, scorer, rollout_cfg, async_cfg)   # or from parts
    summary = run.run()
"""

from __future__ import annotations

import logging
import pathlib
from typing import Callable

from asyncrl.checkpoint import load_checkpoint, save_checkpoint
from asyncrl.config import AsyncConfig, RolloutConfig
from asyncrl.data.scoring import Scorer
from asyncrl.data.sources import PromptSource
from asyncrl.envs import EnvRuntime
from asyncrl.learner import LearnerState, train_step
from asyncrl.planning import Layout, layout_of
from asyncrl.policies.protocol import RolloutEngine
from asyncrl.rpc.assembly import (build_engine, build_evals, build_learner_state, checkpoint_policy, resolve_resume,
                                  resume_info, sample_queue)
from asyncrl.rpc.param_server import LocalPublisher
from asyncrl.rpc.spec import RunSpec
from asyncrl.runtime.agent import RolloutAgent, heartbeat_period, mean_windows
from asyncrl.runtime.controller import CheckpointPolicy, Controller, RunParts, RunSummary
from asyncrl.runtime.eval_schedule import EvalSchedule
from asyncrl.runtime.evaluation import EvalBoard
from asyncrl.runtime.lifecycle import StopRequest
from asyncrl.runtime.roster import Roster
from asyncrl.runtime.run_log import QuietLog, RunLog

__all__ = ["LocalRun", "LocalTrainer"]

log = logging.getLogger(__name__)


class LocalTrainer:
    """A single-process trainer group (the interface rank 0 of a multi-rank group has, without followers)."""

    def step(self, state: LearnerState, groups):
        return train_step(state, groups)

    def checkpoint(self, run_dir: str, state: LearnerState, extra: dict, keep: int):
        return save_checkpoint(run_dir, state, extra=extra, keep_last=keep)

    def keep_books(self, state: LearnerState, books) -> None:
        """One process keeps no restore points: its death ends the run (resume from a checkpoint)."""


class LocalRun:
    """Wire a learner, engines and a prompt source into a run; `run()` trains and returns the summary."""

    def __init__(self, state: LearnerState, engines: list[RolloutEngine], source: PromptSource, scorer: Scorer,
                 rollout: RolloutConfig, config: AsyncConfig, *, seed: int = 0, run_log: RunLog | None = None,
                 checkpoints: CheckpointPolicy = CheckpointPolicy(), resume_extra: dict | None = None,
                 stop: StopRequest | None = None, trainer=None, env_setup: Callable[[], EnvRuntime] | None = None,
                 layout: Layout | None = None, evals: EvalBoard | None = None, eval_slots: int = 0):
        """`resume_extra`: what a checkpoint holds beside the learner (`state`, restored already): the queue's
        cursor, queued groups and unfinished prompts, the run's window and the evaluation schedule. `evals`:
        the held-out evaluation board, of which an agent holds at most `eval_slots` prompts at once."""
        rollout.validate()
        config.validate()
        self.state, self.engines, self.config = state, engines, config
        self.queue = sample_queue(source, state.config.mini_batch_size, config, seed=seed, version=state.version)
        if resume_extra is not None:  # cursor, queued groups, unfinished prompts
            self.queue.load_state_dict(resume_extra["queue"])
        resumed = resume_extra or {}
        self.roster = Roster(self.queue, agent_timeout_s=config.agent_timeout_s, evals=evals, eval_slots=eval_slots)
        self.agents = [RolloutAgent(f"agent{i}", engine, scorer, rollout, self.roster,
                                    colocated=config.colocated and config.colocated_sleep,
                                    heartbeat_s=heartbeat_period(config.agent_timeout_s),
                                    env=env_setup() if env_setup is not None else None)
                       for i, engine in enumerate(engines)]
        for agent in self.agents:
            self.roster.add(agent.name, live=True)
            self.roster.synced(agent.name, agent.engine.version)
        dtype = getattr(getattr(engines[0], "model", None), "dtype", None)
        self.publisher = LocalPublisher(self.agents, self.roster, partial_rollout=config.partial_rollout,
                                        timeout=config.sync_timeout_s, dtype=dtype)
        schedule = None if evals is None else EvalSchedule(evals, self.roster, resumed=resumed.get("evals"),
                                                            version=state.version)
        parts = RunParts(self.queue, self.roster, self.publisher, trainer or LocalTrainer(), self._agent_metrics)
        self.controller = Controller(parts, state, config, run_log=run_log, checkpoints=checkpoints, stop=stop,
                                     window_steps=int(resumed.get("run", {}).get("window_steps", 0)),
                                     evals=schedule, layout=layout)

    @classmethod
    def from_spec(cls, spec: RunSpec, *, run_log: RunLog | None = None, stop: StopRequest | None = None,
                  ) -> "LocalRun":
        """The run a `RunSpec` describes, every agent a thread of this process; resumed when the spec says so
        (`run_log` goes on from the checkpoint's version and wall clock)."""
        run_log = run_log if run_log is not None else QuietLog()
        chosen = resolve_resume(spec).resume_from
        path = pathlib.Path(chosen) if chosen is not None else None
        state = build_learner_state(spec, spec.trainer_devices[0])
        extra = None
        if path is not None:
            extra = load_checkpoint(path, state)
            info = resume_info(path, state, extra)
            log.info(info.line())
            run_log.resume(info.version, info.wall_s)
        engines = [build_engine(spec, agent, slot, f"agent{slot}") for slot, agent in enumerate(spec.agents)]
        evals, eval_slots = build_evals(spec)
        return cls(state, engines, spec.source_factory(), spec.scorer_factory(), spec.rollout, spec.async_,
                   seed=spec.seed, run_log=run_log, checkpoints=checkpoint_policy(spec),
                   resume_extra=extra, stop=stop, env_setup=spec.env_setup,
                   layout=layout_of(spec.trainer_devices, [a.device for a in spec.agents], spec.async_.colocated),
                   evals=evals, eval_slots=eval_slots)

    def _agent_metrics(self) -> dict:
        return mean_windows([a.window_metrics() for a in self.agents if self.roster.is_live(a.name)])

    def run(self) -> RunSummary:
        if self.state.version > 0:  # resumed: the engines start from the initial weights
            self.publisher.publish(self.state, self.state.version)
        for agent in self.agents:
            agent.start()
        self.roster.start()
        try:
            end = self.controller.train()
        finally:
            self.roster.stop()
            for agent in self.agents:
                try:
                    agent.stop()
                except TimeoutError as err:  # stuck: its late deliveries are fenced below
                    log.error("%s", err)
                self.roster.leave(agent.name, "run ended", readmit=False)
        summary = self.controller.summary(end)
        errors = [f"{a.name}: {a.error!r}" for a in self.agents if a.error is not None]
        if errors:
            log.error("agents stopped on errors: %s", "; ".join(errors))
        return summary
