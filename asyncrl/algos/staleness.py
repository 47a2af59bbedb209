"""Staleness: version lag of tokens and sequences, hard version-lag masks, and admission budgets.

A *version* is the number of weight publications so far. Each generated token carries the version of the
weights that produced it; a sequence generated across a weight update (partial rollout) carries several.
The lag of a token is `current_version − token_version` (≥ 0); a sequence's lag is that of its oldest
token.

Two admission rules bound how far generation may run ahead of training:
* verl (`fully_async_policy`): a window of at most
  `max_required_samples = int(mini_batch_size × require_batches × (1 + staleness_threshold) ×
  trigger_parameter_sync_step)` prompts per version; at each new version the counter restarts at
  (in flight + queued), so work started under old weights is charged to the new window.
* AReaL (arXiv:2505.24298): admit while `accepted + running < (η + version + 1)·B`, capped by a concurrency
  limit, where B is the trainer's batch size in samples and η the allowed off-policyness.
Neither bounds the lag of one slow sample by itself; `staleness_mask` with `max_version_lag` does.
"""

from __future__ import annotations

from typing import Iterable, Literal, NamedTuple

import torch
from torch import Tensor

from asyncrl.algos._checks import check_choice, check_mask, check_token_tensor

__all__ = [
    "VersionLag", "version_lag", "staleness_mask", "verl_max_required_samples", "VerlBudget", "verl_admit",
    "verl_release", "verl_on_new_version", "areal_capacity", "length_bucket", "lag_by_length", "LengthBucket",
]


class VersionLag(NamedTuple):
    token: Tensor  # [B, T] int64 lag per valid token, 0 at masked positions
    seq_max: Tensor  # [B] lag of the oldest valid token (0 for an empty row)
    seq_min: Tensor  # [B] lag of the newest valid token (0 for an empty row)


def version_lag(token_versions: Tensor, current_version: int, response_mask: Tensor) -> VersionLag:
    """Per-token and per-sequence version lag.

    Args:
      token_versions: [B, T] integer weight version that produced each token.
      current_version: the learner's current version.
      response_mask: [B, T] valid tokens.
    Raises:
      ValueError: a valid token claims a version newer than `current_version`.
    """
    fn = "version_lag"
    check_token_tensor(fn, "token_versions", token_versions, floating=False)
    if token_versions.is_floating_point() or token_versions.dtype == torch.bool:
        raise ValueError(f"{fn}: token_versions must be an integer tensor, got {token_versions.dtype}")
    mask = check_mask(fn, "response_mask", response_mask, token_versions)
    lag = torch.where(mask, current_version - token_versions.long(), torch.zeros((), dtype=torch.long,
                                                                                   device=token_versions.device))
    if bool((lag < 0).any()):
        newest = int(torch.where(mask, token_versions.long(), torch.full_like(lag, -(2**62))).max())
        raise ValueError(f"{fn}: a token has version {newest} > current_version {current_version}; "
                         "versions must come from the same counter as the learner's")
    if lag.shape[1] == 0:  # no response tokens at all
        zeros = lag.new_zeros(lag.shape[0])
        return VersionLag(token=lag, seq_max=zeros, seq_min=zeros)
    seq_max = lag.amax(dim=-1)
    big = torch.full_like(lag, 2**62)
    seq_min = torch.where(mask, lag, big).amin(dim=-1)
    seq_min = torch.where(mask.any(dim=-1), seq_min, torch.zeros_like(seq_min))
    return VersionLag(token=lag, seq_max=seq_max, seq_min=seq_min)


def staleness_mask(token_versions: Tensor, current_version: int, response_mask: Tensor, *, max_version_lag: int,
                   level: Literal["token", "sequence"] = "sequence") -> Tensor:
    """The response mask with too-stale tokens removed: keep iff lag ≤ `max_version_lag`.

    level="sequence" drops a whole row if its oldest token is too stale (prime-rl / verl V1 style);
    level="token" drops only the stale tokens. Returns [B, T] bool; never adds a token.
    """
    fn = "staleness_mask"
    check_choice(fn, "level", level, ("token", "sequence"))
    if max_version_lag < 0:
        raise ValueError(f"{fn}: max_version_lag must be >= 0, got {max_version_lag}")
    lag = version_lag(token_versions, current_version, response_mask)
    mask = check_mask(fn, "response_mask", response_mask, token_versions)
    if level == "token":
        return mask & (lag.token <= max_version_lag)
    return mask & (lag.seq_max <= max_version_lag)[:, None]


def verl_max_required_samples(mini_batch_size: int, require_batches: int, staleness_threshold: float,
                              trigger_parameter_sync_step: int) -> int:
    """verl's per-version admission window, in prompts (groups):

      int(mini_batch_size × require_batches × (1 + staleness_threshold) × trigger_parameter_sync_step)
    (computed in verl's order, so the float rounding matches verl's).
    """
    fn = "verl_max_required_samples"
    for name, value in (("mini_batch_size", mini_batch_size), ("require_batches", require_batches),
                        ("trigger_parameter_sync_step", trigger_parameter_sync_step)):
        if int(value) != value or value < 1:
            raise ValueError(f"{fn}: {name} must be a positive integer, got {value}")
    if not staleness_threshold >= 0:
        raise ValueError(f"{fn}: staleness_threshold must be >= 0 (0 = synchronous), got {staleness_threshold}")
    required_samples = mini_batch_size * require_batches
    return int(required_samples * (staleness_threshold + 1) * trigger_parameter_sync_step)


