"""The built-in rewards: which pure reward function scores each data source that asyncrl ships with.

    reward = BUILTIN_REWARDS["openai/gsm8k"]("... #### 72", "72")   # 1.0

A reward plug-in (`--reward.fn`, `asyncrl.rewards.plugin`) takes precedence over these; the table is
read-only, so a new data source is scored through a plug-in (or an entry added here).
"""

from __future__ import annotations

import types
from typing import Callable, Mapping

from asyncrl.rewards.arithmetic import arithmetic_reward, countdown_reward, even_token_reward
from asyncrl.rewards.gsm8k import gsm8k_reward
from asyncrl.rewards.gsm8k_calc import gsm8k_calc_reward
from asyncrl.rewards.math_answer import math_reward

__all__ = ["BUILTIN_REWARDS"]

BUILTIN_REWARDS: Mapping[str, Callable[[str, str], float]] = types.MappingProxyType({
    "arithmetic": arithmetic_reward,
    "countdown": countdown_reward,
    "toy": even_token_reward,
    "openai/gsm8k": gsm8k_reward,
    "gsm8k-calc": gsm8k_calc_reward,
    "math": math_reward,
})
"""data_source -> reward function `(response_text, ground_truth) -> float` (read-only)."""
