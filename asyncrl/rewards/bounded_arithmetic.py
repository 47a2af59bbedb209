"""Arithmetic on model output that always returns quickly: an eval-free evaluator and a bounded integer comparison.

    evaluate_arithmetic("(12 + 30) * 4")                     # 168
    evaluate_arithmetic("7 / 2")                             # 3.5
    evaluate_arithmetic("12**11**10")                        # ValueError: ... more than 1024 bits ...
    evaluate_arithmetic("3 * (4 + 5)", operators=COUNTDOWN_OPERATORS)   # 27
    compare_integer_text("9" * 100_000, 42)                  # 1: larger, without building the integer

Why neither `eval` nor `ast`: `eval` runs anything and `9**9**9` computes for hours while holding the GIL (the
agent stops heartbeating). `ast.parse` accepts all of Python's number syntax (`1_0`, `0x10`, `1j`), recurses on
nesting (MemoryError on `"-" * 100_000`) and says nothing about what `**` will cost. Here a small tokenizer
(ASCII digits only: `int()` and `\\d` also take '٣') feeds a recursive-descent parser that computes while it
parses, and every cost is bounded before it is paid:

  input      at most MAX_CHARS characters
  nesting    at most MAX_DEPTH levels of parentheses, signs and exponents (the recursion depth of the parser)
  numbers    a literal has at most MAX_LITERAL_CHARS characters
  integers   every result, intermediate ones included, is below 2 ** MAX_INT_BITS in magnitude (the range of a
             float); a power a ** b is refused *before* it is computed when b * (bit_length(a) - 1), a lower
             bound of the result's size in bits, is over the cap, so no power ever builds more than
             2 * MAX_INT_BITS bits
  floats     finite and real (overflow, inf and complex powers such as (-8) ** 0.5 are refused)

One evaluation therefore does at most about MAX_CHARS operations on integers of at most 2 * MAX_INT_BITS bits:
well under a millisecond. Anything refused raises one ValueError saying what and why.

Grammar (Python's precedence: `**` is right-associative and binds tighter than a sign on its left, -2**2 = -4):

    expr   := term (('+' | '-') term)*
    term   := unary (('*' | '/' | '//' | '%') unary)*
    unary  := ('+' | '-') unary | power
    power  := atom ('**' unary)?
    atom   := NUMBER | '(' expr ')'
    NUMBER := [0-9]+ ('.' [0-9]*)? | '.' [0-9]+, then optionally [eE] [+-]? [0-9]+   (with '.' or 'e': a float)
"""

from __future__ import annotations

import math
import operator
import re
from typing import Callable, Collection, Union

__all__ = ["evaluate_arithmetic", "compare_integer_text", "ARITHMETIC_OPERATORS", "COUNTDOWN_OPERATORS",
           "MAX_CHARS", "MAX_DEPTH", "MAX_LITERAL_CHARS", "MAX_INT_BITS"]

Number = Union[int, float]

MAX_CHARS = 1000
"""Longest expression evaluated (characters)."""
MAX_DEPTH = 50
"""Deepest nesting of parentheses, signs and exponents."""
MAX_LITERAL_CHARS = 400
"""Longest number literal (a 1024-bit integer has 309 digits)."""
MAX_INT_BITS = 1024
"""Every integer result is below 2 ** MAX_INT_BITS in magnitude (about 1.8e308, the largest float)."""

ARITHMETIC_OPERATORS = frozenset({"+", "-", "*", "/", "//", "%", "**"})
"""Every operator the evaluator knows (the calculator tool's)."""
COUNTDOWN_OPERATORS = frozenset({"+", "-", "*"})
"""The countdown task's operators."""

_SPACE = re.compile(r"\s*")
_TOKEN = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"  # a number
                    r"|\*\*|//|[-+*/%()]")  # a symbol
_ORDER = ("+", "-", "*", "/", "//", "%", "**")
_BINARY: dict[str, Callable[[Number, Number], Number]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
    "//": operator.floordiv, "%": operator.mod}


def _short(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit - 3]) + "..."


def _tokens(expression: str) -> list[str]:
    """The expression's numbers and symbols, in order; ValueError at the first character that is neither."""
    tokens, pos = [], _SPACE.match(expression).end()
    while pos < len(expression):
        match = _TOKEN.match(expression, pos)
        if match is None:
            raise ValueError(f"unexpected {expression[pos]!r} at character {pos}")
        tokens.append(match.group())
        pos = _SPACE.match(expression, match.end()).end()
    return tokens


def _checked(value) -> Number:
    """`value` when it is within the caps (a finite real, an integer below 2 ** MAX_INT_BITS), else ValueError."""
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise ValueError(f"a result would reach 2**{MAX_INT_BITS} or more (about 1.8e308)")
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, float):
        raise ValueError(f"a result is too large for a float ({value})")
    raise ValueError(f"a result is not a real number ({value})")  # (-8) ** 0.5 is complex in Python


