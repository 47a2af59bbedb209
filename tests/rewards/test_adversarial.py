"""No model output can hang or exhaust a process (issue 31): every built-in reader of model text — the rewards,
the calculator tool, the tool-call parser, the built-in environments — is fed generated attacks (exponent
towers, huge literals, deep nesting, long inputs, unicode digits, random text) and must return, without an
exception, within `limit(1.0)` seconds (a bound on a hang, not a speed test: each call takes milliseconds).

Each call runs in a forked child (`tests.rewards.bounded_calls`): a call that really hangs is killed after
`limit(HANG_S)` and fails its test instead of freezing the suite.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncrl.envs.builtin import Calculator, RetryArithmetic
from asyncrl.envs.protocol import Turn
from asyncrl.envs.tools import calculator, parse_tool_calls
from asyncrl.rewards import (GSM8K_FORMAT, THINK_ANSWER_FORMAT, answers_match, arithmetic_reward, countdown_reward,
                             format_reward, gsm8k_calc_reward, gsm8k_reward, math_reward)
from asyncrl.rewards.bounded_arithmetic import MAX_CHARS
from asyncrl.types import Prompt
from tests.rewards.bounded_calls import bounded_worker  # noqa: F401 - the fixture
from tests.timing import limit

ADVERSARIAL = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                              HealthCheck.data_too_large])
PROMPT = Prompt([1, 2, 3], data_source="arithmetic", ground_truth="42", index=0)
MAX_RESPONSE_CHARS = 200_000
"""The longest generated attack: about 50,000 tokens, more than a response's token budget in practice. Every
reader is linear in the text's length (about 50 ms per 200,000 characters), so longer texts only take longer."""

# --------------------------------------------------------------------------------------------------------------
# the readers: each takes one model text; module-level so the child can receive them
# --------------------------------------------------------------------------------------------------------------


def read_calculator(text: str) -> str:
    try:
        return calculator(text)
    except ValueError as err:  # the one exception it may raise; ToolEnv.run answers it as an error message
        return f"error: {err}"


def read_calculator_call(text: str):
    call = json.dumps({"name": "calculator", "arguments": {"expression": text}})
    return Calculator(PROMPT).step(Turn(f"<tool_call>{call}</tool_call>", (), 0, "stop")).observation


def read_tool_turn(text: str):
    calls, errors = parse_tool_calls(text)  # the calls' arguments may nest deeply: only their names are returned
    return [call.name for call in calls], errors, Calculator(PROMPT).step(Turn(text, (), 0, "stop")).observation


def read_countdown(text: str) -> float:
    numbers = re.findall(r"[0-9]+", text) if len(text) <= MAX_CHARS else []  # the text's own numbers: it is evaluated
    return countdown_reward(text, f"42|{' '.join(numbers) or '1'}")


def read_arithmetic(text: str) -> float:
    return arithmetic_reward(text, "42")


def read_retry(text: str):
    return RetryArithmetic(PROMPT).step(Turn(text, (), 0, "stop")).observation


def read_math(text: str) -> tuple[float, float, bool]:
    boxed = "\\boxed{" + text + "}"
    return math_reward(text, "42"), math_reward(boxed, text + "1"), answers_match(text, text + "0")


def read_gsm8k(text: str) -> tuple[float, float]:
    return gsm8k_reward(text, "42"), gsm8k_reward(text, "42", method="flexible")


def read_gsm8k_calc(text: str) -> float:
    return gsm8k_calc_reward(text, "42")


def read_formats(text: str) -> tuple[float, float]:
    return format_reward(text, GSM8K_FORMAT), format_reward(text, THINK_ANSWER_FORMAT)


READERS = (read_calculator, read_calculator_call, read_tool_turn, read_countdown, read_arithmetic, read_retry,
           read_math, read_gsm8k, read_gsm8k_calc, read_formats)


def assert_bounded(worker, text: str) -> None:
    """Every reader returns on `text`, raises nothing and takes less than limit(1.0) s."""
    shown = repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"
    for reader in READERS:
        outcome = worker.call(reader, text)
        assert outcome.error is None, f"{reader.__name__}({shown}) raised {outcome.error}"
        assert outcome.seconds < limit(1.0), f"{reader.__name__}({shown}) took {outcome.seconds:.2f} s"


