"""A running job's version as the split planner sees it (`asyncrl.planning`): the idle fractions its own busy times
predict, beside the measured `trainer/idle_ratio` and `rollouter/idle_ratio`, and a split of the GPUs predicted to
train faster, if there is one. The controller asks its `PlanAdvisor` once a version; the math is the planner's.

    advisor = PlanAdvisor(Layout("split", 1, 1), every=10)
    advisor.view(metrics, version)   # plan/* metrics; at most every 10 versions a log line with a better split

    view = runtime_plan(Layout("split", 1, 1), tokens=146_000, response_tokens=130_700, train_s=14.3,
                        gen_s=10.1, sync_s=0.013)
    view.metrics()       # plan/trainer_idle_predicted, plan/rollout_idle_predicted, ...
    view.advice(layout)  # None, or 'one agent GPU more (1+1 -> 1+2) would raise trained tok/s by ~40%'
"""

from __future__ import annotations

import dataclasses
import logging

from asyncrl.planning import ADVICE_GAIN, Layout, timeline, trainer_scale

__all__ = ["RuntimePlan", "runtime_plan", "PlanAdvisor"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RuntimePlan:
    trainer_idle: float  # predicted trainer/idle_ratio
    rollout_idle: float  # predicted rollouter/idle_ratio
    trained_tok_s: float  # predicted trained tokens per second
    trainer_tok_s: float  # trained tokens per second of the trainer group while busy
    rollout_tok_s: float  # generated tokens per second of one agent while busy
    better: Layout | None  # a split predicted to train at least ADVICE_GAIN faster
    gain: float  # its predicted gain in trained tok/s (0 without one)

    def metrics(self) -> dict:
        return {"plan/trainer_idle_predicted": self.trainer_idle, "plan/rollout_idle_predicted": self.rollout_idle,
                "plan/trained_tok_s_predicted": self.trained_tok_s, "plan/trainer_tok_s_busy": self.trainer_tok_s,
                "plan/rollout_tok_s_busy": self.rollout_tok_s, "plan/split_gain_predicted": self.gain}

    def advice(self, layout: Layout) -> str | None:
        """E.g. 'one agent GPU more (1+1 -> 1+2) would raise trained tok/s by ~58%'; None without a better split."""
        if self.better is None:
            return None
        b, more_agents = self.better, self.better.agent_gpus > layout.agent_gpus
        if b.trainer_gpus + b.agent_gpus > layout.trainer_gpus + layout.agent_gpus:
            what = "one agent GPU more" if more_agents else "one trainer GPU more"
        else:
            what = "moving a trainer GPU to the agents" if more_agents else "moving an agent GPU to the trainer"
        return (f"{what} ({layout.trainer_gpus}+{layout.agent_gpus} -> {b.trainer_gpus}+{b.agent_gpus}) would raise "
                f"trained tok/s by ~{self.gain:.0%}")


def runtime_plan(layout: Layout, *, tokens: float, response_tokens: float, train_s: float, gen_s: float,
                 sync_s: float, compiled: bool = False) -> RuntimePlan | None:
    """One version: `tokens` trained (`response_tokens` of them generated), the trainer group busy `train_s`, each
    agent busy `gen_s` on average, the publication `sync_s` (seconds). What was generated in a version is taken as
    what was trained in it (steady state); busy times measured beside the other side already hold any sharing of a
    GPU, so a shared layout is predicted as a split one, with no boundary wait. For a split, its neighbours (a GPU
    moved from one side to the other, or one more on a side) are predicted with rates linear in GPUs
    (`trainer_scale`: a group's per-GPU efficiency where it grows from one `compiled` rank); the best move wins,
    else the best addition, if it gains ADVICE_GAIN. None without both busy times."""
    if min(tokens, train_s, gen_s) <= 0:
        return None
    kind = "colocated" if layout.kind == "colocated" else "split"
    version, trainer_idle, rollout_idle = timeline(kind, train_s, gen_s, sync_s)
    better, gain = None, 0.0
    if layout.kind == "split":
        k, a = layout.trainer_gpus, layout.agent_gpus

        def version_at(k2: int, a2: int) -> float:
            return max(train_s * trainer_scale(k, compiled) / trainer_scale(k2, compiled), gen_s * a / a2) + sync_s
        moves = [(k - 1, a + 1)] * (k > 1) + [(k + 1, a - 1)] * (a > 1)
        for options in (moves, [(k + 1, a), (k, a + 1)]):
            ratio, best = max(((version / version_at(*ka), ka) for ka in options), default=(0.0, None))
            if ratio - 1 >= ADVICE_GAIN:
                better, gain = Layout("split", *best), ratio - 1
                break
    return RuntimePlan(trainer_idle, rollout_idle, tokens / version, tokens / train_s,
                       response_tokens / (layout.agent_gpus * gen_s), better, gain)


class PlanAdvisor:
    """The planner's view of each version of a run on `layout` (`compiled`: its trainer compiles its layers on
    GPUs): the version's `plan/*` metrics, and, at most every `every` versions, a log line when another split of
    the GPUs is predicted to train faster."""

    def __init__(self, layout: Layout, *, compiled: bool = False, every: int = 10):
        self.layout, self.compiled, self.every = layout, compiled, every
        self._advised_at: int | None = None  # the version of the last advice logged

    def view(self, metrics: dict, version: int) -> dict:
        """`plan/*` from a version's own busy times in `metrics` (the controller's row: `perf/total_num_tokens`,
        `perf/response_tokens`, `timing_s/update_actor`, `rollouter/active_time`, `timing_s/param_sync_total`);
        {} until both sides were busy."""
        estimate = runtime_plan(
            self.layout, tokens=metrics.get("perf/total_num_tokens", 0), response_tokens=metrics.get(
                "perf/response_tokens", 0), train_s=metrics.get("timing_s/update_actor", 0.0),
            gen_s=metrics.get("rollouter/active_time", 0.0), sync_s=metrics.get("timing_s/param_sync_total", 0.0),
            compiled=self.compiled)
        if estimate is None:
            return {}
        advice = estimate.advice(self.layout)
        if advice and (self._advised_at is None or version - self._advised_at >= self.every):
            self._advised_at = version
            log.info("plan: trainer idle %.2f (predicted %.2f), rollout idle %.2f (predicted %.2f): %s "
                     "(see `asyncrl plan`)", metrics["trainer/idle_ratio"], estimate.trainer_idle,
                     metrics.get("rollouter/idle_ratio", float("nan")), estimate.rollout_idle, advice)
        return estimate.metrics()
