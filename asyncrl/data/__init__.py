"""Prompt sources, tasks and scoring."""

from asyncrl.data.scoring import RewardFn, Scorer, decode_ids
from asyncrl.data.sources import DatasetSource, GeneratedSource, PromptSource

__all__ = ["PromptSource", "DatasetSource", "GeneratedSource", "Scorer", "RewardFn", "decode_ids"]
