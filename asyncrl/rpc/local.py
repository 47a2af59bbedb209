"""The in-process launcher: the trainer in this thread, each rollout agent in its own thread, no network.

Same objects as the multi-process launcher (`SampleQueue`, `Controller`, `RolloutAgent`); only the
transport differs: agents call the controller directly and weights are copied tensor by tensor
(`LocalPublisher`). Use it for tests, debugging and single-machine runs where every engine fits in one
process (several GPUs included: put each engine on its own device).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from asyncrl.algos.staleness import verl_max_required_samples
from asyncrl.config import AsyncConfig, RolloutConfig
from asyncrl.data.scoring import Scorer
from asyncrl.data.sources import PromptSource
from asyncrl.learner import LearnerState
from asyncrl.policies.engine import Engine
from asyncrl.rpc.agent import RolloutAgent
from asyncrl.rpc.controller import Controller, RunSummary
from asyncrl.rpc.param_server import LocalPublisher
from asyncrl.rpc.queue import SampleQueue

__all__ = ["LocalRun"]

log = logging.getLogger("asyncrl.local")


@dataclasses.dataclass
class LocalRun:
    """Wire a learner, engines and a prompt source into a run; `run()` trains and returns the summary."""

    state: LearnerState
    engines: list[Engine]
    source: PromptSource
    scorer: Scorer
    rollout: RolloutConfig
    config: AsyncConfig
    seed: int = 0
    log_metrics: Callable[[dict, int], None] | None = None
    run_dir: str | None = None
    checkpoint_every: int = 0
    step_delays: list[float] | None = None  # tests: per-agent slowdown

    def __post_init__(self):
        self.rollout.validate()
        self.config.validate()
        max_required = verl_max_required_samples(self.state.config.mini_batch_size, self.config.require_batches,
                                                 self.config.staleness_threshold,
                                                 self.config.trigger_parameter_sync_step)
        self.queue = SampleQueue(self.source, max_required_samples=max_required, version=self.state.version,
                                 seed=self.seed, max_version_lag=self.config.max_version_lag,
                                 lag_policy=self.config.lag_policy)
        delays = self.step_delays or [0.0] * len(self.engines)
        self.agents = [RolloutAgent(f"agent{i}", engine, self.scorer, self.rollout, None,
                                    colocated=self.config.colocated and self.config.colocated_sleep,
                                    step_delay_s=delays[i])
                       for i, engine in enumerate(self.engines)]
        dtype = self.engines[0].model.dtype
        self.publisher = LocalPublisher(self.agents, partial_rollout=self.config.partial_rollout,
                                        timeout=self.config.sync_timeout_s, dtype=dtype)
        self.controller = Controller(self.queue, self.state, self.publisher, self.config,
                                     log_metrics=self.log_metrics, run_dir=self.run_dir,
                                     checkpoint_every=self.checkpoint_every, agent_metrics=self._agent_metrics)
        for agent in self.agents:
            agent.controller = self.controller

    def _agent_metrics(self) -> dict:
        windows = [a.window_metrics() for a in self.agents if a.name not in self.controller.dead]
        if not windows:
            return {}
        return {k: sum(w[k] for w in windows) / len(windows) for k in windows[0]}

    def resume(self, extra: dict) -> None:
        """Restore the queue (cursor, queued groups, unfinished prompts) from a checkpoint's extra."""
        self.queue.load_state_dict(extra["queue"])

    def run(self) -> RunSummary:
        if self.state.version > 0:  # resumed: the engines start from the initial weights
            self.publisher.publish(self.state, self.state.version)
        for agent in self.agents:
            agent.start()
        try:
            summary = self.controller.run()
        finally:
            for agent in self.agents:
                agent.stop()
        summary.ledger = self.controller.finish()
        errors = [f"{a.name}: {a.error!r}" for a in self.agents if a.error is not None]
        if errors:
            log.error("agents stopped on errors: %s", "; ".join(errors))
        return summary
