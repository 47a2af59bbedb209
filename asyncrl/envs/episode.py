"""One episode's trajectory as a single token sequence: the model's turns (trained, with behaviour log-probs
and weight versions, exactly as sampled) and the environment's tokens (masked out of the loss), plus what
the episode did, for the metrics."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from asyncrl.envs.protocol import Environment, Turn
from asyncrl.types import Completion

__all__ = ["Episode", "EpisodeStats"]


@dataclasses.dataclass
class EpisodeStats:
    """Counts of one episode (summed over a group's episodes in its `info.env`)."""

    episodes: int = 1
    turns: int = 0
    env_steps: int = 0
    env_time_s: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    env_errors: int = 0
    """Steps whose environment raised, or returned something that is not a valid StepResult."""
    env_timeouts: int = 0
    truncated: int = 0
    """Ended by --env.max-turns or the token budget, not by the environment."""
    model_tokens: int = 0
    env_tokens: int = 0
    later_turn_prompt_tokens: int = 0
    """The prompts of turns after the first (the whole episode so far)..."""
    reused_prompt_tokens: int = 0
    """...and of those, the tokens whose K/V the engine kept from the previous turn."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(eq=False)
class Episode:
    """The trajectory after the prompt; `budget` caps its tokens (model and environment) in all."""

    key: str
    """Its session name in the engine."""
    prompt_ids: list[int]
    budget: int
    env: Environment | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[bool] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    """The rewards the environment gave (steps that gave None are not here)."""
    stats: EpisodeStats = dataclasses.field(default_factory=EpisodeStats)
    finish_reason: str | None = None
    done: bool = False
    failed: bool = False
    """The environment failed: the episode scores 0 and none of its tokens is trained."""
    routes: Any = None
    """MoE routes of the latest model turn that came with them (`Completion.routes`): that turn's prompt was the
    whole episode so far, so they cover every position up to its last token."""

    @property
    def remaining(self) -> int:
        return self.budget - len(self.token_ids)

    @property
    def sequence(self) -> list[int]:
        """Prompt and trajectory: the next turn's prompt."""
        return self.prompt_ids + self.token_ids

    def add_model_turn(self, completion: Completion, text: str) -> Turn:
        """Append the model's turn as sampled; return it as the environment sees it."""
        n = len(completion.token_ids)
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.loss_mask += [True] * n
        self.finish_reason = completion.finish_reason
        if completion.routes is not None:
            self.routes = completion.routes
        self.stats.turns += 1
        self.stats.model_tokens += n
        return Turn(text=text, token_ids=tuple(completion.token_ids), index=self.stats.turns - 1,
                    finish_reason=completion.finish_reason)

    def add_env_tokens(self, token_ids: Sequence[int]) -> None:
        """Append tokens the environment's answer rendered to (log-prob 0, the last model token's version)."""
        version = self.versions[-1] if self.versions else 0
        self.token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [version] * len(token_ids)
        self.loss_mask += [False] * len(token_ids)
        self.stats.env_tokens += len(token_ids)

    def completion(self) -> Completion:
        mask = [False] * len(self.loss_mask) if self.failed else list(self.loss_mask)
        return Completion(list(self.token_ids), list(self.logprobs), list(self.versions),
                          finish_reason=self.finish_reason or "stop", loss_mask=mask, routes=self.routes)

    @property
    def env_reward(self) -> float | None:
        """The environment's reward for the episode: the sum of its step rewards, 0 when it failed, None when
        it gave none (the reward function scores the episode then)."""
        if self.failed:
            return 0.0
        return sum(self.rewards) if self.rewards else None
