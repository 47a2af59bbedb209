"""GSM8K rule reward (algos.md §6, verl `gsm8k.py`), on crafted strings and on the real test split."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.rewards import extract_gsm8k_answer, gsm8k_ground_truth, gsm8k_reward

GSM8K_TEST = Path(__file__).resolve().parents[1] / "fixtures" / "gsm8k" / "test.jsonl"

# --------------------------------------------------------------------------------------------------------------
# ground truth
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("answer, expected", [
    ("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18", "18"),
    ("...\n#### 1,450,000", "1450000"),  # commas removed
    ("...\n#### -10", "-10"),
    ("...\n#### 2.5  \n", "2.5"),  # surrounding whitespace stripped
    ("#### 3\n#### 4", "4"),  # the last ####
])
def test_ground_truth(answer, expected):
    assert gsm8k_ground_truth(answer) == expected


def test_ground_truth_requires_hashes():
    with pytest.raises(ValueError, match="####"):
        gsm8k_ground_truth("The answer is 18.")


# --------------------------------------------------------------------------------------------------------------
# extraction
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("response, strict, flexible", [
    ("So the total is 18.\n#### 18", "18", "18"),
    ("#### 1,200", "1200", "1200"),  # commas removed by both
    ("#### -7", "-7", "-7"),  # negative numbers
    ("#### 42.", "42.", "42"),  # strict keeps a trailing dot (verl); flexible drops it
    ("#### 3.75", "3.75", "3.75"),
    ("#### 5 and then #### 6", "6", "6"),  # last match wins
    ("#### 5 apples, 6 pears", "5", "6"),  # strict: last '#### N'; flexible: last number anywhere
    ("The answer is $1,200.", None, "1200"),  # no '#### ': strict finds nothing; flexible strips $ , .
    ("It costs $18", None, "18"),
    ("It is -3 degrees.", None, "-3"),
    ("####18", None, "18"),  # strict needs '#### ' with the space (verl regex)
    ("#### $18", None, "18"),  # strict: '$' right after '#### ' does not match (same as verl)
    ("I don't know.", None, None),  # a lone '.' is not a number
    ("a - b ...", None, None),
    ("", None, None),
])
def test_extract_strict_and_flexible(response, strict, flexible):
    assert extract_gsm8k_answer(response) == strict  # strict is the default
    assert extract_gsm8k_answer(response, "strict") == strict
    assert extract_gsm8k_answer(response, "flexible") == flexible


def test_only_the_last_300_characters_are_searched():
    # "#### 42" followed by 293 filler chars: 7 + 293 = 300 ⇒ the whole answer is inside the tail.
    inside = "#### 42" + "x" * 293
    assert extract_gsm8k_answer(inside) == "42"
    # One more filler char: the tail starts at "### 42…" ⇒ strict finds nothing.
    outside = "#### 42" + "x" * 294
    assert extract_gsm8k_answer(outside) is None
    assert gsm8k_reward(outside, "42") == 0.0
    # An earlier answer is ignored when a later one sits in the tail.
    assert extract_gsm8k_answer("#### 1 " + "y" * 400 + " #### 2") == "2"
    # Flexible: a number far from the end is not seen either.
    assert extract_gsm8k_answer("17 " + "z" * 300, "flexible") is None
    assert extract_gsm8k_answer("17 " + "z" * 297, "flexible") == "17"


def test_unknown_method_raises():
    with pytest.raises(ValueError, match="method"):
        extract_gsm8k_answer("#### 1", "lenient")
    with pytest.raises(ValueError, match="method"):
        gsm8k_reward("#### 1", "1", method="exact")


# --------------------------------------------------------------------------------------------------------------
# reward
# --------------------------------------------------------------------------------------------------------------


def test_reward_scores():
    assert gsm8k_reward("work\n#### 18", "18") == 1.0
    assert gsm8k_reward("work\n#### 17", "18") == 0.0  # wrong, default format_score 0
    assert gsm8k_reward("work\n#### 17", "18", format_score=0.1) == 0.1  # wrong but well formed
    assert gsm8k_reward("the answer is 18", "18", format_score=0.1) == 0.0  # no answer found: 0, not format_score
    assert gsm8k_reward("the answer is 18", "18", method="flexible") == 1.0
    assert gsm8k_reward("work\n#### 18", "18", score=2.0) == 2.0
    # Commas on either side are normalised.
    assert gsm8k_reward("#### 1,200", "1200") == 1.0
    assert gsm8k_reward("#### 1200", "1,200") == 1.0
    assert gsm8k_reward("#### 1200", " 1200 ") == 1.0
    # Exact string equality otherwise: "42." ≠ "42" under strict, "18.0" ≠ "18" under both.
    assert gsm8k_reward("#### 42.", "42", format_score=0.1) == 0.1
    assert gsm8k_reward("#### 42.", "42", method="flexible") == 1.0
    assert gsm8k_reward("#### 18.0", "18", method="flexible") == 0.0


@given(st.integers(-10**7, 10**7), st.text(alphabet="abc xyz\n+=*", max_size=200))
def test_reward_roundtrip_property(n, prose):
    # Any prose (no digits) followed by a well-formed answer line (with thousands separators) scores 1.
    line = f"{n:,}"
    response = f"{prose}\n#### {line}"
    assert gsm8k_reward(response, str(n)) == 1.0
    assert gsm8k_reward(response, str(n), method="flexible") == 1.0
    assert gsm8k_reward(response, str(n + 1), format_score=0.5) == 0.5


# --------------------------------------------------------------------------------------------------------------
# (c) the real GSM8K test split
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_rows():
    if not GSM8K_TEST.exists():
        pytest.skip(f"{GSM8K_TEST} not available")
    return [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]


def test_real_data_ground_truth_is_a_plain_number(gsm8k_rows):
    assert len(gsm8k_rows) == 1319  # the full GSM8K test split
    truths = [gsm8k_ground_truth(row["answer"]) for row in gsm8k_rows]
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", t) for t in truths), [t for t in truths if "," in t][:5]
    # 14 solutions write the answer with thousands separators ("#### 1,450,000"); all are stripped.
    with_commas = [row for row in gsm8k_rows if "," in row["answer"].split("####")[-1]]
    assert len(with_commas) == 14
    assert gsm8k_ground_truth(with_commas[0]["answer"]) == "2125"
    # Two answers are negative (-10 and -3); none is fractional.
    assert sorted(t for t in truths if t.startswith("-")) == ["-10", "-3"]


def test_real_data_strict_roundtrip(gsm8k_rows):
    # Every reference solution ends with "#### N": strict extraction of the solution recovers N.
    failures = [i for i, row in enumerate(gsm8k_rows)
                if gsm8k_reward(row["answer"], gsm8k_ground_truth(row["answer"])) != 1.0]
    assert failures == []
    # And the reward is not trivially 1: a wrong ground truth gives format_score.
    wrong = [gsm8k_reward(row["answer"], str(int(gsm8k_ground_truth(row["answer"])) + 1), format_score=0.5)
             for row in gsm8k_rows]
    assert set(wrong) == {0.5}


def test_real_data_flexible_agrees_with_strict(gsm8k_rows):
    # Flexible extraction (last number in the tail) of the full solution gives the same answer on all 1319 lines:
    # the "#### N" line is always last, and comma/trailing-dot normalisation handles the 14 "1,450,000" forms.
    agree = sum(extract_gsm8k_answer(row["answer"], "flexible") == extract_gsm8k_answer(row["answer"], "strict")
                == gsm8k_ground_truth(row["answer"]) for row in gsm8k_rows)
    assert agree == len(gsm8k_rows) == 1319
    # Without the "#### N" line, the last number of the derivation is still the answer in 1248 of 1319 lines;
    # the other 71 end with a number written differently ("16.00" for 16: exact string match) or with a trailing
    # number that is not the answer ("... 15 liters of water out of the 24 liters").
    derivation_agree = sum(extract_gsm8k_answer(row["answer"].split("####")[0], "flexible")
                           == gsm8k_ground_truth(row["answer"]) for row in gsm8k_rows)
    assert derivation_agree == 1248


def test_a_raw_solution_as_ground_truth_is_cut_at_its_hashes():
    """The raw split read with --data.answer-key answer gives the whole solution as the ground truth."""
    solution = "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n#### 1,072"
    assert gsm8k_reward("so #### 1072", solution) == 1.0
    assert gsm8k_reward("so #### 72", solution) == 0.0
    assert gsm8k_reward("so #### 1072", "1,072") == 1.0  # a converted ground truth as before
