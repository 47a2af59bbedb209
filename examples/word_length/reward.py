"""Rewards for the word-length task (data.jsonl): "How many letters are in the word "apple"? Reply with the
number only." Either function can be named with --reward.fn:

    asyncrl train cpu-demo --data.path examples/word_length/data.jsonl \
        --reward.fn examples/word_length/reward.py:score

`score` uses asyncrl's signature (the response, the ground truth, and the row's fields as keywords) and
returns a dict: `score` is the reward, the other numbers are logged as reward/exact and reward/has_number.
`compute_score` is verl's signature: a verl reward file looks like it and works unchanged.
"""

import re

_NUMBER = re.compile(r"-?\d+")


def _first_number(text: str) -> str | None:
    found = _NUMBER.search(text)
    return found.group(0) if found else None


def score(response: str, ground_truth: str, extra_info: dict | None = None, **row) -> dict:
    """1 for the right count, 0.1 for some other number (the format is right), 0 otherwise."""
    number = _first_number(response)
    right = number == ground_truth
    return {"score": 1.0 if right else (0.1 if number is not None else 0.0),
            "exact": float(response.strip() == ground_truth), "has_number": float(number is not None)}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom_reward_function signature: 1.0 for the right count, else 0.0."""
    return 1.0 if _first_number(solution_str) == str(ground_truth) else 0.0
