"""Lossless speculative decoding in the embedded engine (`--rollout.speculation.*`); `RolloutConfig.speculation`.

Off by default (`tokens 0`). The drafts cost no model: each row proposes the tokens that followed the latest earlier
occurrence of its last few tokens in its prompt, its sibling samples (a GRPO group shares the prompt) and recent
responses to the same prompt (`asyncrl.policies.drafts`). A step then checks every row's draft in one forward and
keeps the draft's tokens up to the first one the row's own sampling would not have drawn, plus that sampled token
(`asyncrl.policies.speculation`): a seeded request produces exactly its tokens without speculation, and every
token's behaviour log-prob is the verifying forward's. Drafts pay where the engine's step is bound by reading the
weights and few rows run (a rollout's tail, evaluation, large models); with many rows the step is bound by the
K/V and the extra positions cost more than they return, so speculation runs only while at most `max_rows` rows
do.
"""

from __future__ import annotations

import dataclasses

from asyncrl.config.flags import fail as _fail

__all__ = ["SpeculationConfig"]


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    """How the embedded engine drafts and verifies (module docstring)."""

    tokens: int = 0
    """Drafted tokens a row checks per step (0: no speculation); each step gives a row 1 to tokens + 1 tokens."""
    max_rows: int = 16
    """Speculate only while at most this many rows run (above it, plain decode steps)."""
    min_match: int = 1
    """Shortest suffix of a row's tokens that must recur for a draft (1: a single token that recurs drafts what
    followed it: more drafts, each less likely kept; measured best where speculation runs, at few rows)."""
    max_match: int = 3
    """Longest suffix matched (the longest that recurs wins)."""

    @property
    def enabled(self) -> bool:
        return self.tokens > 0

    def validate(self, owner: str = "rollout.speculation") -> None:
        if self.tokens < 0:
            _fail(owner, "tokens", self.tokens, "must be >= 0 (0 turns speculation off)")
        if self.max_rows < 1:
            _fail(owner, "max_rows", self.max_rows, "must be >= 1")
        if self.min_match < 1:
            _fail(owner, "min_match", self.min_match, "must be >= 1")
        if self.max_match < self.min_match:
            _fail(owner, "max_match", self.max_match, f"must be >= --{owner.replace('_', '-')}.min-match "
                                                        f"{self.min_match}")
