"""The few records that cross component boundaries (engine → agent → queue → learner)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np

__all__ = ["FinishReason", "Completion", "GenerationOutput", "Group", "GroupInfo", "Prompt"]

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass
class Completion:
    """One sampled response: every token with its behaviour log-prob and the weight version that produced it."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason | None = None  # None while still generating
    loss_mask: list[bool] | None = None
    """Per token: True for the model's tokens (trained), False for tokens an environment appended (a tool's
    output, the next user message: never trained, log-prob 0). None: every token is the model's."""
    routes: "np.ndarray | None" = None
    """Mixture-of-experts models, when the engine returns them (vLLM's routed experts, for
    --trainer.routing-replay r3): the experts each MoE layer chose for each position of prompt + response that the
    engine ran, int [positions, layers, top_k], position t the token at t (the last token was never run). Travels
    with the sample to the learner; never written to a checkpoint."""

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
    cached_prompt_tokens: int = 0
    """Of the prompt, the tokens whose K/V the engine already had (a held session, vLLM's prefix cache): a
    multi-turn episode's later turns prefill only the rest."""

    @classmethod
    def snapshot(cls, request_id: str, prompt_ids: list[int], completions: list[Completion],
                 cached_prompt_tokens: int = 0) -> "GenerationOutput":
        """An output holding copies of an engine's live completions (the engine goes on appending to its own;
        routes it sets once, when a sample ends, so they are shared)."""
        copies = [dataclasses.replace(c, token_ids=list(c.token_ids), logprobs=list(c.logprobs),
                                      versions=list(c.versions),
                                      loss_mask=None if c.loss_mask is None else list(c.loss_mask))
                  for c in completions]
        return cls(request_id, list(prompt_ids), copies, finished=all(c.finished for c in copies),
                   cached_prompt_tokens=cached_prompt_tokens)


@dataclasses.dataclass
class Prompt:
    """A prompt as the data layer hands it out: token ids plus what the reward function needs."""

    prompt_ids: list[int]
    data_source: str = ""
    """Selects the reward function (verl's `data_source`, e.g. 'openai/gsm8k')."""
    ground_truth: str = ""
    text: str = ""
    """The rendered prompt, for logs."""
    index: int = -1
    """Row of the dataset it came from (for logs; the run's accounting id is assigned at admission)."""
    extra_info: dict = dataclasses.field(default_factory=dict)
    """verl's `extra_info` of the row (JSON-able; passed to reward functions)."""
    fields: dict = dataclasses.field(default_factory=dict)
    """The row's other top-level fields (not prompt, data_source, reward_model, ground_truth or extra_info),
    JSON-able; reward functions of the `(response, ground_truth, **row)` kind get them as keywords."""


@dataclasses.dataclass
class GroupInfo:
    """What travels with a group besides the tensors: for the logs and the per-version metrics."""

    index: int | None = None
    """The prompt's row in its data file (None for generated tasks)."""
    agent: str = ""
    """The rollout agent that generated it."""
    prompt_text: str = ""
    texts: list[str] = dataclasses.field(default_factory=list)
    """The decoded completions, in order."""
    rewards: dict = dataclasses.field(default_factory=dict)
    """The reward function's calls, errors, timeouts, mean extras and error examples for this group
    (`asyncrl.runtime.reward_tally.group_reward_info`); empty when no reward function ran."""
    env: dict[str, int] = dataclasses.field(default_factory=dict)
    """Summed `EpisodeStats` of its episodes (`asyncrl.envs.episode`); empty for single-turn groups."""

    @classmethod
    def from_json(cls, raw: dict) -> "GroupInfo":
        """From `dataclasses.asdict`; keys it does not know (a checkpoint of an older release) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


@dataclasses.dataclass
class Group:
    """One prompt with its n scored completions: the unit that streams from agents to the learner."""

    prompt_id: int
    """Unique id of the prompt in the run (accounting: every id ends trained or dropped exactly once)."""
    prompt_ids: list[int]
    completions: list[Completion]
    rewards: list[float]
    """One scalar reward per completion (task reward + shaping)."""
    data_source: str = ""
    admitted_version: int = 0
    """Weight version when the prompt was admitted."""
    info: GroupInfo = dataclasses.field(default_factory=GroupInfo)

    def __post_init__(self) -> None:
        if len(self.rewards) != len(self.completions):
            raise ValueError(f"Group {self.prompt_id}: {len(self.rewards)} rewards for {len(self.completions)} "
                             "completions; give one reward per completion")

    @property
    def min_version(self) -> int:
        return min((c.min_version for c in self.completions if c.versions), default=self.admitted_version)

    @property
    def max_version(self) -> int:
        return max((c.max_version for c in self.completions if c.versions), default=self.admitted_version)

    @property
    def num_tokens(self) -> int:
        return sum(len(self.prompt_ids) + len(c.token_ids) for c in self.completions)
