"""Final-answer matching for math problems: boxed extraction, normalisation, string/numeric matching."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.rewards import answers_match, extract_boxed, math_reward, normalize_answer

# --------------------------------------------------------------------------------------------------------------
# extract_boxed
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    (r"so the answer is \boxed{42}.", "42"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),  # nested braces
    (r"\boxed{\left\{1, 2\right\}}", r"\left\{1, 2\right\}"),  # escaped braces still balance
    (r"first \boxed{1}, finally \boxed{2}", "2"),  # the last box
    (r"\boxed{1} then \fbox{7}", "7"),  # \fbox counts too
    (r"\boxed {7}", "7"),  # space before the brace
    (r"$\boxed 5$", "5"),  # brace-less form, stops at '$'
    (r"\boxed 5 where x \in \{1,2\}", "5"),  # a later brace does not belong to the box
    ("no box here", None),
    (r"\boxed{\frac{1}{2}", None),  # unbalanced: cut off mid-answer
    (r"\boxed{1} and then \boxed{\frac{1}{2", None),  # the last box is cut off: no fallback to an earlier one
    ("\\boxed", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# --------------------------------------------------------------------------------------------------------------
# normalize_answer
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, expected", [
    (r"\dfrac{3}{4}", r"\frac{3}{4}"),
    (r"\tfrac{3}{4}", r"\frac{3}{4}"),
    (r"\frac12", r"\frac{1}{2}"),  # brace-less
    (r"\frac{1}2", r"\frac{1}{2}"),
    (r"\sqrt2", r"\sqrt{2}"),
    ("x = 5", "5"),  # keep the right-hand side
    (r"x \le 5", r"x\le5"),  # inequalities are not split
    ("1,000", "1000"),  # thousands separators
    ("-1,234,567.25", "-1234567.25"),
    ("(1,2)", "(1,2)"),  # a tuple is not a thousands-separated number
    ("5.", "5"),  # trailing dot
    ("5.50", "5.5"),  # trailing zeros of a decimal
    ("10.0", "10"),
    ("100", "100"),  # zeros of an integer are kept
    (r"50\%", "50"),
    ("50%", "50"),
    (r"90^\circ", "90"),
    (r"90^{\circ}", "90"),
    ("$42$", "42"),
    (r"\$42", "42"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"1\!000", "1000"),
    (r"\displaystyle\frac{1}{2}", r"\frac{1}{2}"),
    (r"\text{(A)}", "(A)"),
    (r"\textbf{B}", "B"),
    (r"\mathrm{m}", "m"),
    (r"10\text{ cm}", "10cm"),  # \text{} is unwrapped; units themselves are kept
    ("  7  ", "7"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


# --------------------------------------------------------------------------------------------------------------
# answers_match / math_reward
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pred, truth", [
    (r"\frac{1}{2}", "0.5"),  # fraction vs decimal: numeric comparison
    (r"\dfrac{1}{2}", r"\frac{1}{2}"),
    (r"\frac12", r"\frac{1}{2}"),
    ("1/2", "0.5"),
    (r"-\frac{3}{4}", "-0.75"),
    ("x = 5", "5"),
    ("1,000", "1000"),
    ("1000.00", "1,000"),
    (r"10\text{ cm}", "10 cm"),
    (r"\text{5}", "5"),
    (r"\$5", "5"),
    ("0.3333333", r"\frac{1}{3}"),  # within the relative tolerance 1e-6
    (".5", "0.5"),
    (r"\sqrt2", r"\sqrt{2}"),
    (r"\left(1,2\right)", "(1, 2)"),
])
def test_answers_match(pred, truth):
    assert answers_match(pred, truth)
    assert answers_match(truth, pred)


@pytest.mark.parametrize("pred, truth", [
    ("0.33", r"\frac{1}{3}"),  # outside the tolerance
    ("x+1", "1+x"),  # rule-based, not a CAS
    (r"10\text{ cm}", "10"),  # units are not stripped
    ("(1,2)", "1,2"),
    ("5", "-5"),
    (r"\frac{1}{0}", "0"),  # division by zero is not a number
    ("2", "3"),
])
def test_answers_do_not_match(pred, truth):
    assert not answers_match(pred, truth)


def test_rel_tol():
    assert answers_match("1000.0005", "1000")  # |Δ| = 5e-4 ≤ 1e-6 × 1000
    assert not answers_match("1000.002", "1000")
    assert answers_match("1.05", "1", rel_tol=0.1)


def test_math_reward():
    assert math_reward(r"We get $\boxed{\frac{1}{2}}$.", "0.5") == 1.0
    assert math_reward(r"We get $\boxed{\dfrac{1}{2}}$.", r"\frac12", score=2.0) == 2.0
    assert math_reward(r"\boxed{x = 5}", "5") == 1.0
    assert math_reward(r"\boxed{1,000}", "1000") == 1.0
    assert math_reward(r"\boxed{12\text{ cm}}", r"12\text{ cm}") == 1.0
    assert math_reward(r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}") == 1.0
    assert math_reward(r"\boxed{3}", "4") == 0.0
    assert math_reward("The answer is 0.5", "0.5") == 0.0  # no box
    assert math_reward(r"\boxed{\frac{1}{2}", r"\frac{1}{2}") == 0.0  # unbalanced
    assert math_reward(r"\boxed{0.5} no wait \boxed{0.25}", "0.5") == 0.0  # the last box counts


@given(st.integers(-10**6, 10**6), st.integers(1, 10**4))
def test_fraction_forms_match_their_decimal(num, den):
    # \frac{a}{b}, \dfrac{a}{b} and a/b all match each other and a correctly rounded decimal.
    frac = rf"\frac{{{num}}}{{{den}}}"
    assert answers_match(rf"\dfrac{{{num}}}{{{den}}}", frac)
    assert answers_match(f"{num}/{den}", frac)
    assert answers_match(repr(num / den), frac)
    assert math_reward(rf"\boxed{{{frac}}}", repr(num / den)) == 1.0


@given(st.integers(-10**9, 10**9))
def test_thousands_separators_property(n):
    assert answers_match(f"{n:,}", str(n))
    assert normalize_answer(f"{n:,}") == str(n)


# --------------------------------------------------------------------------------------------------------------
# bounded numbers: long or huge answers are compared as strings, never built
# --------------------------------------------------------------------------------------------------------------


def test_long_numbers_are_compared_exactly_up_to_the_caps():
    big = "9" * 300  # 10**300 - 1: compared as an exact rational, relative tolerance 1e-6
    assert answers_match(big, big + ".0") and answers_match(big, "1e300")  # |difference| = 1 <= 1e-6 * 1e300
    assert not answers_match(big, "5" + "0" * 299)  # half of it
    assert not answers_match("9" * 4000, "1e4000")  # formerly float() of both raised OverflowError
    assert answers_match("9" * 4000, "9" * 4000)  # equal strings
    assert not answers_match("9" * 4000, "9" * 3999 + "8")  # over MAX_NUMBER_CHARS (400): strings only
    assert answers_match("1e1000", "10e999")  # exponents up to MAX_EXPONENT (1000): parsed
    assert not answers_match("1e1001", "10e1000")  # over it: strings only (never 10 ** 100000000)
    assert math_reward(r"\boxed{1e100000000}", "1e100000000") == 1.0  # the same string still matches
    assert math_reward(r"\boxed{1e100000000}", "1e100000001") == 0.0
    assert answers_match("2.5e-3", "0.0025") and answers_match("-1e2", "-100")


@pytest.mark.parametrize("pred, truth", [
    ("٣", "3"),  # Arabic-Indic three
    (r"\frac{١}{٢}", "0.5"),
    ("١/٢", "0.5"),
    ("３", "3"),  # full-width three
])
def test_non_ascii_digits_are_not_numbers(pred, truth):
    assert not answers_match(pred, truth)


def test_brace_less_fraction_and_root_need_ascii_digits():
    assert normalize_answer(r"\frac٣٤") == r"\frac٣٤"  # left alone: not \frac{٣}{٤}
    assert normalize_answer(r"\sqrt٣") == r"\sqrt٣"
