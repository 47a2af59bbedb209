"""The few records that cross component boundaries (engine → agent → queue → learner)."""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["FinishReason", "Completion", "GenerationOutput"]

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class Completion:
    """One sampled response: every token with its behaviour log-prob and the weight version that produced it."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason | None = None  # None while still generating

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def min_version(self) -> int | None:
        return min(self.versions) if self.versions else None

    @property
    def max_version(self) -> int | None:
        return max(self.versions) if self.versions else None


@dataclasses.dataclass
class GenerationOutput:
    """The n completions of one prompt (vLLM's RequestOutput)."""

    request_id: str
    prompt_ids: list[int]
    completions: list[Completion]
    finished: bool
