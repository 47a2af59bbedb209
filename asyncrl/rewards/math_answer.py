"""Final-answer matching for math problems (MATH, DAPO-Math, AIME style).

The model's answer is the content of its last `\\boxed{...}` (or `\\fbox{...}`). Both sides are normalised
(strip TeX spacing, `\\left`/`\\right`, dollars, `\\text{}` wrappers, degree and percent signs, thousands
separators, trailing dots; unify `\\dfrac`/`\\tfrac` and brace-less `\\frac12`, `\\sqrt2`), then compared as
strings, and, when both parse as numbers or simple fractions, numerically (relative tolerance 1e-6).
This is rule-based matching, not a computer-algebra check: "x+1" and "1+x" differ.

Model output is read with bounded work: digits are ASCII only ('٣' is not 3), every regular expression runs in
linear time, and a number is compared numerically only when it is short (at most MAX_NUMBER_CHARS characters,
a decimal exponent of at most MAX_EXPONENT): `\\boxed{1e100000000}` is compared as a string, never built.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["extract_boxed", "normalize_answer", "answers_match", "math_reward", "MAX_NUMBER_CHARS", "MAX_EXPONENT"]

MAX_NUMBER_CHARS = 400
"""Longest normalised answer that is parsed as a number (longer ones are compared as strings only)."""
MAX_EXPONENT = 1000
"""Largest decimal exponent parsed ("1e1000"); a larger one is compared as a string only."""

_BOX_OPENING = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOX_BARE = re.compile(r"\\boxed\s+([^\s$]+)")
_BRACE = re.compile(r"[{}]")
_DECIMAL = re.compile(r"(-?)([0-9]*)(?:\.([0-9]*))?(?:e(-?[0-9]+))?")  # unambiguous: linear even when it fails
_FRAC = re.compile(r"(-?)\\frac\{(-?[0-9]+)\}\{(-?[0-9]+)\}")
_SLASH = re.compile(r"(-?[0-9]+)/([0-9]+)")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces allowed), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    opening = _BOX_OPENING.match(rest)  # the brace must open the box, not come later
    if opening is None:
        match = _BOX_BARE.match(rest)  # "\boxed 5"
        return match.group(1) if match else None
    depth = 0
    for brace in _BRACE.finditer(rest, opening.end() - 1):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return rest[opening.end():brace.start()]
    return None  # unbalanced braces: the model was cut off


_DROP = ["\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\$", "$", "\\%", "%", "^\\circ", "^{\\circ}",
         "\\displaystyle"]  # "\\$" before "$", else "\\$5" -> "\\5"


def _unwrap(command: str, s: str) -> str:
    return re.sub(r"\\" + command + r"\{([^{}]*)\}", r"\1", s)


def normalize_answer(answer: str) -> str:
    """A canonical string for a final answer (see the module docstring for the rules)."""
    s = answer.strip()
    if "=" in s and not any(op in s for op in ("<", ">", "\\le", "\\ge")):
        s = s.split("=")[-1]  # "x = 5" -> "5"
    for command in ("text", "textbf", "mbox", "mathrm"):
        s = _unwrap(command, s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac([0-9])([0-9])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}([0-9])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt([0-9]+)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    if re.fullmatch(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?", s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    if s.endswith("0") and re.fullmatch(r"-?[0-9]+\.[0-9]*", s):  # "5.50" -> "5.5", "5.0" -> "5"
        s = s.rstrip("0").rstrip(".")
    return s


def _decimal(s: str) -> Fraction | None:
    """A decimal such as "-1.5", ".5", "2e-3" as an exact Fraction, or None (not one, or over the caps)."""
    match = _DECIMAL.fullmatch(s)
    if match is None or not (match.group(2) or match.group(3)):
        return None
    if match.group(4) is not None and abs(int(match.group(4))) > MAX_EXPONENT:  # int() of < MAX_NUMBER_CHARS digits
        return None
    return Fraction(s)  # within the caps: at most 10 ** (MAX_EXPONENT + MAX_NUMBER_CHARS), built exactly


def _as_number(s: str) -> Fraction | None:
    """The normalised answer as an exact number (a decimal, \\frac{a}{b} or a/b), or None."""
    if len(s) > MAX_NUMBER_CHARS:
        return None
    frac, slash = _FRAC.fullmatch(s), _SLASH.fullmatch(s)
    try:
        if frac:
            value = Fraction(int(frac.group(2)), int(frac.group(3)))
            return -value if frac.group(1) else value
        if slash:
            return Fraction(int(slash.group(1)), int(slash.group(2)))
        return _decimal(s)
    except (ZeroDivisionError, ValueError):
        return None


def answers_match(prediction: str, ground_truth: str, *, rel_tol: float = 1e-6) -> bool:
    """True if the two answers are equal after normalisation, as strings or as numbers (exact rationals, so a
    300-digit answer is compared without float overflow)."""
    pred, truth = normalize_answer(prediction), normalize_answer(ground_truth)
    if pred == truth:
        return True
    a, b = _as_number(pred), _as_number(truth)
    if a is None or b is None:
        return False
    return abs(a - b) <= Fraction(rel_tol) * max(Fraction(1), abs(b))


def math_reward(response: str, ground_truth: str, *, score: float = 1.0) -> float:
    """`score` if the last boxed answer in `response` matches `ground_truth`, else 0 (no box: 0)."""
    boxed = extract_boxed(response)
    return score if boxed is not None and answers_match(boxed, ground_truth) else 0.0
