"""The bounded arithmetic evaluator (golden values, every refusal and every cap at its edge, a differential
property against Python on small expressions) and the bounded integer comparison."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.rewards.bounded_arithmetic import (ARITHMETIC_OPERATORS, COUNTDOWN_OPERATORS, MAX_CHARS, MAX_DEPTH,
                                                MAX_INT_BITS, MAX_LITERAL_CHARS, compare_integer_text,
                                                evaluate_arithmetic)


@pytest.mark.parametrize("expression, expected", [
    ("(12 + 30) * 4", 168),  # 42 * 4
    ("7 / 2", 3.5),  # true division gives a float
    ("7 // 2", 3), ("-7 // 2", -4), ("-7 % 3", 2),  # Python's floor semantics
    ("2**10", 1024),
    ("2**3**2", 512),  # right-associative: 2 ** 9, not 8 ** 2 = 64
    ("-2**2", -4),  # ** binds tighter than the sign on its left: -(2 ** 2)
    ("2**-1", 0.5),  # a sign on the right of ** is the exponent's
    ("(-2)**2", 4),
    ("1 + 2 * 3 - 4 / 2", 5.0),  # 1 + 6 - 2.0
    ("--1", 1), ("+-+3", -3),
    (".5 + 1.", 1.5), ("1e3", 1000.0), ("2.5E-1", 0.25),
    ("  42  ", 42),
    ("((((1))))", 1),
    ("0**0", 1),
    ("(-1)**(10**300 + 1)", -1),  # a huge exponent of -1, 0 or 1 is cheap and allowed
])
def test_values(expression, expected):
    value = evaluate_arithmetic(expression)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("expression, why", [
    ("", "ends where a number"),
    ("3 +", "ends where a number"),
    ("(1 + 2", "'(' is not closed"),
    ("1 + 2)", "unexpected ')' after a complete expression"),
    ("2 3", "unexpected '3' after a complete expression"),
    ("()", "')' where a number or '(' should come"),
    ("x + 1", "unexpected 'x' at character 0"),
    ("__import__('os')", "unexpected '_' at character 0"),
    ("2 ^ 3", "unexpected '^' at character 2"),
    ("1_000", "unexpected '_'"), ("0x10", "unexpected 'x'"), ("1j", "unexpected 'j'"),  # Python-only syntax
    ("٣ + 1", "unexpected '٣' at character 0"),  # a non-ASCII digit is not a digit here
    ("1 / 0", "division by zero"), ("1 // 0", "division by zero"), ("1 % 0", "division by zero"),
    ("0 ** -1", "division by zero"), ("1.5 % 0.0", "division by zero"),
    ("12**11**10", "a power would reach 2**1024"),  # refused before it is computed
    ("(((9**64)**64)**64)**64", "a power would reach 2**1024"),
    ("2**1024", "a result would reach 2**1024"),  # estimate 1024 * (2 - 1) bits is not over: the result is
    ("-(2**1023) * 2", "a result would reach 2**1024"),
    ("1e308 * 10", "too large for a float (inf)"),
    ("1e400", "too large for a float (inf)"),
    ("2 ** 1024.0", "too large for a float"),
    ("(2**1000) ** 0.5 * 2**1000 * 1e10", "too large for a float"),
    ("(-8) ** (1/3)", "not a real number"),
])
def test_refusals_say_why(expression, why):
    with pytest.raises(ValueError, match="cannot evaluate") as refused:
        evaluate_arithmetic(expression)
    assert why in str(refused.value)


def test_the_caps_at_their_edges():
    assert evaluate_arithmetic("2**1023") == 2 ** 1023 and MAX_INT_BITS == 1024  # 1024 bits: the largest allowed
    assert evaluate_arithmetic("-(2**1023 - 1 + 2**1023)") == -(2 ** 1024 - 1)
    literal = "0" * (MAX_LITERAL_CHARS - 300) + "9" * 300  # 400 characters, 10**300 - 1: read
    assert evaluate_arithmetic(literal + " // 10**299") == 9
    with pytest.raises(ValueError, match=f"more than {MAX_LITERAL_CHARS} characters"):
        evaluate_arithmetic("9" * (MAX_LITERAL_CHARS + 1))
    nested = "(" * (MAX_DEPTH - 1) + "1" + ")" * (MAX_DEPTH - 1)  # with the sign below, depth 50: allowed
    assert evaluate_arithmetic("-" + nested) == -1
    with pytest.raises(ValueError, match=f"nests deeper than {MAX_DEPTH} levels"):
        evaluate_arithmetic("-(" + nested + ")")
    with pytest.raises(ValueError, match=f"nests deeper than {MAX_DEPTH}"):
        evaluate_arithmetic("-" * (MAX_DEPTH + 1) + "1")
    with pytest.raises(ValueError, match=f"nests deeper than {MAX_DEPTH}"):
        evaluate_arithmetic("1**" * (MAX_DEPTH + 1) + "1")  # a tower is nesting too
    long = "1+" * (MAX_CHARS // 2 - 1) + "1"  # 999 characters
    assert evaluate_arithmetic(long) == MAX_CHARS // 2
    with pytest.raises(ValueError, match=f"it has 1001 characters, more than {MAX_CHARS}"):
        evaluate_arithmetic(long + "+1")


def test_an_error_quotes_a_long_expression_shortened():
    with pytest.raises(ValueError) as refused:
        evaluate_arithmetic("x" * 500)
    assert len(str(refused.value)) < 150


def test_operators_can_be_restricted():
    assert evaluate_arithmetic("3 * (4 + 5) - -1", operators=COUNTDOWN_OPERATORS) == 28
    for expression, symbol in (("12**11**10", "**"), ("12 / 4", "/"), ("7 // 2", "//"), ("7 % 2", "%")):
        with pytest.raises(ValueError, match=re.escape(f"'{symbol}' is not allowed here; the operators are + - *")):
            evaluate_arithmetic(expression, operators=COUNTDOWN_OPERATORS)
    assert set(ARITHMETIC_OPERATORS) == {"+", "-", "*", "/", "//", "%", "**"}


def test_a_non_string_is_refused():
    with pytest.raises(ValueError, match="an expression is a string, not a int"):
        evaluate_arithmetic(5)


_small = st.integers(0, 99).map(str)


@st.composite
def _expressions(draw, depth: int = 0) -> str:
    """Small expressions over + - * and parentheses, whose value Python computes instantly."""
    if depth > 3 or draw(st.booleans()):
        return draw(_small)
    left, right = draw(_expressions(depth + 1)), draw(_expressions(depth + 1))
    op = draw(st.sampled_from(["+", "-", "*", "//", "%"]))
    wrap = draw(st.booleans())
    return f"({left} {op} {right})" if wrap else f"{left} {op} {right}"


@given(_expressions())
def test_agrees_with_python_on_small_expressions(expression):
    try:
        expected = eval(expression)  # noqa: S307 - the oracle, on strings this test built from digits and + - * // %
    except ZeroDivisionError:
        with pytest.raises(ValueError, match="division by zero"):
            evaluate_arithmetic(expression)
        return
    assert evaluate_arithmetic(expression) == expected


@pytest.mark.parametrize("text, value, order", [
    ("42", 42, 0), ("0042", 42, 0), ("-0", 0, 0), ("000", 0, 0),
    ("41", 42, -1), ("43", 42, 1), ("-5", -6, 1), ("-7", -6, -1),
    ("9" * 100_000, 42, 1), ("-" + "9" * 100_000, 42, -1),  # decided by length and sign: never converted
    ("0" * 100_000 + "42", 42, 0),  # leading zeros do not count as digits
])
def test_compare_integer_text(text, value, order):
    assert compare_integer_text(text, value) == order


@given(st.integers(-10**30, 10**30), st.integers(-10**30, 10**30))
def test_compare_integer_text_agrees_with_int(a, b):
    assert compare_integer_text(str(a), b) == (a > b) - (a < b)


@pytest.mark.parametrize("text", ["", "4 2", "+1", "٤٢", "1.5"])
def test_compare_integer_text_takes_ascii_integers_only(text):
    with pytest.raises(ValueError, match="not an integer written in ASCII digits"):
        compare_integer_text(text, 42)
