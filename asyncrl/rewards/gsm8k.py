"""GSM8K rule reward (data_source "openai/gsm8k").

Ground truth is the text after "#### " in the dataset's answer, commas removed (a whole solution given as the
ground truth, as the raw split read with --data.answer-key answer gives it, is cut there too). Two extractors:
* strict: the last "#### <number>" in the response (verl's default), with "," removed ("#### $18" does
  not count, as in verl);
* flexible: the last number anywhere in the response, with "," "$" and a trailing "." removed.
Only the last 300 characters are searched, as in verl, so long derivations cost nothing.
Deviations from verl's flexible extractor: verl keeps commas and trailing dots ("1,200" ≠ "1200"); ours
normalises them, which is what users of a "flexible" match expect. And verl takes the last match even when it
is only punctuation ("." or "," after the last number, e.g. "... is 42. Done." gives "."), which never equals
a ground truth; ours skips such matches and takes the last real number (42).
"""

from __future__ import annotations

import re
from typing import Literal

__all__ = ["gsm8k_ground_truth", "extract_gsm8k_answer", "gsm8k_reward"]

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_TAIL_CHARS = 300


def gsm8k_ground_truth(answer: str) -> str:
    """The final answer of a GSM8K solution: the text after the last "####", without commas.

    Raises:
      ValueError: the solution has no "####" line (not a GSM8K answer field).
    """
    if "####" not in answer:
        raise ValueError(f"gsm8k_ground_truth: no '####' in the answer field {answer[-80:]!r}; "
                         "pass the dataset's `answer` column")
    return answer.split("####")[-1].strip().replace(",", "")


def extract_gsm8k_answer(response: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The model's final answer as a string, or None if there is none."""
    tail = response[-_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method == "flexible":
        for candidate in reversed(_NUMBER.findall(tail)):
            cleaned = candidate.replace(",", "").replace("$", "").rstrip(".")
            if cleaned not in ("", "-"):
                return cleaned
        return None
    raise ValueError(f"extract_gsm8k_answer: method={method!r} is not 'strict' or 'flexible'")


def gsm8k_reward(response: str, ground_truth: str, *, method: Literal["strict", "flexible"] = "strict",
                 format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` if the extracted answer equals the ground truth, `format_score` if an answer was found but is
    wrong, 0 if none was found (verl semantics)."""
    answer = extract_gsm8k_answer(response, method)
    if answer is None:
        return 0.0
    truth = gsm8k_ground_truth(ground_truth) if "####" in ground_truth else ground_truth.replace(",", "").strip()
    return score if answer == truth else format_score
