"""GSM8K-calc: the calculator annotations of GSM8K's solutions as arithmetic prompts with exact answers.

    stats = convert_gsm8k_calc("gsm8k/train.jsonl", "data/gsm8k-calc/train.parquet", max_operators=2, max_digits=4)
    parse_calc("48/2")                                   # CalcExpression(value=Fraction(24, 1), operators=1, digits=2)

Every annotation `<<48/2=24>>` of a solution becomes one verl row: the user prompt "Compute 48/2." (the question
is left out; a system prompt comes from --data.system-prompt at train time), data_source "gsm8k-calc" (scored
by `asyncrl.rewards.gsm8k_calc`) and the ground truth "24", the exact value as a canonical decimal ("0.2", "-10",
never "24.0" or ".5"). It is arithmetic on real data, harder than the procedural two-digit sums, with two
difficulty knobs: the number of binary operators and the digits of the longest operand.

The expressions come from a downloaded file, so Python never evaluates them. `parse_calc` reads one with
`ast.parse(mode="eval")` (which builds a tree and runs nothing) and walks the tree through a whitelist — numbers
written in ASCII digits with an optional decimal point, + - * /, a unary minus and parentheses — computing with
`fractions.Fraction`, so 0.1 * 3 is exactly 0.3. Everything else is refused: names, calls, attributes, `**`,
`//`, `%`, a unary plus, `1e3`, `0x10`, `1_000`. Its costs are bounded before they are paid: an expression has at
most MAX_EXPRESSION_CHARS characters (so at most that many nodes and that deep a tree) and a number at most
MAX_LITERAL_DIGITS digits, so every value is a fraction of integers of a few hundred digits at most.

An annotation is kept when its exact value equals the value it states; the others are dropped and counted, each
under the first of these reasons that applies (`DROP_REASONS`, in this order):

  malformed      not `expression=value` (no "=", or several)
  too_long       the expression has more than MAX_EXPRESSION_CHARS characters
  stated_value   the stated value is not a plain decimal number ("$5", "1,000", "3/4")
  unsupported    the expression holds something outside the whitelist, or a number over MAX_LITERAL_DIGITS digits
  zero_division  it divides by zero
  no_operator    a bare number, "<<5=5>>": nothing to compute
  inexact        the exact value is no decimal of at most MAX_DECIMALS places (10/3, 1/1024)
  mismatch       the exact value differs from the stated one (a rounded or wrong annotation)
  max_operators  more binary operators than `max_operators` (--max-operators)
  max_digits     an operand of more than `max_digits` digits (--max-digits; leading zeros aside, 0.25 has 2)
  duplicate      an expression written the same way (spaces aside) came earlier (--dedupe, the default)
  excluded       the expression is one of another split's annotations (--exclude: a held-out split stays held out;
                 GSM8K's test and train splits share over half of their calculator steps)

Rows come out in the source's order, by row and then by annotation, so one source file gives one output file.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
import os
import pathlib
import re
from fractions import Fraction
from typing import Iterable, Mapping

from asyncrl.data.files import SUFFIXES, read_gsm8k, write_rows

__all__ = ["parse_calc", "decimal_text", "calc_expressions", "gsm8k_calc_rows", "convert_gsm8k_calc", "format_drops", "CalcExpression",
           "CalcRefused", "CalcConversion", "DROP_REASONS", "GSM8K_CALC_SOURCE", "GSM8K_CALC_PROMPT",
           "MAX_EXPRESSION_CHARS", "MAX_LITERAL_DIGITS", "MAX_DECIMALS"]

GSM8K_CALC_SOURCE = "gsm8k-calc"
"""The rows' data_source (its reward: `asyncrl.rewards.registry.BUILTIN_REWARDS["gsm8k-calc"]`)."""
GSM8K_CALC_PROMPT = "Compute {expression}."
"""The user prompt of each row."""
MAX_EXPRESSION_CHARS = 64
"""Longest expression parsed (characters)."""
MAX_LITERAL_DIGITS = 15
"""Most digits in one number of an expression or a stated value."""
MAX_DECIMALS = 6
"""Most decimal places of a kept value."""
DROP_REASONS = ("malformed", "too_long", "stated_value", "unsupported", "zero_division", "no_operator", "inexact",
                "mismatch", "max_operators", "max_digits", "duplicate", "excluded")
"""Why an annotation is dropped, in the order they are checked (the module docstring says what each means)."""

_ANNOTATION = re.compile(r"<<([^<>]*)>>")
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_LITERAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ALLOWED = "numbers in ASCII digits, + - * /, a leading - and parentheses"


@dataclasses.dataclass(frozen=True)
class CalcExpression:
    """A parsed expression: its exact value, its number of binary operators and the digits of its longest number
    (leading zeros aside: 0.25 has 2, 12.5 has 3)."""

    value: Fraction
    operators: int
    digits: int


