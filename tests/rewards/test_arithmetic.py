"""Rewards of the procedural tasks, executed: the last-integer match and countdown (golden cases, attacks,
ASCII digits only)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.rewards import arithmetic_reward, countdown_reward

# --------------------------------------------------------------------------------------------------------------
# arithmetic_reward: the last integer in the response
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, truth, expected", [
    ("42", "42", 1.0),
    ("37 + 5 = 42", "42", 1.0),  # the last integer counts
    ("42, no wait, 41", "42", 0.0),
    ("The answer is 1,200.", "1200", 1.0),  # commas are dropped
    ("-7", "-7", 1.0), ("7", "-7", 0.0),
    ("0042", "42", 1.0),  # compared as integers
    ("no number", "42", 0.0), ("", "42", 0.0),
    ("٤٢", "42", 0.0),  # Arabic-Indic 4 2: not ASCII digits, not a number
    ("9" * 100_000, "42", 0.0),  # past int()'s 4300-digit limit: compared without converting, no ValueError
    ("4" + "0" * 5000 + "2", "42", 0.0),
])
def test_arithmetic_reward(response, truth, expected):
    assert arithmetic_reward(response, truth) == expected


@given(st.integers(-10**12, 10**12), st.text(alphabet="abc =+-*\n", max_size=50))
def test_arithmetic_reward_finds_the_last_number(n, prose):
    assert arithmetic_reward(f"{prose} {n}", str(n)) == 1.0
    assert arithmetic_reward(f"{prose} {n + 1}", str(n)) == 0.0


# --------------------------------------------------------------------------------------------------------------
# countdown_reward: an expression over exactly the given numbers that makes the target
# --------------------------------------------------------------------------------------------------------------

TRUTH = "27|3 4 5"  # target 27 from the numbers 3, 4, 5: 3 * (4 + 5) = 3 * 9 = 27


@pytest.mark.parametrize("response, expected", [
    ("3 * (4 + 5)", 1.0),
    ("(5 + 4) * 3", 1.0),  # any order of the numbers
    ("3*(4+5) = 27", 1.0),  # "= target" after the expression is allowed
    ("Let me think.\n\n3 * (4 + 5)\n", 1.0),  # the last non-empty line counts
    ("3 * (4 + 5)\nso the answer is that", 0.0),  # ... so prose after it loses
    ("3 * 4 + 5", 0.0),  # 17: wrong value
    ("3 * (4 + 4)", 0.0),  # 24, and 4 used twice, 5 never
    ("27", 0.0),  # the target alone does not use the numbers
    ("3 * (4 + 5) * 1", 0.0),  # an extra number
    ("3 * 9", 0.0),  # 27, but 9 is not one of the numbers
    ("3 ** 3", 0.0),  # no powers in countdown (and not the numbers)
    ("3 * (4 + 5", 0.0),  # malformed
    ("٣ * (٤ + ٥)", 0.0),  # non-ASCII digits are not numbers
    ("3 / 1 * 9", 0.0),  # "/" is not allowed
    ("", 0.0),
])
def test_countdown_golden(response, expected):
    assert countdown_reward(response, TRUTH) == expected


def test_countdown_allows_a_leading_minus():
    assert countdown_reward("-3 + 5", "2|3 5") == 1.0  # -3 + 5 = 2


@pytest.mark.parametrize("attack", [
    "12**11**10",  # eval would compute 12 ** (11 ** 10): hours
    "12 * * 11 * * 10",
    "(((12**11)**10)**12)",
    "(" * 5000 + "12 * 11 * 10" + ")" * 5000,  # too long and too deep
    "12" + "*11" * 600 + "*10",  # too long; the numbers do not match either
])
def test_countdown_attacks_score_zero(attack):
    assert countdown_reward(attack, "1320|10 11 12") == 0.0  # 12 * 11 * 10 = 1320


def test_countdown_scores_only_the_value_under_attack():
    # The numbers match and ** is refused before anything is computed: 12 ** (11 ** 10) is never built.
    assert countdown_reward("12**11**10", "0|10 11 12") == 0.0
    assert countdown_reward("12 * 11 * 10", "1320|10 11 12") == 1.0
