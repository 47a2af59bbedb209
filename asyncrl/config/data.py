"""Where prompts come from (`--data.*`); `asyncrl.config` re-exports it as `RunConfig.data`."""

from __future__ import annotations

import dataclasses
from typing import Literal

from asyncrl.config.flags import fail as _fail
from asyncrl.config.flags import is_placeholder

__all__ = ["DataConfig"]


@dataclasses.dataclass
class DataConfig:
    """Where prompts come from: a prompt file (`path`) or a built-in procedural task (`task`)."""

    path: str | None = None
    """A .jsonl or .parquet prompt file (verl's row format, see `asyncrl data inspect`), or a Hugging Face Hub
    dataset split, hf:ORG/NAME[@REVISION][:[CONFIG/]SPLIT] (e.g. hf:openai/gsm8k:main/train). When set, `task`,
    `digits` and `operators` are ignored. GSM8K: `asyncrl data convert-gsm8k --src hf:openai/gsm8k:main/train
    --out data/gsm8k/train.parquet`, or the raw split with --data.prompt-key question --data.answer-key answer
    --data.data-source openai/gsm8k."""
    prompt_key: str = "prompt"
    """The rows' field holding the prompt: a message list or a plain string (verl `data.prompt_key`)."""
    answer_key: str | None = None
    """The rows' field holding the reference answer, dotted for a nested one (None: verl's
    reward_model.ground_truth, or ground_truth beside a plain-string prompt)."""
    data_source: str | None = None
    """The data_source of every row (it picks the reward function), in place of the rows' own field."""
    on_long: Literal["filter", "truncate"] = "filter"
    """Prompt files: drop prompts longer than --rollout.max-prompt-length tokens, or keep their last tokens."""
    on_empty: Literal["refuse", "drop"] = "refuse"
    """Prompt files: a row whose prompt is empty stops the run before it starts (naming the row), or is
    dropped and counted."""
    shuffle: bool = True
    """Prompt files: visit the rows in a new order every epoch (seeded by `seed`)."""
    task: Literal["arithmetic", "countdown", "toy"] = "arithmetic"
    """Built-in procedural task, used when `path` is not set."""
    digits: int = 1
    """arithmetic: digits per operand."""
    operators: str = "+"
    """arithmetic: operators to draw from."""
    system_prompt: str | None = None
    """System message of the chat template (None: the tokenizer's default)."""
    seed: int = 0
    """Seed of the task / shuffling."""

    def validate(self) -> None:
        if self.path is None:
            return
        if is_placeholder(self.path):
            _fail("data", "path", self.path, "it is a preset placeholder; pass --data.path with a .jsonl or .parquet "
                  "prompt file; for GSM8K make one with `asyncrl data convert-gsm8k --src gsm8k/train.jsonl "
                  "--out data/gsm8k/train.parquet`")
        if not self.path.endswith((".jsonl", ".parquet")):
            _fail("data", "path", self.path, "must be a .jsonl or .parquet file, or a Hub dataset "
                  "hf:ORG/NAME[@REVISION][:[CONFIG/]SPLIT]")
        for field in ("prompt_key", "answer_key", "data_source"):
            value = getattr(self, field)
            if value is not None and not value.strip():
                _fail("data", field, repr(value), "must be a non-empty field name" if field != "data_source"
                      else "must be a non-empty name, or unset to read each row's")
