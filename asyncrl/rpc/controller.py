"""The run loop on the trainer: take groups as they stream in, train, publish weights, account, checkpoint.

    controller = Controller(queue, learner_state, publisher, async_cfg)
    summary = controller.run()          # agents must be running (they call request / submit / heartbeat)

One version window = `trigger_parameter_sync_step` learner steps, each on `require_batches ×
mini_batch_size` groups taken oldest-first from the queue (DAPO's dynamic sampling drops all-equal groups
and takes more), then one publication. With `lag_policy="wait"` the publication is held back (the trainer
keeps training on queued groups) until no queued or in-flight work would exceed `max_version_lag`.
An agent silent for `agent_timeout_s` is declared dead, named in the log, and its in-flight prompts are
re-admitted to the others; with no agent left the run stops with a clear error.
Metrics per version use verl's names (`fully_async/*`, `timing_s/*`, `trainer/idle_ratio`, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import time
from typing import Callable

from asyncrl.checkpoint import save_checkpoint
from asyncrl.config import AsyncConfig
from asyncrl.learner import LearnerState, filter_groups, train_step
from asyncrl.rpc.queue import QueueTimeout, SampleQueue
from asyncrl.types import Group

__all__ = ["Controller", "RunSummary"]

log = logging.getLogger("asyncrl.controller")


@dataclasses.dataclass
class RunSummary:
    versions: int
    steps: int
    ledger: dict
    dead_agents: list[str]
    history: list[dict]


class Controller:
    def __init__(self, queue: SampleQueue, state: LearnerState, publisher, config: AsyncConfig, *,
                 log_metrics: Callable[[dict, int], None] | None = None, run_dir: str | pathlib.Path | None = None,
                 checkpoint_every: int = 0, keep_checkpoints: int = 3,
                 agent_metrics: Callable[[], dict] | None = None, on_step: Callable[[list[Group], dict], None] | None = None):
        config.validate()
        self.queue, self.state, self.publisher, self.config = queue, state, publisher, config
        self.log_metrics = log_metrics or (lambda metrics, step: None)
        self.run_dir, self.checkpoint_every, self.keep = run_dir, checkpoint_every, keep_checkpoints
        self.agent_metrics = agent_metrics or (lambda: {})
        self.on_step = on_step
        self.step_fn: Callable = train_step  # (state, groups) -> (state, metrics); rank 0 of a group wraps it
        self.checkpoint_fn: Callable | None = None  # replaces `checkpoint()` (multi-rank trainer groups)
        agents = publisher.agents if publisher is not None else []
        self.last_heard: dict[str, float] = {name: time.monotonic() for name in agents}
        self.dead: list[str] = []
        self.lock = threading.Lock()
        self.history: list[dict] = []
        self.reward_errors: dict[str, int] = {}
        self.stop_requested = threading.Event()
        self.fatal: BaseException | None = None  # set from an RPC thread, raised by the trainer loop

    # --------------------------------------------------------------------- agent-facing (RPC threads)
    def _heard(self, agent: str) -> None:
        with self.lock:
            if agent not in self.dead:
                self.last_heard[agent] = time.monotonic()

    def request(self, agent: str, n: int):
        self._heard(agent)
        if agent in self.dead:
            return []
        live = len(self.last_heard) - len(self.dead)
        # fair share of a version's admissions among the live agents (first come would let one take it all)
        share = -(-self.queue.budget.max_required_samples // live) if live > 1 else None
        return self.queue.request(agent, n, share=share)

    def submit(self, agent: str, group: Group) -> None:
        self._heard(agent)
        self.queue.submit(agent, group)

    def heartbeat(self, agent: str) -> None:
        self._heard(agent)

    def agent_failed(self, agent: str, why: str) -> None:
        """An agent whose loop raised says so: dead now, not after agent_timeout_s of silence."""
        try:
            self.declare_dead(agent, why)
        except RuntimeError as err:  # the last agent: the trainer loop raises it
            self.fatal = err

    # ---------------------------------------------------------------------------- agent health
    def _check_agents(self) -> None:
        if self.fatal is not None:
            raise self.fatal
        now = time.monotonic()
        with self.lock:
            silent = [a for a, t in self.last_heard.items()
                      if a not in self.dead and now - t > self.config.agent_timeout_s]
        for agent in silent:
            self.declare_dead(agent, f"silent for {now - self.last_heard[agent]:.1f} s "
                                     f"(agent_timeout_s={self.config.agent_timeout_s})")

    def declare_dead(self, agent: str, why: str) -> None:
        with self.lock:
            if agent in self.dead:
                return
            self.dead.append(agent)
        ids = self.queue.agent_failed(agent)
        self.publisher.remove(agent)
        log.error("rollout agent %s is dead (%s); re-admitting its %d in-flight prompts to the others",
                  agent, why, len(ids))
        if not self.publisher.agents:
            raise RuntimeError(f"every rollout agent is dead (last: {agent}, {why}); the run cannot continue")

    # -------------------------------------------------------------------------------- the loop
    def _take(self, n: int) -> tuple[list[Group], float]:
        """n groups (after dynamic sampling), and the seconds spent waiting for them."""
        start, out = time.monotonic(), []
        deadline = start + self.config.take_timeout_s
        while len(out) < n:
            try:
                groups = self.queue.take(n - len(out), timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            except QueueTimeout:
                self._check_agents()
                if time.monotonic() > deadline:
                    raise
                continue
            if self.state.algorithm.filter_groups:
                groups, dropped = filter_groups(groups)
                for g in dropped:
                    self.queue.drop(g, "filtered")
            out += groups
        return out, time.monotonic() - start

    def _learner_step(self) -> dict:
        n = self.config.require_batches * self.state.config.mini_batch_size
        self._check_agents()  # also when the others keep the trainer fed (then `_take` never times out)
        groups, waited = self._take(n)
        start = time.monotonic()
        self.state, metrics = self.step_fn(self.state, groups)
        self.queue.trained(groups)
        if self.on_step is not None:
            self.on_step(groups, metrics)
        versions = [(g.min_version, g.max_version) for g in groups]
        lags = [self.state.version - lo for lo, _ in versions]
        for lag in set(lags):  # histogram of trained groups' version lag (summed over a window, then a run)
            metrics[f"training/version_lag/hist/{lag}"] = lags.count(lag)
        for g in groups:  # agents report their scorer's cumulative error count
            self.reward_errors[g.info.get("agent", "")] = g.info.get("reward_errors", 0)
        metrics["reward/errors"] = sum(self.reward_errors.values())
        metrics.update({
            "timing_s/gen": waited, "timing_s/update_actor": time.monotonic() - start,
            "fully_async/partial/partial_ratio": sum(lo != hi for lo, hi in versions) / len(versions),
            "fully_async/partial/max_partial_span": max(hi - lo for lo, hi in versions),
            "training/version_lag/max_group": max(self.state.version - lo for lo, _ in versions),
        })
        return metrics

    def _window(self) -> dict:
        """One version window: trigger learner steps (more while the lag gate is closed), then publish."""
        start = time.monotonic()
        steps = [self._learner_step() for _ in range(self.config.trigger_parameter_sync_step)]
        while not self.queue.lag_gate_open(self.state.version + 1):
            # hold the publication back; open a new admission window at the same version so the
            # trainer stays fed while the old work finishes and is consumed
            self.queue.new_version(self.state.version)
            steps.append(self._learner_step())
        sync_start = time.monotonic()
        sync = self.publish(self.state.version + 1)
        metrics = _merge(steps)
        total = time.monotonic() - start
        tokens = sum(m["perf/total_num_tokens"] for m in steps)
        for extra in (sync, self.queue.metrics(), self.agent_metrics()):
            metrics.update(extra)
        metrics.update({"timing_s/step": total, "perf/time_per_step": total, "perf/throughput": tokens / total,
                        "trainer/idle_ratio": sum(m["timing_s/gen"] for m in steps) / total,
                        "timing_s/param_sync_total": time.monotonic() - sync_start,
                        "fully_async/dead_agents": len(self.dead)})
        return metrics

    def publish(self, version: int) -> dict:
        metrics = self.publisher.publish(self.state, version)
        for agent in [a for a in self.last_heard if a not in self.dead and a not in self.publisher.agents]:
            # the publisher left it out (its sync failed twice): dead, so its prompts go to the others
            self.declare_dead(agent, "its weight sync failed")
        self.state.version = version
        self.queue.new_version(version)
        return metrics

    def run(self) -> RunSummary:
        """Train until `total_versions` publications (or `time_budget_s`); then admit nothing more and close
        the books."""
        start, budget = time.monotonic(), self.config.time_budget_s
        while self.state.version < self.config.total_versions and not self.stop_requested.is_set():
            if budget is not None and time.monotonic() - start >= budget:
                log.info("time budget of %.0f s spent after version %d", budget, self.state.version)
                break
            metrics = self._window()
            self.history.append(metrics)
            self.log_metrics(metrics, self.state.version)
            if self.checkpoint_every and self.run_dir and self.state.version % self.checkpoint_every == 0:
                (self.checkpoint_fn or self.checkpoint)()
        self.queue.close()
        return RunSummary(self.state.version, self.state.step, self.queue.ledger.summary(), list(self.dead),
                          self.history)

    def checkpoint(self) -> pathlib.Path:
        return save_checkpoint(self.run_dir, self.state, extra={"queue": self.queue.state_dict()},
                               keep_last=self.keep)

    def finish(self) -> dict:
        """End of run. If the last version was checkpointed, unfinished prompts are *carried* (the checkpoint
        re-admits them on resume); otherwise each is dropped with reason "run_end". Returns the ledger."""
        final_checkpoint = bool(self.checkpoint_every and self.run_dir
                                and self.state.version % self.checkpoint_every == 0)
        if final_checkpoint:
            return {**self.queue.ledger.summary(), "carried_to_checkpoint": True}
        with self.queue.lock:
            for pid in self.queue.ledger.ids("queued") + self.queue.ledger.ids("in_flight") + \
                    self.queue.ledger.ids("pending"):
                self.queue.ledger.drop(pid, "run_end")
            self.queue.queue.clear()
        return self.queue.ledger.summary()


def _merge(steps: list[dict]) -> dict:
    """Average per-step metrics over the window; sum timings and counts; keep the last of counters."""
    out: dict = {}
    for key in dict.fromkeys(k for m in steps for k in m):
        values = [m[key] for m in steps if key in m]
        if key.startswith(("timing_s/", "training/version_lag/hist/")) or key in ("perf/total_num_tokens",):
            out[key] = sum(values)
        elif key.endswith(("/max", "max_partial_span", "max_group")):
            out[key] = max(values)
        elif key in ("training/global_step", "actor/skipped_updates", "actor/lr", "reward/errors"):
            out[key] = values[-1]
        else:
            out[key] = sum(values) / len(values)
    return out