class CalcRefused(ValueError):
    """An expression `parse_calc` will not compute; `reason` is "too_long", "unsupported" or "zero_division"."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class CalcConversion:
    """What `convert_gsm8k_calc` read and wrote: source rows, annotations found, rows written, drops by reason
    (every reason of DROP_REASONS, in that order, zeros included)."""

    rows: int
    annotations: int
    written: int
    drops: dict[str, int]


def _short(text: str, limit: int = 40) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit - 3]) + "..."


class _Walk:
    """One walk over a parsed tree: the value, counting operators and the longest number on the way."""

    def __init__(self, source: str):
        self.source, self.operators, self.digits = source, 0, 0

    def value(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant):
            return self.number(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self.value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self.value(node.left), self.value(node.right)
            self.operators += 1
            if isinstance(node.op, ast.Div) and right == 0:
                raise CalcRefused("zero_division", f"{_short(self.source)} divides by zero")
            return _BINARY[type(node.op)](left, right)
        kind = type(node.op if isinstance(node, (ast.BinOp, ast.UnaryOp)) else node).__name__  # Pow, Name, Call
        shown = ast.get_source_segment(self.source, node) or ""
        raise CalcRefused("unsupported", f"{_short(self.source)}: {_short(shown, 20)} ({kind}) is not allowed; an "
                          f"expression may hold {_ALLOWED}")

    def number(self, node: ast.Constant) -> Fraction:
        literal = ast.get_source_segment(self.source, node) or ""
        if not _LITERAL.fullmatch(literal):  # 1e3, 0x10, 1_000, 1j, a string
            raise CalcRefused("unsupported", f"{_short(self.source)}: {_short(literal, 20)} is not a number written "
                              f"in ASCII digits with an optional decimal point; an expression may hold {_ALLOWED}")
        digits = len(literal.replace(".", "").lstrip("0")) or 1
        if digits > MAX_LITERAL_DIGITS:
            raise CalcRefused("unsupported", f"{_short(self.source)}: a number has {digits} digits, more than "
                              f"{MAX_LITERAL_DIGITS}")
        self.digits = max(self.digits, digits)
        return Fraction(literal)


def parse_calc(expression: str) -> CalcExpression:
    """The exact value of an arithmetic expression of a calculator annotation, without evaluating it as Python
    (`ast.parse` walked through a whitelist, computed with `Fraction`; the module docstring gives the bounds).

    Raises:
      CalcRefused (a ValueError): "too_long" (more than MAX_EXPRESSION_CHARS characters), "unsupported" (not
        Python syntax, or anything but numbers, + - * /, a unary minus and parentheses; a number of more than
        MAX_LITERAL_DIGITS digits) or "zero_division"; the message says what and why.
    """
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcRefused("too_long", f"{_short(text)} has {len(text)} characters, more than {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as err:  # ValueError: a NUL character
        raise CalcRefused("unsupported", f"{_short(text)} is not an arithmetic expression ({err.__class__.__name__})"
                          ) from None
    walk = _Walk(text)
    value = walk.value(tree.body)
    return CalcExpression(value=value, operators=walk.operators, digits=walk.digits)


def decimal_text(value: Fraction, max_decimals: int = MAX_DECIMALS) -> str | None:
    """`value` as a canonical decimal ("24", "0.2", "-10", "0.0625": no trailing zeros, no lone point, no "-0"),
    or None when it has no decimal form of at most `max_decimals` places (1/3, 1/1024 with 6)."""
    for places in range(max_decimals + 1):
        scaled = value * 10 ** places
        if scaled.denominator == 1:
            break
    else:
        return None
    whole, fraction = divmod(abs(scaled.numerator), 10 ** places)
    return ("-" if value < 0 else "") + str(whole) + (f".{fraction:0{places}d}" if places else "")


def _check_knobs(max_operators: int, max_digits: int) -> None:
    if max_operators < 1:
        raise ValueError(f"max_operators={max_operators} must be >= 1 (--max-operators): every prompt computes at "
                         "least one operation")
    if max_digits < 1:
        raise ValueError(f"max_digits={max_digits} must be >= 1 (--max-digits)")


def _annotation_row(annotation: str, *, max_operators: int, max_digits: int) -> tuple[str, str, CalcExpression] | str:
    """(expression as written without spaces, ground truth, parse) of one annotation's inside, or its drop reason."""
    if annotation.count("=") != 1:
        return "malformed"
    expression, stated = (part.strip() for part in annotation.split("="))
    if len(expression) > MAX_EXPRESSION_CHARS:
        return "too_long"
    if not _DECIMAL.fullmatch(stated) or len(stated.replace(".", "").lstrip("-0")) > MAX_LITERAL_DIGITS:
        return "stated_value"
    try:
        parsed = parse_calc(expression)
    except CalcRefused as refused:
        return refused.reason
    if parsed.operators == 0:
        return "no_operator"
    truth = decimal_text(parsed.value)
    if truth is None:
        return "inexact"
    if parsed.value != Fraction(stated):
        return "mismatch"
    if parsed.operators > max_operators:
        return "max_operators"
    if parsed.digits > max_digits:
        return "max_digits"
    return "".join(expression.split()), truth, parsed


