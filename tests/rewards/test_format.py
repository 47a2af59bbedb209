"""Format rewards: GSM8K answer line and R1-style <think>/<answer> shape."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.rewards import GSM8K_FORMAT, THINK_ANSWER_FORMAT, format_reward


@pytest.mark.parametrize("response, expected", [
    ("#### 42", 1.0),
    ("She has 3 + 4 = 7 apples.\n#### 7", 1.0),
    ("multi\nline\nwork\n#### -3.5\n", 1.0),  # negative decimal, trailing newline allowed
    ("#### 1,200   ", 1.0),  # thousands separator and trailing spaces
    ("####42", 1.0),  # whitespace after #### is optional in the format check
    ("#### 42 apples", 0.0),  # must end with the number
    ("#### 42\nand then more text", 0.0),  # answer line is not the last thing
    ("The answer is 42", 0.0),  # no ####
    ("#### $42", 0.0),  # currency sign is not a number
    ("#### -", 0.0),
    ("", 0.0),
])
def test_gsm8k_format(response, expected):
    assert format_reward(response) == expected  # GSM8K_FORMAT is the default
    assert format_reward(response, GSM8K_FORMAT) == expected


@pytest.mark.parametrize("response, expected", [
    ("<think>2 + 2 = 4</think><answer>4</answer>", 1.0),
    ("  <think>step 1\nstep 2\n</think>\n<answer>\n4\n</answer>\n", 1.0),  # DOTALL: newlines inside
    ("<think></think><answer></answer>", 1.0),  # shape only, not content
    ("<answer>4</answer>", 0.0),  # missing think
    ("<think>reasoning</think>", 0.0),  # missing answer
    ("<answer>4</answer><think>x</think>", 0.0),  # wrong order
    ("Sure! <think>x</think><answer>4</answer>", 0.0),  # preamble
    ("<think>x</think><answer>4</answer> and more", 0.0),  # trailing text
    ("<think>x<answer>4</answer>", 0.0),  # unclosed think
])
def test_think_answer_format(response, expected):
    assert format_reward(response, THINK_ANSWER_FORMAT) == expected


def test_custom_score_and_pattern():
    assert format_reward("#### 5", score=0.25) == 0.25
    assert format_reward("no answer", score=0.25) == 0.0
    # search semantics: a custom pattern may match anywhere; DOTALL lets "." cross lines.
    assert format_reward("a\nb\\boxed{3}\nc", r"\\boxed\{.+\}") == 1.0
    assert format_reward("start\nend", r"start.end") == 1.0
    assert format_reward("plain", r"\\boxed") == 0.0


@pytest.mark.parametrize("pattern", ["(", "[a-", "*abc", "(?P<x>a)(?P<x>b)"])
def test_invalid_regex_raises_value_error(pattern):
    with pytest.raises(ValueError, match="pattern"):
        format_reward("anything", pattern)


FORMER_THINK_ANSWER = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"  # quadratic on hostile responses


@given(st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "x", "<"]), max_size=12))
def test_the_linear_think_answer_pattern_matches_what_the_former_one_did(parts):
    response = "".join(parts)
    assert format_reward(response, THINK_ANSWER_FORMAT) == format_reward(response, FORMER_THINK_ANSWER)
