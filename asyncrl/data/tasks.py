"""Procedural tasks that need no files: arithmetic (adjustable difficulty) and countdown.

Prompt k of a task is a pure function of (seed, k), so a `GeneratedSource` over it is endless,
deterministic and checkpointable by its index alone.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Mapping, Sequence

from asyncrl.tools.seeding import derive_seed
from asyncrl.types import Prompt

__all__ = ["ArithmeticTask", "CountdownTask", "ToyTask", "render_chat"]


def render_chat(tokenizer, user: str | Sequence[Mapping[str, str]], system: str | None = None) -> list[int]:
    """Token ids of a chat prompt through the tokenizer's chat template, ending with the generation prompt.

    `user` is the text of a one-turn prompt, or a whole message list (`[{"role": ..., "content": ...}, ...]`,
    verl's `prompt` column). `system` is prepended as a system message unless the list already starts with
    one (a row's own system message wins). Without a chat template the system message is dropped and the
    text (or the messages' contents joined by blank lines) is encoded as plain text.
    """
    turns = [{"role": "user", "content": user}] if isinstance(user, str) else [dict(m) for m in user]
    has_system = bool(turns) and turns[0].get("role") == "system"
    messages = ([{"role": "system", "content": system}] if system and not has_system else []) + turns
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding
    return tokenizer.encode(user if isinstance(user, str) else "\n\n".join(m["content"] for m in turns))


@dataclasses.dataclass
class ArithmeticTask:
    """"What is 37 + 5?" — sums and differences of `digits`-digit numbers (`terms` of them).

    The answer is the integer result; the reward is `arithmetic_reward` (last number in the response).
    """

    digits: int = 1
    """Digits per operand (difficulty)."""
    terms: int = 2
    """Numbers per question."""
    operators: str = "+-"
    """Operators to draw from."""
    seed: int = 0
    instruction: str = "Answer with the number only."
    data_source: str = "arithmetic"

    def __post_init__(self):
        if self.digits < 1 or self.terms < 2 or not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"ArithmeticTask: need digits >= 1, terms >= 2 and operators from '+-*', got "
                             f"digits={self.digits}, terms={self.terms}, operators={self.operators!r}")

    def question(self, index: int) -> tuple[str, int]:
        rng = random.Random(derive_seed(self.seed, index))
        hi = 10 ** self.digits - 1
        numbers = [rng.randint(0, hi) for _ in range(self.terms)]
        ops = [rng.choice(self.operators) for _ in range(self.terms - 1)]
        expression = str(numbers[0]) + "".join(f" {op} {n}" for op, n in zip(ops, numbers[1:]))
        return expression, _value(numbers, ops)

    def prompt(self, index: int, tokenizer) -> Prompt:
        expression, answer = self.question(index)
        text = f"What is {expression}? {self.instruction}"
        return Prompt(render_chat(tokenizer, text), data_source=self.data_source, ground_truth=str(answer),
                      text=text, index=index)


@dataclasses.dataclass
class CountdownTask:
    """Countdown: combine the given numbers with + - * to reach the target (answer: an expression)."""

    numbers: int = 3
    seed: int = 0
    data_source: str = "countdown"

    def question(self, index: int) -> tuple[list[int], int]:
        rng = random.Random(derive_seed(self.seed, index))
        nums = [rng.randint(1, 12) for _ in range(self.numbers)]
        target = nums[0]
        for n in nums[1:]:
            target = rng.choice([target + n, target * n, abs(target - n)])
        return nums, target

    def prompt(self, index: int, tokenizer) -> Prompt:
        nums, target = self.question(index)
        text = (f"Using the numbers {', '.join(map(str, nums))} once each with + - *, make {target}. "
                "Answer with the expression only.")
        truth = f"{target}|{' '.join(map(str, sorted(nums)))}"
        return Prompt(render_chat(tokenizer, text), data_source=self.data_source, ground_truth=truth, text=text,
                      index=index)


@dataclasses.dataclass
class ToyTask:
    """A tokenizer-free task for tiny random models (tests, smoke runs): any prompt; the reward
    (`even_token_reward`) is the fraction of even token ids in the response."""

    vocab_size: int = 256
    data_source: str = "toy"

    def prompt(self, index: int, tokenizer=None) -> Prompt:
        first = 5 + index % min(40, self.vocab_size - 20)
        return Prompt([first, 9, 11], data_source=self.data_source, text=f"toy prompt {index}", index=index)


def _value(numbers: list[int], ops: list[str]) -> int:
    """`n0 op0 n1 op1 n2 ...` with * before + and - (as written in the question), without eval."""
    products, signs = [numbers[0]], [1]
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            products[-1] *= n
        else:
            products.append(n)
            signs.append(1 if op == "+" else -1)
    return sum(sign * product for sign, product in zip(signs, products))
