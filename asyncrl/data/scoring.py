"""Scoring completions: a plain mapping from `data_source` to a pure reward function.

    scorer = Scorer({"openai/gsm8k": gsm8k_reward, "arithmetic": arithmetic_reward}, tokenizer=tok)
    reward = scorer(prompt, completion)

A reward function takes `(response_text, ground_truth)` and returns a float. Without a tokenizer the
response text is the token ids joined by spaces ("5 17 2"), which is what token-level toy tasks score.
A reward function that raises gives reward 0 and increments `scorer.errors` (the run logs it as
`reward/errors`); with `strict=True` the error propagates and stops the run.
"""

from __future__ import annotations

from typing import Callable, Mapping

from asyncrl.types import Completion, Prompt

__all__ = ["RewardFn", "Scorer", "decode_ids"]

RewardFn = Callable[[str, str], float]


def decode_ids(token_ids: list[int]) -> str:
    return " ".join(str(t) for t in token_ids)


class Scorer:
    def __init__(self, rewards: Mapping[str, RewardFn], *, tokenizer=None, default: str | None = None,
                 strict: bool = False):
        if not rewards:
            raise ValueError("Scorer: no reward functions given; map each data_source to a reward function")
        self.rewards, self.tokenizer, self.default, self.strict = dict(rewards), tokenizer, default, strict
        self.errors = 0

    def text(self, completion: Completion) -> str:
        if self.tokenizer is None:
            return decode_ids(completion.token_ids)
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    def __call__(self, prompt: Prompt, completion: Completion) -> float:
        return self.score(prompt, completion)[0]

    def score(self, prompt: Prompt, completion: Completion) -> tuple[float, str]:
        """(reward, decoded response text)."""
        fn = self.rewards.get(prompt.data_source) or (self.rewards.get(self.default) if self.default else None)
        if fn is None:
            raise ValueError(f"Scorer: no reward function for data_source={prompt.data_source!r}; known: "
                             f"{', '.join(sorted(self.rewards))} (pass default= to fall back)")
        text = self.text(completion)
        try:
            return float(fn(text, prompt.ground_truth)), text
        except Exception:
            if self.strict:
                raise
            self.errors += 1
            return 0.0, text