def calc_expressions(solutions: Iterable[str]) -> frozenset[str]:
    """Every calculator annotation's expression in the solutions, as written without spaces, whatever its value
    or knobs: what `exclude` takes."""
    return frozenset("".join(annotation.split("=")[0].split()) for solution in solutions
                     for annotation in _ANNOTATION.findall(solution))


def gsm8k_calc_rows(solutions: Iterable[str], *, max_operators: int = 2, max_digits: int = 4,
                    dedupe: bool = True, exclude: frozenset[str] = frozenset()) -> tuple[list[dict], dict[str, int]]:
    """verl rows, one per kept calculator annotation of the GSM8K solutions (`answer` fields) given, in order;
    and the drops by reason (every reason of DROP_REASONS, zeros included). `exclude`: expressions (written
    without spaces, `calc_expressions`) dropped as "excluded".

    Each row: prompt [{"role": "user", "content": "Compute 48/2."}], data_source "gsm8k-calc", ability "math",
    reward_model {"style": "rule", "ground_truth": "24"}, extra_info {"index": the solution's position,
    "annotation": the annotation's position in it (dropped ones counted), "operators", "digits"}.
    """
    _check_knobs(max_operators, max_digits)
    rows, drops, seen = [], dict.fromkeys(DROP_REASONS, 0), set()
    for index, solution in enumerate(solutions):
        for position, annotation in enumerate(_ANNOTATION.findall(solution)):
            kept = _annotation_row(annotation, max_operators=max_operators, max_digits=max_digits)
            if isinstance(kept, str):
                drops[kept] += 1
                continue
            expression, truth, parsed = kept
            if dedupe and expression in seen:
                drops["duplicate"] += 1
                continue
            if expression in exclude:
                drops["excluded"] += 1
                continue
            seen.add(expression)
            rows.append({
                "data_source": GSM8K_CALC_SOURCE,
                "prompt": [{"role": "user", "content": GSM8K_CALC_PROMPT.format(expression=expression)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"index": index, "annotation": position, "operators": parsed.operators,
                               "digits": parsed.digits},
            })
    return rows, drops


def convert_gsm8k_calc(src: str | os.PathLike, out_path: str | os.PathLike, *, max_operators: int = 2,
                       max_digits: int = 4, dedupe: bool = True,
                       exclude: str | os.PathLike | None = None) -> CalcConversion:
    """Convert the calculator annotations of a GSM8K .jsonl or .parquet file (`question`, `answer` with
    `<<expr=value>>` steps) to verl rows (`gsm8k_calc_rows`), written as `.parquet` or `.jsonl` by the output's
    suffix; returns the counts (`CalcConversion`). `exclude`: another GSM8K file whose annotations' expressions
    are left out (the training split, when writing a held-out evaluation file).

    Raises:
      ValueError: a bad output suffix or knob, a source row that is not GSM8K's (`path:LINE`), or no annotation
        kept (the drops are listed, with the knobs to loosen).
    """
    out = pathlib.Path(out_path)
    if out.suffix not in SUFFIXES:
        raise ValueError(f"{out}: the output must end in .jsonl or .parquet")
    _check_knobs(max_operators, max_digits)
    solutions = [row["answer"] for _, row in read_gsm8k(src)]
    excluded = calc_expressions(row["answer"] for _, row in read_gsm8k(exclude)) if exclude is not None else frozenset()
    rows, drops = gsm8k_calc_rows(solutions, max_operators=max_operators, max_digits=max_digits, dedupe=dedupe,
                                  exclude=excluded)
    annotations = len(rows) + sum(drops.values())
    if not rows:
        raise ValueError(f"{src}: no calculator annotation kept of {annotations} ({format_drops(drops) or 'none'}); "
                         "is this GSM8K's file with its <<expr=value>> steps? Else raise --max-operators or "
                         "--max-digits")
    write_rows(rows, out)
    return CalcConversion(rows=len(solutions), annotations=annotations, written=len(rows), drops=drops)


def format_drops(drops: Mapping[str, int]) -> str:
    """'mismatch 3, duplicate 10' : the nonzero counts, in DROP_REASONS order."""
    return ", ".join(f"{reason} {count}" for reason, count in drops.items() if count)
