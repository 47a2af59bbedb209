"""Prompt sources, tasks, prompt files and scoring."""

from asyncrl.data.files import convert_gsm8k, load_prompt_file, read_jsonl, read_parquet, rows_to_prompts
from asyncrl.data.gsm8k_calc import convert_gsm8k_calc
from asyncrl.data.scoring import RewardError, RewardFn, ScoredGroup, Scorer, decode_ids
from asyncrl.data.sources import DatasetSource, GeneratedSource, PromptSource

__all__ = ["PromptSource", "DatasetSource", "GeneratedSource", "Scorer", "ScoredGroup", "RewardError", "RewardFn",
           "decode_ids",
           "load_prompt_file", "rows_to_prompts", "read_jsonl", "read_parquet", "convert_gsm8k",
           "convert_gsm8k_calc"]
