"""The fully-async knobs (`--async-training.*`, verl's names); `asyncrl.config` re-exports it as
`RunConfig.async_training`."""

from __future__ import annotations

import dataclasses
from typing import Literal

from asyncrl.config.flags import fail as _fail

__all__ = ["AsyncConfig"]


@dataclasses.dataclass
class AsyncConfig:
    """The fully-async knobs (verl's names). Modes are combinations:
    colocated sync = `colocated=True`, staleness 0, trigger 1; one-step-off = staleness 1, trigger 1,
    `max_version_lag=1`, `lag_policy="wait"`; stream = staleness 0, trigger > 1; stale = staleness > 0;
    stale + partial = add `partial_rollout`. Staleness bounds how much runs ahead, not the lag of one slow
    agent's group: only `max_version_lag` bounds that."""

    staleness_threshold: float = 0.5
    """Extra fraction of prompts the rollout may run ahead: admits at most
    int(mini × require_batches × (1 + staleness_threshold) × trigger_parameter_sync_step) per version."""
    trigger_parameter_sync_step: int = 1
    """Learner steps between weight publications."""
    require_batches: int = 1
    """Mini-batches of groups per learner step (the step trains on require_batches × mini_batch_size groups)."""
    partial_rollout: bool = True
    """At a publication, pause in-flight generations, swap weights, continue them (False: let them finish
    first, then swap)."""
    max_version_lag: int | None = None
    """Hard cap on a trained group's version lag (oldest token)."""
    lag_policy: Literal["drop", "wait"] = "drop"
    """Over the cap: drop the group at dequeue, or hold back publication until old work is consumed."""
    drift_budget: float | None = None
    """A staleness bound in drift units (nats a token of KL(μ‖π_θ), None: off): each learner step's measured
    drift (actor/behaviour_kl) over its mean version lag estimates what a version of lag costs, and publication is
    held back (as --async-training.lag-policy wait does) while queued or in-flight work would exceed the lag whose
    predicted drift fits the budget (never below 1). Logged as fully_async/drift/*. Off by default: the grid of
    docs/staleness.md decides where it pays."""
    total_versions: int = 10
    """Weight publications in the run (each follows trigger_parameter_sync_step learner steps)."""
    time_budget_s: float | None = None
    """Stop after the version that crosses this many seconds of training (None: run all total_versions)."""
    colocated: bool = False
    """Generation and training share devices: with the rpc/torchrun launchers each trainer rank hosts a
    rollout engine on its own device (placement.agent_devices must equal trainer_devices); with the local
    launcher the engines live where agent_devices says. Use with staleness 0 and trigger 1 for verl's
    colocated synchronous baseline."""
    colocated_sleep: bool = True
    """Colocated engines free their KV cache and CUDA graphs while waiting (memory for training), at the
    cost of re-allocating and re-capturing them each version; False keeps them when memory allows."""
    take_timeout_s: float = 600.0
    """The trainer fails if it waits longer than this for groups."""
    agent_timeout_s: float = 120.0
    """An agent silent for longer is declared dead; its prompts go to the others."""
    sync_timeout_s: float = 300.0
    """A weight sync (drain + transfer) taking longer fails (after one retry) naming the agent; also the
    timeout of every collective of the trainer group (a mismatched collective raises instead of hanging)."""

    def validate(self) -> None:
        owner = "async"
        if self.staleness_threshold < 0:
            _fail(owner, "staleness_threshold", self.staleness_threshold, "must be >= 0 (0 = synchronous)")
        for field in ("trigger_parameter_sync_step", "require_batches", "total_versions"):
            if getattr(self, field) < 1:
                _fail(owner, field, getattr(self, field), "must be >= 1")
        if self.max_version_lag is not None and self.max_version_lag < 0:
            _fail(owner, "max_version_lag", self.max_version_lag, "must be >= 0 or None")
        if self.lag_policy == "wait" and self.max_version_lag is None:
            _fail(owner, "lag_policy", self.lag_policy, "'wait' needs --async-training.max-version-lag")
        if self.lag_policy == "wait" and self.max_version_lag == 0 and self.staleness_threshold > 0:
            # every held-back window admits work at the current version, which a cap of 0 forbids publishing
            # over: the trainer would train at the same version forever
            _fail(owner, "lag_policy", self.lag_policy, f"'wait' with --async-training.max-version-lag 0 can never publish when "
                  f"--async-training.staleness-threshold {self.staleness_threshold} > 0; use --async-training.lag-policy "
                  "drop, --async-training.max-version-lag 1 or more, or --async-training.staleness-threshold 0")
        if self.drift_budget is not None and not self.drift_budget > 0:
            _fail(owner, "drift_budget", self.drift_budget, "must be > 0 nats a token (KL(μ‖π_θ)), or unset to turn it off; "
                  "0.01–0.05 bounds a run at a few versions of lag at lr 1e-5")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            _fail(owner, "time_budget_s", self.time_budget_s, "must be > 0 seconds or None")
        for field in ("take_timeout_s", "agent_timeout_s", "sync_timeout_s"):
            if not getattr(self, field) > 0:
                _fail(owner, field, getattr(self, field), "must be > 0 seconds")
