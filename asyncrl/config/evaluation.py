"""Evaluation during training (`--eval.*`); `asyncrl.config` re-exports it as `RunConfig.eval`."""

from __future__ import annotations

import dataclasses

from asyncrl.config.flags import fail as _fail
from asyncrl.config.flags import flag, is_placeholder

__all__ = ["EvalConfig"]


@dataclasses.dataclass
class EvalConfig:
    """Held-out evaluation while training: every evaluation is pinned to one weight version (its prompts are
    generated with that version's weights alone: an agent keeps its weights until the evaluation of its version
    ends) and runs on the rollout agents beside the training prompts, within `max_share` of each agent's
    sequence slots, so the trainer keeps training. Metrics use verl's names (`val-core/<data_source>/reward/mean@N`)."""

    data: tuple[str, ...] = ()
    """Held-out prompt files (.jsonl / .parquet, --data.path's format). Empty: the training task's prompts drawn
    with --eval.task-seed; a run on a prompt file (--data.path) then evaluates nothing, and the checks before
    launch say so."""
    task_seed: int = 1_000_003
    """Seed of the built-in task's evaluation prompts (without --eval.data): another stream than --data.seed's."""
    every_versions: int = 0
    """Evaluate every K weight versions (0: only at start / at end)."""
    every_seconds: float = 0.0
    """Evaluate the first version published at least S seconds after the last evaluation opened, counting from
    the first publication (0: off; with --eval.every-versions, either schedules one). Runs of different speeds
    then pay for evaluation alike in wall-clock, where every K versions charges a faster run more often."""
    at_start: bool = False
    """Evaluate the initial weights (version 0)."""
    at_end: bool = False
    """Evaluate the final weights before the run ends."""
    n: int = 1
    """Samples per prompt: mean@n of the reward, and pass@k for k = 1, 2, 4, ... up to n."""
    temperature: float = 0.0
    """Sampling temperature of evaluation prompts (0: greedy)."""
    max_new_tokens: int | None = None
    """Response budget of evaluation prompts (None: --rollout.max-new-tokens)."""
    max_prompts: int | None = None
    """Evaluate the first M prompts of the held-out data (None: all of them)."""
    max_share: float = 0.25
    """At most this share of an agent's sequence slots (--rollout.max-slots) hold evaluation samples; the rest
    keep generating training samples."""
    success_threshold: float = 1.0
    """A sample counts as correct for pass@k when its reward reaches this."""

    @property
    def enabled(self) -> bool:
        return self.every_versions > 0 or self.every_seconds > 0 or self.at_start or self.at_end

    def validate(self) -> None:
        owner = "eval"
        for path in self.data:
            if is_placeholder(path):
                _fail(owner, "data", path, "it is a preset placeholder; pass held-out .jsonl or .parquet prompt files")
            if not path.endswith((".jsonl", ".parquet")):
                _fail(owner, "data", path, "must be .jsonl or .parquet prompt files (the format of --data.path)")
        if self.every_versions < 0:
            _fail(owner, "every_versions", self.every_versions, "must be >= 0 (0: only --eval.at-start / --eval.at-end)")
        if not self.every_seconds >= 0:
            _fail(owner, "every_seconds", self.every_seconds, "must be >= 0 seconds (0: off)")
        if self.n < 1:
            _fail(owner, "n", self.n, "must be >= 1")
        if not self.temperature >= 0:
            _fail(owner, "temperature", self.temperature, "must be >= 0 (0: greedy)")
        if self.n > 1 and self.temperature == 0:
            _fail(owner, "n", self.n, f"greedy decoding ({flag(owner, 'temperature')} 0) gives the same response "
                  f"{self.n} times; raise {flag(owner, 'temperature')} (e.g. 0.6) or leave {flag(owner, 'n')} at 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            _fail(owner, "max_new_tokens", self.max_new_tokens, "must be >= 1, or unset for --rollout.max-new-tokens")
        if self.max_prompts is not None and self.max_prompts < 1:
            _fail(owner, "max_prompts", self.max_prompts, "must be >= 1, or unset for every held-out prompt")
        if not 0 < self.max_share <= 1:
            _fail(owner, "max_share", self.max_share, "must lie in (0, 1]: the share of an agent's sequence slots")
        if self.data and not self.enabled:
            _fail(owner, "data", " ".join(self.data), f"nothing schedules an evaluation of it: add "
                  f"{flag(owner, 'every_versions')} K, {flag(owner, 'every_seconds')} S, {flag(owner, 'at_start')} "
                  f"or {flag(owner, 'at_end')}")

    def k_values(self) -> list[int]:
        """The k of pass@k: 1, 2, 4, ... and n."""
        ks, k = [], 1
        while k < self.n:
            ks.append(k)
            k *= 2
        return ks + [self.n]