# --------------------------------------------------------------------------------------------------------------
# the attacks (generated from small parameters, so a failure prints the parameters, not 100,000 characters)
# --------------------------------------------------------------------------------------------------------------

KNOWN_ATTACKS = {
    "countdown-tower": "12**11**10",  # eval: 12 ** (11 ** 10), hours
    "calculator-left-tower": "(((9**64)**64)**64)**64",  # each exponent <= 64 passed the former check: hours
    "right-tower": "9**9**9**9",
    "product-of-powers": " * ".join(["10**64"] * 40),
    "big-mod-and-floordiv": "(9**300) % 7 + (10**300) // 3**200",
    "boxed-exponent": "\\boxed{1e100000000}",  # Fraction("1e100000000"): 10 ** 100000000, minutes and gigabytes
    "bare-exponent": "1e100000000",
    "past-int-digit-limit": "9" * 4301,  # int() raises ValueError past 4300 digits
    "float-overflow": "\\boxed{" + "9" * 4000 + "}",  # float() of it raised OverflowError in answers_match
    "json-big-number": '<tool_call>{"name": "calculator", "arguments": {"x": ' + "1" * 5000 + "}}</tool_call>",
    "json-deep": "<tool_call>" + "[" * 100_000 + "</tool_call>",  # RecursionError from json.loads
    "parentheses-deep": "(" * 100_000 + "1" + ")" * 100_000,
    "signs-deep": "-" * 100_000 + "1",  # MemoryError from ast.parse
    "r1-format-quadratic": "<think>" + "</think><answer></answer>x" * 3000,  # 1.7 s under the former pattern
    "decimal-regex-quadratic": "\\boxed{" + "1" * 20_000 + "x}",  # > 5 s under the former decimal regex
    "trailing-zero-regex-quadratic": "\\boxed{1." + "0" * 20_000 + "1}",  # 1.5 s under the former regex
}


@pytest.mark.e2e
@pytest.mark.parametrize("text", KNOWN_ATTACKS.values(), ids=KNOWN_ATTACKS.keys())
def test_known_attacks(bounded_worker, text):
    assert_bounded(bounded_worker, text)


@pytest.mark.e2e
@ADVERSARIAL
@given(st.lists(st.integers(2, 9999), min_size=2, max_size=6), st.sampled_from(["right", "left"]), st.booleans())
def test_exponent_towers(bounded_worker, numbers, shape, spaces):
    power = " ** " if spaces else "**"
    if shape == "right":  # a ** b ** c = a ** (b ** c)
        text = power.join(map(str, numbers))
    else:  # ((a ** b) ** c)
        text = "(" * (len(numbers) - 1) + str(numbers[0]) + "".join(f"{power}{n})" for n in numbers[1:])
    assert_bounded(bounded_worker, text)


@pytest.mark.e2e
@ADVERSARIAL
@given(st.integers(2, 99), st.integers(1, 999), st.integers(2, 60), st.sampled_from(["*", "%", "//", "+"]))
def test_chains_of_powers(bounded_worker, base, exponent, count, op):
    assert_bounded(bounded_worker, f" {op} ".join([f"{base}**{exponent}"] * count))


LITERALS = {
    "integer": lambda n: "9" * n,
    "exponent": lambda n: f"1e{10 ** min(n, 12)}",
    "decimal": lambda n: "1." + "0" * n + "1",
    "fraction": lambda n: "\\frac{" + "7" * n + "}{" + "3" * n + "}",
    "slash": lambda n: "7" * n + "/3",
    "negative-exponent": lambda n: "-" + "8" * n + ".5e-" + "9" * min(n, 50),
    "boxed": lambda n: "\\boxed{" + "5" * n + "}",
}


@pytest.mark.e2e
@ADVERSARIAL
@given(st.integers(300, 100_000), st.sampled_from(sorted(LITERALS)))
@example(100_000, "integer")
def test_huge_literals(bounded_worker, digits, kind):
    assert_bounded(bounded_worker, LITERALS[kind](digits))


