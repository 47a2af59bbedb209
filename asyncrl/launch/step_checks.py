"""A learner step the trainer's host can hold, decided before launch (`asyncrl.launch.preflight` runs it).

    problem = check_step_memory(cfg, available=host_available())   # None when it fits

Rank 0 of the trainer keeps every finished group of the admission window in its sample queue (verl's
`max_required_samples` groups: `--trainer.mini-batch-size` × `--async-training.require-batches` × (1 +
`--async-training.staleness-threshold`) × `--async-training.trigger-parameter-sync-step`), as Python lists, and
collates each learner step into padded tensors. Both grow with the mini-batch, so a mini-batch too large for the
host's memory would spawn every process and then be killed by the kernel mid-run (or wait out
`--async-training.take-timeout-s`). The prediction takes every response at `--rollout.max-new-tokens` and every
prompt at `--rollout.max-prompt-length`, the budgets the run allows, like the GPU memory checks.
"""

from __future__ import annotations

import dataclasses

from asyncrl.algos.staleness import verl_max_required_samples
from asyncrl.config import RunConfig
from asyncrl.planning.memory import GIB

__all__ = ["QUEUED_TOKEN_BYTES", "PROMPT_TOKEN_BYTES", "HOST_MARGIN", "StepBytes", "step_bytes", "check_step_memory",
           "host_available"]

QUEUED_TOKEN_BYTES = 80
"""A response token of a finished group in the queue: its id (an 8-byte list slot and a 28-byte int object), its
behaviour log-prob (8 + 24-byte float) and its version (a slot; small ints are shared), with the lists' spare room.
Measured with tracemalloc: 81.9 B per token over 100 completions of 1,000 tokens."""
PROMPT_TOKEN_BYTES = 36
"""A prompt token of a queued group: one id, held once per group."""
COLLATED_CELL_BYTES = 8
"""A cell of the step's padded [samples, prompt + response] token grid (int64)."""
COLLATED_RESPONSE_BYTES = 29
"""A response position of the collated step: its mask (1), behaviour log-prob (4) and version (8), and the learner's
per-token results (π_old's and the reference's log-probs, advantages, correction weights: 4 × 4)."""
HOST_MARGIN = 0.10
"""Share of the host's available memory kept for everything else rank 0 holds (the model, the optimizer's host
state, the agents sharing the host)."""


@dataclasses.dataclass(frozen=True)
class StepBytes:
    window_groups: int
    """Groups the queue may hold at once (verl's admission window)."""
    queued: int
    """Bytes of a full window of finished groups in the queue."""
    collated: int
    """Bytes of one learner step's padded tensors."""

    @property
    def total(self) -> int:
        return self.queued + self.collated


def step_bytes(cfg: RunConfig, mini_batch_size: int | None = None) -> StepBytes:
    """Rank 0's host bytes for `cfg`'s sample queue and one collated step, every response at its budget
    (`mini_batch_size`: another value of --trainer.mini-batch-size)."""
    mb = cfg.trainer.mini_batch_size if mini_batch_size is None else mini_batch_size
    a, n = cfg.async_training, cfg.rollout.n
    prompt, response = cfg.rollout.max_prompt_length, cfg.rollout.max_new_tokens
    window = verl_max_required_samples(mb, a.require_batches, a.staleness_threshold, a.trigger_parameter_sync_step)
    queued = window * (n * response * QUEUED_TOKEN_BYTES + prompt * PROMPT_TOKEN_BYTES)
    samples = mb * a.require_batches * n
    collated = samples * ((prompt + response) * COLLATED_CELL_BYTES + response * COLLATED_RESPONSE_BYTES)
    return StepBytes(window, queued, collated)


def _largest_that_fits(cfg: RunConfig, room: float) -> int:
    """The largest --trainer.mini-batch-size whose step bytes fit `room` (0 when not even 1 does)."""
    low, high = 0, cfg.trainer.mini_batch_size
    while low < high:  # step_bytes grows with the mini-batch
        mid = (low + high + 1) // 2
        if step_bytes(cfg, mid).total <= room:
            low = mid
        else:
            high = mid - 1
    return low


def check_step_memory(cfg: RunConfig, *, available: int) -> str | None:
    """A problem naming --trainer.mini-batch-size and the largest value that fits when a full admission window and
    one collated step need more than `available` bytes of the host (less HOST_MARGIN); None when they fit."""
    need = step_bytes(cfg)
    room = available * (1 - HOST_MARGIN)
    if need.total <= room:
        return None
    fits = _largest_that_fits(cfg, room)
    a = cfg.async_training
    step = f"--trainer.mini-batch-size {cfg.trainer.mini_batch_size}" + (
        f" × --async-training.require-batches {a.require_batches}" if a.require_batches != 1 else "")
    fix = (f"the largest --trainer.mini-batch-size that fits is {fits}" if fits else
           "no mini-batch fits: lower --rollout.max-new-tokens or --rollout.n")
    return (f"{step}: a learner step of {cfg.trainer.mini_batch_size * a.require_batches} groups × --rollout.n "
            f"{cfg.rollout.n} at --rollout.max-new-tokens {cfg.rollout.max_new_tokens} needs about "
            f"{need.total / GIB:.1f} GiB of the trainer's host memory (the queue's window of {need.window_groups} "
            f"finished groups, {need.queued / GIB:.1f} GiB, and the step's padded tensors, "
            f"{need.collated / GIB:.1f} GiB), more than the {available / GIB:.1f} GiB it has available; {fix}")


def host_available() -> int:
    """This host's available memory in bytes (/proc/meminfo's MemAvailable; the physical pages free elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