class VerlBudget(NamedTuple):
    """verl's admission counter: `staleness_samples` prompts charged to the current version window."""
    max_required_samples: int
    staleness_samples: int = 0

    @property
    def can_admit(self) -> bool:
        return self.staleness_samples < self.max_required_samples

    @property
    def remaining(self) -> int:
        return max(self.max_required_samples - self.staleness_samples, 0)


def verl_admit(budget: VerlBudget, n: int = 1) -> VerlBudget:
    """Charge `n` newly admitted prompts to the window. Raises if that would exceed the window."""
    if n < 0 or budget.staleness_samples + n > budget.max_required_samples:
        raise ValueError(f"verl_admit: admitting {n} prompt(s) would make staleness_samples "
                         f"{budget.staleness_samples + n} > max_required_samples {budget.max_required_samples}; "
                         "check `can_admit` / `remaining` first")
    return budget._replace(staleness_samples=budget.staleness_samples + n)


def verl_release(budget: VerlBudget, n: int = 1) -> VerlBudget:
    """Give `n` prompts' charge back to the window: prompts that will never be trained (DAPO's dynamic sampling
    drops them), so the window bounds the staleness of what is trained without starving the trainer. Ours;
    verl's fully-async trainer has no such refund."""
    if n < 0:
        raise ValueError(f"verl_release: n must be >= 0, got {n}")
    return budget._replace(staleness_samples=max(budget.staleness_samples - n, 0))


def verl_on_new_version(budget: VerlBudget, in_flight: int, queued: int) -> VerlBudget:
    """Restart the window at a new version: older work still in flight or queued is charged to it."""
    if in_flight < 0 or queued < 0:
        raise ValueError(f"verl_on_new_version: counts must be >= 0, got in_flight={in_flight}, queued={queued}")
    return budget._replace(staleness_samples=in_flight + queued)


def areal_capacity(*, version: int, max_staleness: int, batch_size: int, accepted: int, running: int,
                   max_concurrent: int | None = None) -> int:
    """How many more samples AReaL's staleness gate admits now (arXiv:2505.24298, `StalenessManager`).

      capacity = min(max_concurrent − running, (η + version + 1)·B − (accepted + running)), floored at 0

    Args:
      version: the learner's current version. max_staleness: η ≥ 0 (0 = synchronous).
      batch_size: B, samples the trainer consumes per version. accepted: samples finished so far (queued or
        trained). running: samples being generated. max_concurrent: optional limit on `running`.
    """
    fn = "areal_capacity"
    if max_staleness < 0 or batch_size < 1 or version < 0 or accepted < 0 or running < 0:
        raise ValueError(f"{fn}: need max_staleness >= 0, batch_size >= 1 and non-negative counts; got "
                         f"max_staleness={max_staleness}, batch_size={batch_size}, version={version}, "
                         f"accepted={accepted}, running={running}")
    capacity = (max_staleness + version + 1) * batch_size - (accepted + running)
    if max_concurrent is not None:
        capacity = min(capacity, max_concurrent - running)
    return max(capacity, 0)


def length_bucket(length: int) -> int:
    """The response-length bucket of `length` tokens: the smallest power of two ≥ it (1 for 0 or 1)."""
    if length < 0:
        raise ValueError(f"length_bucket: length must be >= 0, got {length}")
    return 1 << max(length - 1, 0).bit_length()


class LengthBucket(NamedTuple):
    """One bucket of `lag_by_length`: sums over its samples, so that windows and runs add up (a mean is sum / count)."""
    count: int
    lag_sum: int
    length_sum: int  # the samples' response lengths
    group_length_sum: int  # the longest response of each sample's group (what an agent waits for to deliver it)


def lag_by_length(samples: Iterable[tuple[int, int, int]]) -> dict[int, LengthBucket]:
    """Version lag against response length: for (response length, the longest response length of its group, lag)
    triples, per length bucket (`length_bucket`) the samples and the sums of their lags, lengths and group lengths.
    Long responses span more publications: this is where staleness lives. An agent delivers a GRPO group when its
    last sibling ends, so a sample's lag follows its group's longest response more closely than its own length
    (docs/staleness.md, "Lag and response length").

      lag_by_length([(3, 4, 0), (4, 4, 2), (100, 120, 5)])
        ->  {4: LengthBucket(2, 2, 7, 8), 128: LengthBucket(1, 5, 100, 120)}
    """
    out: dict[int, LengthBucket] = {}
    for length, group_length, lag in samples:
        if lag < 0:
            raise ValueError(f"lag_by_length: a lag must be >= 0, got {lag} (length {length})")
        if group_length < length:
            raise ValueError(f"lag_by_length: a group's longest response ({group_length}) cannot be shorter than "
                             f"one of its samples ({length})")
        count, total, lengths, groups = out.get(bucket := length_bucket(length), (0, 0, 0, 0))
        out[bucket] = LengthBucket(count + 1, total + lag, lengths + length, groups + group_length)
    return dict(sorted(out.items()))