def _sized(make, chars: int) -> str:
    """`make(n)` with n chosen so the text has about `chars` characters."""
    return make(max(1, chars // len(make(1))))


NESTINGS = {
    "parentheses": lambda n: "(" * n + "1" + ")" * n,
    "signs": lambda n: "-" * n + "1",
    "tower": lambda n: "2**" * n + "2",
    "json-array": lambda n: "<tool_call>" + "[" * n + "</tool_call>",
    "json-object": lambda n: '{"name": "calculator", "arguments": ' + '{"a": ' * n + "1" + "}" * n + "}",
    "braces": lambda n: "\\boxed{" + "{" * n + "1" + "}" * n + "}",
    "fractions": lambda n: "\\frac{" * n + "1" + "}{2}" * n,
}


@pytest.mark.e2e
@ADVERSARIAL
@given(st.integers(100, MAX_RESPONSE_CHARS), st.sampled_from(sorted(NESTINGS)))
@example(MAX_RESPONSE_CHARS, "parentheses")
def test_deep_nesting(bounded_worker, chars, kind):
    assert_bounded(bounded_worker, _sized(NESTINGS[kind], chars))


LONG = {
    "sum": lambda n: "1+" * n + "1",
    "spaces": lambda n: " " * n + "1",
    "commas": lambda n: "1," * n + "1",
    "answer-lines": lambda n: "#### " + "1 " * n,
    "think-answer-pairs": lambda n: "<think>" + "</think><answer></answer>x" * n,
    "open-tool-calls": lambda n: "<tool_call>" * n,
    "boxes": lambda n: "\\boxed{1}" * n + "\\boxed{",
    "trailing-zeros": lambda n: "\\boxed{1." + "0" * n + "1x}",
    "ones": lambda n: "\\boxed{" + "1" * n + "x}",
    "text-wrappers": lambda n: "\\text{" * n + "5",
    "lines": lambda n: "1\n" * n,
    "gsm8k-tail": lambda n: "#### 1" + " " * n + "x",
}


@pytest.mark.e2e
@ADVERSARIAL
@given(st.integers(1_000, MAX_RESPONSE_CHARS), st.sampled_from(sorted(LONG)))
def test_long_inputs(bounded_worker, chars, kind):
    assert_bounded(bounded_worker, _sized(LONG[kind], chars))


@pytest.mark.e2e
@ADVERSARIAL
@given(st.one_of(st.text(max_size=500),
                 st.text(alphabet="0123456789+-*/%().eE ^,{}\\boxedfrac#<>_/[]\"'", max_size=500),
                 st.lists(st.sampled_from(["**", "9", "(", ")", "-", "1e9", "\\boxed{", "}", "#### ", "<tool_call>",
                                           '{"name": "calculator"', "٣", "</think>", "<answer>"]),
                          max_size=200).map("".join)))
def test_random_text(bounded_worker, text):
    assert_bounded(bounded_worker, text)


# --------------------------------------------------------------------------------------------------------------
# unicode digits: ASCII 0-9 only, everywhere
# --------------------------------------------------------------------------------------------------------------

non_ascii_digits = st.characters(categories=["Nd"]).filter(lambda c: not "0" <= c <= "9")


@given(st.lists(non_ascii_digits, min_size=1, max_size=8).map("".join))
def test_non_ascii_digits_are_never_numbers(digits):
    value = int(digits)  # what Python's int() and \d would make of them
    assert arithmetic_reward(digits, str(value)) == 0.0
    assert math_reward("\\boxed{" + digits + "}", str(value)) == 0.0
    assert not answers_match(digits, str(value))
    assert gsm8k_reward("#### " + digits, str(value), method="flexible") == 0.0
    assert gsm8k_calc_reward(digits, str(value)) == 0.0
    assert countdown_reward(digits, f"{value}|{value}") == 0.0
    assert read_calculator(digits + " + 1").startswith("error: cannot evaluate")
    assert RetryArithmetic(Prompt([1], ground_truth=str(value))).step(Turn(digits, (), 0, "stop")).observation \
        == "No number. Try again."
    assert format_reward("#### " + digits) == 0.0


@pytest.mark.e2e
def test_the_hang_guard_fails_a_hanging_call():
    from tests.rewards.bounded_calls import BoundedWorker
    worker = BoundedWorker(hang_s=limit(1.0))
    try:
        assert worker.call(pow, 2, 10).value == 1024
        try:
            worker.call(pow, 9, 9 ** 9 * 100)  # minutes of C code holding the GIL
        except BaseException as failure:  # pytest.fail's exception
            assert "did not return within" in str(failure) and "it hangs" in str(failure)
        else:
            raise AssertionError("the hang guard let a hanging call through")
        assert worker.call(pow, 3, 3).value == 27  # a fresh child serves the next call
    finally:
        worker.close()
