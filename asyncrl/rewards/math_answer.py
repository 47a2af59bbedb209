"""Final-answer matching for math problems (MATH, DAPO-Math, AIME style).

The model's answer is the content of its last `\\boxed{...}` (or `\\fbox{...}`). Both sides are normalised
(strip TeX spacing, `\\left`/`\\right`, dollars, `\\text{}` wrappers, degree and percent signs, thousands
separators, trailing dots; unify `\\dfrac`/`\\tfrac` and brace-less `\\frac12`, `\\sqrt2`), then compared as
strings, and, when both parse as numbers or simple fractions, numerically (relative tolerance 1e-6).
This is rule-based matching, not a computer-algebra check: "x+1" and "1+x" differ.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["extract_boxed", "normalize_answer", "answers_match", "math_reward"]


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (nested braces allowed), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    opening = re.match(r"\\(?:boxed|fbox)\s*\{", rest)  # the brace must open the box, not come later
    brace = opening.end() - 1 if opening else -1
    if brace < 0:
        match = re.match(r"\\boxed\s+([^\s$]+)", rest)  # "\boxed 5"
        return match.group(1) if match else None
    depth = 0
    for i in range(brace, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[brace + 1:i]
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
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d+\.\d*?0+", s):  # "5.50" -> "5.5", "5.0" -> "5"
        s = s.rstrip("0").rstrip(".")
    return s


def _as_number(s: str) -> Fraction | None:
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if frac:
            value = Fraction(int(frac.group(2)), int(frac.group(3)))
            return -value if frac.group(1) else value
        if re.fullmatch(r"-?\d+/\d+", s):
            num, den = s.split("/")
            return Fraction(int(num), int(den))
        if re.fullmatch(r"-?(\d+\.?\d*|\.\d+)(e-?\d+)?", s):
            return Fraction(s)
    except (ZeroDivisionError, ValueError):
        return None
    return None


def answers_match(prediction: str, ground_truth: str, *, rel_tol: float = 1e-6) -> bool:
    """True if the two answers are equal after normalisation, as strings or as numbers."""
    pred, truth = normalize_answer(prediction), normalize_answer(ground_truth)
    if pred == truth:
        return True
    a, b = _as_number(pred), _as_number(truth)
    if a is None or b is None:
        return False
    return abs(float(a) - float(b)) <= rel_tol * max(1.0, abs(float(b)))


def math_reward(response: str, ground_truth: str, *, score: float = 1.0) -> float:
    """`score` if the last boxed answer in `response` matches `ground_truth`, else 0 (no box: 0)."""
    boxed = extract_boxed(response)
    return score if boxed is not None and answers_match(boxed, ground_truth) else 0.0
