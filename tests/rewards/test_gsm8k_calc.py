"""GSM8K-calc reward: the last number of the response equals the ground truth as a number (golden cases, a property
over decimals written in the ways a model writes them, the bounds on long output, every row of the test split)."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.data.files import read_jsonl
from asyncrl.data.gsm8k_calc import decimal_text, gsm8k_calc_rows
from asyncrl.rewards import gsm8k_calc_reward
from asyncrl.rewards.registry import BUILTIN_REWARDS


@pytest.mark.parametrize("response, truth, expected", [
    ("24", "24", 1.0),
    ("24.0", "24", 1.0), ("24.00", "24", 1.0), ("24.", "24", 1.0),  # the same number
    ("48/2 = 24", "24", 1.0),  # the last number counts
    ("The answer is 24.", "24", 1.0),  # a sentence's full stop is not a decimal point
    ("1,000", "1000", 1.0), ("$10", "10", 1.0), ("It costs $1,250.50.", "1250.5", 1.0),
    ("0.2", "0.2", 1.0), (".2", "0.2", 1.0), ("0.20", "0.2", 1.0), ("1/5", "0.2", 0.0),  # 1/5: the last number is 5
    ("-10", "-10", 1.0), ("10", "-10", 0.0), ("-0", "0", 1.0),
    ("24, no wait, 25", "24", 0.0), ("25", "24", 0.0), ("2.4", "24", 0.0), ("240", "24", 0.0),
    ("0.33", "0.3", 0.0), ("0.30000000000000004", "0.3", 0.0),  # exact: a float's error is a wrong answer
    ("1.2.3", "1.2", 0.0),  # not a number
    ("no number", "24", 0.0), ("", "24", 0.0), ("...", "24", 0.0),
    ("٢٤", "24", 0.0),  # Arabic-Indic digits are not ASCII digits
    ("24" + " words" * 100, "24", 0.0),  # only the last 300 characters are read, as in the GSM8K reward
])
def test_gsm8k_calc_reward(response, truth, expected):
    assert gsm8k_calc_reward(response, truth) == expected


def test_it_is_the_builtin_reward_of_gsm8k_calc():
    assert BUILTIN_REWARDS["gsm8k-calc"] is gsm8k_calc_reward


def test_a_ground_truth_that_is_not_a_number_is_refused():
    with pytest.raises(ValueError, match=r"ground truth '3/4' is not a decimal number; make the rows with "
                                         r"`asyncrl data convert-gsm8k-calc`"):
        gsm8k_calc_reward("0.75", "3/4")
    assert gsm8k_calc_reward("1000", "1,000") == 1.0  # a ground truth written with commas is read as the number


_decimals = st.builds(lambda n, places: Fraction(n, 10 ** places), st.integers(-10 ** 9, 10 ** 9), st.integers(0, 6))


@given(_decimals, st.integers(0, 3), st.sampled_from(["{}", "= {}", "The answer is {}.", "${}", "x = {}\n"]),
       st.text(alphabet="abc +-*/=\n", max_size=40))
def test_any_way_of_writing_the_number_scores_1_and_another_number_0(value, zeros, template, prose):
    truth = decimal_text(value)
    written = truth + ("." + "0" * zeros if zeros and "." not in truth else "0" * zeros)  # 24 -> 24.00, 0.2 -> 0.200
    assert Fraction(written) == value
    if template == "${}" and value < 0:
        template = "{}"  # "$-5" is not how anyone writes it
    assert gsm8k_calc_reward(f"{prose} " + template.format(written), truth) == 1.0
    assert gsm8k_calc_reward(f"{prose} " + template.format(decimal_text(value + Fraction(1, 10 ** 6))), truth) == 0.0


def test_every_row_of_the_test_split_scores_its_own_ground_truth(gsm8k_test_file):
    rows, _ = gsm8k_calc_rows([row["answer"] for row in read_jsonl(gsm8k_test_file)])
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        expression = row["prompt"][0]["content"].removeprefix("Compute ").removesuffix(".")
        assert gsm8k_calc_reward(f"{expression} = {truth}", truth) == 1.0
        assert gsm8k_calc_reward(f"{expression} = {truth}1", truth) == 0.0


@pytest.mark.parametrize("response", [
    "9" * 200_000,  # one huge number: only its last 300 digits are read
    "1." + "0" * 100_000 + "1",
    "1," * 100_000,
    "." * 200_000,
    "-" * 200_000 + "1",
    "1e100000000",
])
def test_long_and_hostile_output_is_read_in_bounded_time(response):
    start = time.perf_counter()
    assert gsm8k_calc_reward(response, "42") == 0.0
    assert time.perf_counter() - start < 0.5