def _number(literal: str) -> Number:
    if len(literal) > MAX_LITERAL_CHARS:
        raise ValueError(f"a number has more than {MAX_LITERAL_CHARS} characters")
    return _checked(float(literal) if any(c in literal for c in ".eE") else int(literal))


def _power(base: Number, exponent: Number) -> Number:
    """base ** exponent, refused before it is computed when an integer result would be over the cap."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * (abs(base).bit_length() - 1) > MAX_INT_BITS:  # |base| ** exponent >= 2 ** that
            raise ValueError(f"a power would reach 2**{MAX_INT_BITS} or more (about 1.8e308)")
    return _checked(base ** exponent)


def _apply(symbol: str, left: Number, right: Number) -> Number:
    try:
        return _power(left, right) if symbol == "**" else _checked(_BINARY[symbol](left, right))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:  # an integer too large for a float, or a float power out of range
        raise ValueError("a result is too large for a float") from None


class _Parser:
    """Recursive descent over a token list (one per evaluation; the grammar is in the module docstring)."""

    def __init__(self, tokens: list[str], operators: Collection[str]):
        self.tokens, self.operators, self.pos = tokens, operators, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, symbols: tuple[str, ...]) -> str | None:
        """The next token when it is one of `symbols` (and an allowed operator), consumed; else None."""
        token = self.peek()
        if token not in symbols:
            return None
        if token != "(" and token not in self.operators:
            allowed = " ".join(op for op in _ORDER if op in self.operators)
            raise ValueError(f"{token!r} is not allowed here; the operators are {allowed}")
        self.pos += 1
        return token

    def expr(self, depth: int) -> Number:
        value = self.term(depth)
        while (symbol := self.take(("+", "-"))) is not None:
            value = _apply(symbol, value, self.term(depth))
        return value

    def term(self, depth: int) -> Number:
        value = self.unary(depth)
        while (symbol := self.take(("*", "/", "//", "%"))) is not None:
            value = _apply(symbol, value, self.unary(depth))
        return value

    def unary(self, depth: int) -> Number:
        if depth > MAX_DEPTH:
            raise ValueError(f"it nests deeper than {MAX_DEPTH} levels")
        sign = self.take(("+", "-"))
        if sign is not None:
            value = self.unary(depth + 1)
            return -value if sign == "-" else value
        base = self.atom(depth)
        if self.take(("**",)) is None:
            return base
        return _apply("**", base, self.unary(depth + 1))

    def atom(self, depth: int) -> Number:
        token = self.peek()
        if token is None:
            raise ValueError("it ends where a number or '(' should come")
        self.pos += 1
        if token == "(":
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise ValueError("a '(' is not closed")
            self.pos += 1
            return value
        if token[0].isdigit() or token[0] == ".":
            return _number(token)
        raise ValueError(f"{token!r} where a number or '(' should come")


def evaluate_arithmetic(expression: str, *, operators: Collection[str] = ARITHMETIC_OPERATORS) -> Number:
    """The value of an arithmetic expression over ASCII numbers, parentheses and `operators`, computed within
    the caps of the module docstring (an int, or a float once '/', a decimal or a negative power is involved).

    Raises:
      ValueError: "cannot evaluate '<the expression, shortened>': <why>" — malformed, an operator that is not
        allowed, a non-ASCII digit, too long, too deep, a number or result over the caps, division by zero.
    """
    if not isinstance(expression, str):
        raise ValueError(f"cannot evaluate {expression!r:.60}: an expression is a string, not a "
                         f"{type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"cannot evaluate {_short(expression)}: it has {len(expression)} characters, "
                         f"more than {MAX_CHARS}")
    try:
        parser = _Parser(_tokens(expression), frozenset(operators))
        value = parser.expr(0)
        if parser.peek() is not None:
            raise ValueError(f"unexpected {parser.peek()!r} after a complete expression")
    except ValueError as err:
        raise ValueError(f"cannot evaluate {_short(expression)}: {err}") from None
    except RecursionError:  # only when the caller's own stack is nearly full: MAX_DEPTH keeps ours short
        raise ValueError(f"cannot evaluate {_short(expression)}: it nests too deeply for the stack") from None
    return value


def compare_integer_text(text: str, value: int) -> int:
    """-1, 0 or 1 as the integer written in `text` ('-?[0-9]+', any length) is below, equal to or above `value`.

    A text with more digits than `value` (leading zeros aside) is decided by its sign alone, so a 100,000-digit
    answer is never converted (Python refuses int() of more than 4300 digits, and it is slow below that).
    """
    if not re.fullmatch(r"-?[0-9]+", text):
        raise ValueError(f"compare_integer_text: {_short(text)} is not an integer written in ASCII digits")
    digits = text.lstrip("-").lstrip("0") or "0"
    negative = text.startswith("-") and digits != "0"
    if len(digits) > len(str(abs(value))):
        return -1 if negative else 1
    number = -int(digits) if negative else int(digits)
    return (number > value) - (number < value)
