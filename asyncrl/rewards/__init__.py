"""Pure reward functions: strings (or lengths) in, a float out. No model, no I/O.

Which data source each scores: `asyncrl.rewards.registry`; reward functions of your own (`--reward.fn`):
`asyncrl.rewards.plugin`. Model output is read with bounded, eval-free code (`asyncrl.rewards.bounded_arithmetic`
for arithmetic): no response can hang or exhaust the process that scores it.
"""

from asyncrl.rewards.arithmetic import arithmetic_reward, countdown_reward, even_token_reward
from asyncrl.rewards.bounded_arithmetic import compare_integer_text, evaluate_arithmetic
from asyncrl.rewards.format import GSM8K_FORMAT, THINK_ANSWER_FORMAT, format_reward
from asyncrl.rewards.gsm8k import extract_gsm8k_answer, gsm8k_ground_truth, gsm8k_reward
from asyncrl.rewards.gsm8k_calc import gsm8k_calc_reward
from asyncrl.rewards.math_answer import answers_match, extract_boxed, math_reward, normalize_answer
from asyncrl.rewards.overlong import overlong_penalty

__all__ = [
    "gsm8k_ground_truth", "extract_gsm8k_answer", "gsm8k_reward", "gsm8k_calc_reward",
    "extract_boxed", "normalize_answer", "answers_match", "math_reward",
    "GSM8K_FORMAT", "THINK_ANSWER_FORMAT", "format_reward",
    "overlong_penalty", "arithmetic_reward", "countdown_reward", "even_token_reward",
    "evaluate_arithmetic", "compare_integer_text",
]
