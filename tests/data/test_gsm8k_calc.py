"""GSM8K-calc: the calculator annotations of GSM8K's solutions as prompts. Golden rows from the first solutions of
both splits, the parser's refusals (nothing is evaluated), the drops by reason, the difficulty knobs, dedupe, a
property against Fraction arithmetic, and `asyncrl data convert-gsm8k-calc` in process, read back through
`load_prompt_file` with SmolLM2's tokenizer."""

from __future__ import annotations

import builtins
import json
import time
from fractions import Fraction

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from asyncrl.data.files import load_prompt_file, read_jsonl, read_parquet
from asyncrl.data.gsm8k_calc import (DROP_REASONS, MAX_EXPRESSION_CHARS, CalcRefused, calc_expressions,
                                     convert_gsm8k_calc,
                                     decimal_text, gsm8k_calc_rows, parse_calc)
from asyncrl.data.scoring import Scorer
from asyncrl.data.tasks import render_chat
from asyncrl.launch.data_command import data_main
from asyncrl.rewards.registry import BUILTIN_REWARDS
from asyncrl.types import Completion

# the first three solutions of GSM8K's train split, as the file has them
TRAIN_SOLUTIONS = [
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in "
    "April and May.\n#### 72",
    "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
    "$<<0.2*50=10>>10.\n#### 10",
    "In the beginning, Betty has only 100 / 2 = $<<100/2=50>>50.\nBetty's grandparents gave her 15 * 2 = "
    "$<<15*2=30>>30.\nThis means, Betty needs 100 - 50 - 30 - 15 = $<<100-50-30-15=5>>5 more.\n#### 5",
]
TEST_SPLIT_WRITTEN = 2621  # rows of the vendored test split with the default knobs (measured)
TEST_SPLIT_DROPS = {"stated_value": 1, "unsupported": 5, "no_operator": 71, "max_operators": 72, "max_digits": 107,
                    "duplicate": 1405}


def _drops(**counts) -> dict[str, int]:
    return {reason: counts.get(reason, 0) for reason in DROP_REASONS}


def _calc_rows(*annotations: str, **knobs):
    """The rows and drops of one solution holding `annotations` as <<...>> steps."""
    return gsm8k_calc_rows([" ".join(f"<<{a}>>" for a in annotations) + "\n#### 0"], **knobs)


def _summary(row: dict) -> tuple[str, str, int, int]:
    return (row["prompt"][0]["content"], row["reward_model"]["ground_truth"], row["extra_info"]["index"],
            row["extra_info"]["annotation"])


def _write_gsm8k(path, solutions) -> str:
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(solutions)))
    return str(path)


# --------------------------------------------------------------------------------------------------------------
# golden rows
# --------------------------------------------------------------------------------------------------------------


def test_the_first_train_solutions_give_these_rows():
    rows, drops = gsm8k_calc_rows(TRAIN_SOLUTIONS)
    assert [_summary(r) for r in rows] == [
        ("Compute 48/2.", "24", 0, 0), ("Compute 48+24.", "72", 0, 1),
        ("Compute 12/60.", "0.2", 1, 0),  # 1/5 exactly: the canonical decimal "0.2"
        ("Compute 0.2*50.", "10", 1, 1),  # exact, not 10.000000000000002
        ("Compute 100/2.", "50", 2, 0), ("Compute 15*2.", "30", 2, 1)]
    # 100-50-30-15 has 3 operators, one more than the default --max-operators 2
    assert drops == _drops(max_operators=1)
    assert rows[0] == {"data_source": "gsm8k-calc", "prompt": [{"role": "user", "content": "Compute 48/2."}],
                       "ability": "math", "reward_model": {"style": "rule", "ground_truth": "24"},
                       "extra_info": {"index": 0, "annotation": 0, "operators": 1, "digits": 2}}
    rows, drops = gsm8k_calc_rows(TRAIN_SOLUTIONS, max_operators=3)
    assert _summary(rows[-1]) == ("Compute 100-50-30-15.", "5", 2, 2) and drops == _drops()


def test_the_vendored_test_split_converts_with_the_measured_counts(gsm8k_test_file, tmp_path):
    stats = convert_gsm8k_calc(gsm8k_test_file, tmp_path / "calc.jsonl")
    assert (stats.rows, stats.written) == (1319, TEST_SPLIT_WRITTEN)
    assert stats.drops == _drops(**TEST_SPLIT_DROPS)
    assert stats.annotations == stats.written + sum(stats.drops.values()) == 4282
    rows = read_jsonl(tmp_path / "calc.jsonl")
    # Janet's ducks: 16 - 3 - 4 = <<16-3-4=9>>9, 9 * 2 = $<<9*2=18>>18
    assert [_summary(r) for r in rows[:3]] == [("Compute 16-3-4.", "9", 0, 0), ("Compute 9*2.", "18", 0, 1),
                                               ("Compute 2/2.", "1", 1, 0)]
    prompts = [r["prompt"][0]["content"] for r in rows]
    assert len(set(prompts)) == len(prompts)  # deduped
    assert [(r["extra_info"]["index"], r["extra_info"]["annotation"]) for r in rows] == \
        sorted((r["extra_info"]["index"], r["extra_info"]["annotation"]) for r in rows)  # the source's order
    # the same source gives the same file, byte for byte; Parquet holds the same rows
    convert_gsm8k_calc(gsm8k_test_file, tmp_path / "again.jsonl")
    assert (tmp_path / "again.jsonl").read_bytes() == (tmp_path / "calc.jsonl").read_bytes()
    convert_gsm8k_calc(gsm8k_test_file, tmp_path / "calc.parquet")
    assert read_parquet(tmp_path / "calc.parquet") == rows


@pytest.mark.parametrize("value, text", [
    (Fraction(24), "24"), (Fraction(1, 5), "0.2"), (Fraction(-10), "-10"), (Fraction(1, 16), "0.0625"),
    (Fraction(0), "0"), (Fraction(-1, 2), "-0.5"), (Fraction(123456789, 1000), "123456.789"),
    (Fraction(1, 3), None),  # 0.333...: no decimal form
    (Fraction(1, 1024), None),  # 0.0009765625: 10 places, more than MAX_DECIMALS (6)
])
def test_decimal_text(value, text):
    assert decimal_text(value) == text


# --------------------------------------------------------------------------------------------------------------
# the parser: a whitelist, nothing evaluated
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value, operators, digits", [
    ("48/2", 24, 1, 2),
    ("0.2*50", 10, 1, 2),  # 0.2 has 1 digit leading zeros aside, 50 has 2
    ("0.1+0.2", Fraction(3, 10), 1, 1),  # exactly 0.3
    ("2+3*4", 14, 2, 1), ("(2+3)*4", 20, 2, 1), ("20-5-3", 12, 2, 2), ("100/10/2", 5, 2, 3),  # precedence, left first
    ("-20+10", -10, 1, 2), ("71+-3", 68, 1, 2), ("-(2+3)", -5, 1, 1),  # a unary minus is no operator
    (".25*4", 1, 1, 2), ("5.*2", 10, 1, 1), (" 2 * 3 ", 6, 1, 1),
])
def test_parse_calc_golden(expression, value, operators, digits):
    parsed = parse_calc(expression)
    assert (parsed.value, parsed.operators, parsed.digits) == (value, operators, digits)
    assert isinstance(parsed.value, Fraction)


UNSAFE = {
    "name": "x+1",
    "call": "__import__('os').system('echo hi')",
    "attribute": "(1).__class__",
    "power": "2**3",
    "power-tower": "9**9**9**9",  # evaluated, it would not end
    "floor-division": "560//10",
    "modulo": "10%3",
    "unary-plus": "+10",
    "exponent-literal": "1e100000",
    "hex": "0x10",
    "underscores": "1_000",
    "complex": "2j+1",
    "string": "'12'*3",
    "tuple": "1,000+1",
    "lambda": "(lambda: 1)()",
    "subscript": "[1][0]",
    "comparison": "1<2",
    "huge-number": "9" * 16 + "+1",  # more than MAX_LITERAL_DIGITS digits
    "arabic-indic": "\u0664\u0662+1",
    "dollar": "$5*2",
    "percent": "50%*2",
    "nul": "1\x00+1",
}


@pytest.mark.parametrize("expression", UNSAFE.values(), ids=UNSAFE.keys())
def test_parse_calc_refuses_without_evaluating(expression, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("evaluated")
    monkeypatch.setattr(builtins, "eval", never)
    monkeypatch.setattr(builtins, "exec", never)
    start = time.perf_counter()
    with pytest.raises(CalcRefused, match="is not allowed|is not a number|is not an arithmetic|more than 15") as err:
        parse_calc(expression)
    assert err.value.reason == "unsupported" and isinstance(err.value, ValueError)
    assert time.perf_counter() - start < 0.1


def test_parse_calc_names_what_it_refuses():
    with pytest.raises(CalcRefused, match=r"'2\*\*3' \(Pow\) is not allowed; an expression may hold numbers"):
        parse_calc("2**3")
    with pytest.raises(CalcRefused, match=r"\(Call\) is not allowed"):
        parse_calc("abs(-3)")
    with pytest.raises(CalcRefused, match="divides by zero") as err:
        parse_calc("5/(2-2)")
    assert err.value.reason == "zero_division"
    with pytest.raises(CalcRefused, match=f"has 65 characters, more than {MAX_EXPRESSION_CHARS}") as err:
        parse_calc("1+" * 32 + "1")
    assert err.value.reason == "too_long"
    assert parse_calc("1+" * 31 + "11").value == 42  # 64 characters: parsed


# --------------------------------------------------------------------------------------------------------------
# drops, knobs, dedupe
# --------------------------------------------------------------------------------------------------------------


def test_annotations_that_do_not_hold_are_dropped_and_counted():
    rows, drops = _calc_rows(
        "2+2=5",  # mismatch: a wrong annotation
        "10/3=3.33",  # inexact: rounded; 10/3 has no decimal form
        "1/1024=0.0009765625",  # inexact: right, but 10 decimal places
        "3/4=3/4", "2*5=$10", "1000+1=1,001",  # stated_value: not a plain decimal
        "$5*2=10", "50%*2=1", "2**3=8",  # unsupported
        "1/0=0",  # zero_division
        "7=7", "-7=-7",  # no_operator
        "1+1", "1+1=2=2",  # malformed
        "1+" * 32 + "1=33",  # too_long
        "0.1+0.2=0.3",  # kept: exact arithmetic
        "6/4=1.50",  # kept: 1.50 is 1.5
    )
    assert [_summary(r)[:2] for r in rows] == [("Compute 0.1+0.2.", "0.3"), ("Compute 6/4.", "1.5")]
    assert drops == _drops(mismatch=1, inexact=2, stated_value=3, unsupported=3, zero_division=1, no_operator=2,
                           malformed=2, too_long=1)
    assert [r["extra_info"]["annotation"] for r in rows] == [15, 16]  # positions count the dropped ones


def test_the_knobs_filter_by_operators_and_digits():
    annotations = ("1+2+3+4=10", "12345*2=24690", "1+2=3", "0.0625*16=1")
    rows, drops = _calc_rows(*annotations)  # defaults: 2 operators, 4 digits
    assert [_summary(r)[0] for r in rows] == ["Compute 1+2.", "Compute 0.0625*16."]  # 0.0625 has 3 digits
    assert drops == _drops(max_operators=1, max_digits=1)
    rows, drops = _calc_rows(*annotations, max_operators=3, max_digits=5)
    assert len(rows) == 4 and drops == _drops()
    rows, drops = _calc_rows(*annotations, max_operators=1, max_digits=1)
    assert [_summary(r)[0] for r in rows] == ["Compute 1+2."]
    assert drops == _drops(max_operators=1, max_digits=2)  # 1+2+3+4 counts under max_operators, checked first
    with pytest.raises(ValueError, match=r"max_operators=0 must be >= 1 \(--max-operators\)"):
        _calc_rows("1+1=2", max_operators=0)
    with pytest.raises(ValueError, match=r"max_digits=0 must be >= 1 \(--max-digits\)"):
        _calc_rows("1+1=2", max_digits=0)


@pytest.mark.parametrize("max_operators, max_digits", [(1, 1), (1, 3), (2, 2), (3, 6)])
def test_the_knobs_bound_every_row_of_the_test_split(gsm8k_test_file, max_operators, max_digits):
    solutions = [row["answer"] for row in read_jsonl(gsm8k_test_file)]
    rows, _ = gsm8k_calc_rows(solutions, max_operators=max_operators, max_digits=max_digits)
    assert rows and all(1 <= r["extra_info"]["operators"] <= max_operators for r in rows)
    assert all(r["extra_info"]["digits"] <= max_digits for r in rows)
    assert any(r["extra_info"]["operators"] == max_operators for r in rows)
    assert any(r["extra_info"]["digits"] == max_digits for r in rows)


def test_dedupe_keeps_the_first_of_expressions_written_the_same_way():
    solutions = ["<<2*3=6>> <<4+4=8>>", "<<2 * 3=6>> <<3*2=6>>"]  # 2 * 3 is 2*3 with spaces; 3*2 is another
    rows, drops = gsm8k_calc_rows(solutions)
    assert [_summary(r) for r in rows] == [("Compute 2*3.", "6", 0, 0), ("Compute 4+4.", "8", 0, 1),
                                           ("Compute 3*2.", "6", 1, 1)]
    assert drops == _drops(duplicate=1)
    rows, drops = gsm8k_calc_rows(solutions, dedupe=False)
    assert [_summary(r)[0] for r in rows] == ["Compute 2*3.", "Compute 4+4.", "Compute 2*3.", "Compute 3*2."]
    assert drops == _drops()



def test_exclude_leaves_out_another_splits_expressions_whatever_their_knobs(tmp_path):
    solutions = ["<<2*3=6>> <<4+4=8>>", "<<10/4=2.5>> <<7-1=6>>"]
    held = calc_expressions(["x <<4 + 4=8>> y <<12345*2=24690>>", "<<7-1=5>>"])  # written with spaces, wrong, big
    assert held == {"4+4", "12345*2", "7-1"}
    rows, drops = gsm8k_calc_rows(solutions, exclude=held)
    assert [_summary(r)[0] for r in rows] == ["Compute 2*3.", "Compute 10/4."]
    assert drops == _drops(excluded=2)
    train = tmp_path / "train.jsonl"
    train.write_text('{"question": "q", "answer": "so <<16-3-4=9>>9 #### 9"}\n')
    stats = convert_gsm8k_calc(train, tmp_path / "self.jsonl", exclude=None)
    assert stats.written == 1
    with pytest.raises(ValueError, match="no calculator annotation kept.*excluded 1"):
        convert_gsm8k_calc(train, tmp_path / "none.jsonl", exclude=train)


# --------------------------------------------------------------------------------------------------------------
# property: the parser computes what Fraction arithmetic computes
# --------------------------------------------------------------------------------------------------------------

_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@st.composite
def _numbers(draw):
    """(text, value, digits): an integer or a decimal of up to 2 places, at most 4 digits."""
    places = draw(st.integers(0, 2))
    n = draw(st.integers(0, 9999))
    text = str(n) if places == 0 else f"{n // 10 ** places}.{n % 10 ** places:0{places}d}"
    return {"text": text, "value": Fraction(n, 10 ** places), "prec": 3, "ops": 0,
            "digits": len(text.replace(".", "").lstrip("0")) or 1}


def _apply(op: str, left: Fraction, right: Fraction) -> Fraction | None:
    if op == "/":
        return left / right if right != 0 else None  # a zero divisor anywhere: the expression is refused
    return {"+": left + right, "-": left - right, "*": left * right}[op]


def _combine(draw, children):
    """A unary minus or a binary operation over generated subexpressions, written with only the parentheses
    Python's precedence needs (and sometimes a redundant pair): the value comes from the tree, not a parser."""
    if draw(st.integers(0, 5)) == 0:
        child = draw(children)
        text = child["text"] if child["prec"] == 3 else f"({child['text']})"
        value = None if child["value"] is None else -child["value"]
        return {**child, "text": "-" + text, "value": value, "prec": 3}
    op = draw(st.sampled_from("+-*/"))
    left, right = draw(children), draw(children)
    wrap_left = left["prec"] < _PRECEDENCE[op]
    wrap_right = right["prec"] < _PRECEDENCE[op] or (right["prec"] == _PRECEDENCE[op] and op in "-/")
    lt = f"({left['text']})" if wrap_left or draw(st.integers(0, 7)) == 0 else left["text"]
    rt = f"({right['text']})" if wrap_right or draw(st.integers(0, 7)) == 0 else right["text"]
    value = None if None in (left["value"], right["value"]) else _apply(op, left["value"], right["value"])
    space = draw(st.sampled_from(["", " "]))
    return {"text": f"{lt}{space}{op}{space}{rt}", "value": value, "prec": _PRECEDENCE[op],
            "ops": left["ops"] + right["ops"] + 1, "digits": max(left["digits"], right["digits"])}


def _extend(children):
    @st.composite
    def combined(draw):
        return _combine(draw, children)
    return combined()


_expressions = st.recursive(_numbers(), _extend, max_leaves=6)


@given(_expressions)
def test_parse_calc_equals_fraction_arithmetic(expression):
    assume(len(expression["text"]) <= MAX_EXPRESSION_CHARS)
    if expression["value"] is None:
        with pytest.raises(CalcRefused, match="divides by zero"):
            parse_calc(expression["text"])
        return
    parsed = parse_calc(expression["text"])
    assert parsed.value == expression["value"], expression["text"]
    assert (parsed.operators, parsed.digits) == (expression["ops"], expression["digits"])


# --------------------------------------------------------------------------------------------------------------
# the command, in process, and the file it writes read back for training
# --------------------------------------------------------------------------------------------------------------


def test_the_command_writes_a_prompt_file_that_loads_and_scores(tmp_path, capsys, smollm2_tokenizer):
    src = _write_gsm8k(tmp_path / "gsm8k.jsonl", TRAIN_SOLUTIONS + ["<<48/2=24>> <<2+2=5>> <<2**3=8>>\n#### 8"])
    out = tmp_path / "calc" / "train.jsonl"
    data_main(["convert-gsm8k-calc", "--src", src, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "read 4 rows with 10 calculator annotations; dropped 4: unsupported 1, mismatch 1, max_operators 1, " \
        "duplicate 1" in printed
    assert f"wrote 6 rows to {out}" in printed

    prompts, stats = load_prompt_file(out, smollm2_tokenizer, max_prompt_length=64,
                                      system_prompt="Reply with the number only.")
    assert (stats["rows"], stats["kept"], stats["first_row_of_source"]) == (6, 6, {"gsm8k-calc": f"{out}:1"})
    assert [(p.text, p.ground_truth) for p in prompts[:3]] == [("Compute 48/2.", "24"), ("Compute 48+24.", "72"),
                                                              ("Compute 12/60.", "0.2")]
    assert prompts[2].extra_info == {"index": 1, "annotation": 0, "operators": 1, "digits": 2}
    assert prompts[0].prompt_ids == render_chat(smollm2_tokenizer, "Compute 48/2.",
                                                system="Reply with the number only.")
    text = smollm2_tokenizer.decode(prompts[0].prompt_ids)
    assert "<|im_start|>user\nCompute 48/2.<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    # the data source is scored by the built-in reward
    scorer = Scorer(BUILTIN_REWARDS, tokenizer=smollm2_tokenizer)
    assert scorer(prompts[2], Completion(smollm2_tokenizer.encode("12/60 = 0.20"), [], [])) == 1.0
    assert scorer(prompts[2], Completion(smollm2_tokenizer.encode("0.02"), [], [])) == 0.0

    data_main(["convert-gsm8k-calc", "--src", src, "--out", str(tmp_path / "all.parquet"), "--max-operators", "3",
               "--max-digits", "3", "--no-dedupe"])
    assert "wrote 8 rows to" in capsys.readouterr().out  # 100-50-30-15 and the second 48/2 come back
    data_main(["convert-gsm8k-calc", "--src", src, "--out", str(tmp_path / "short.parquet"), "--max-digits", "2"])
    assert "wrote 5 rows to" in capsys.readouterr().out  # 100/2 goes: 100 has 3 digits


def test_the_command_exits_with_the_flag_and_the_fix(tmp_path):
    src = _write_gsm8k(tmp_path / "gsm8k.jsonl", TRAIN_SOLUTIONS)
    with pytest.raises(SystemExit, match=r"asyncrl data: max_digits=0 must be >= 1 \(--max-digits\)"):
        data_main(["convert-gsm8k-calc", "--src", src, "--out", str(tmp_path / "x.jsonl"), "--max-digits", "0"])
    with pytest.raises(SystemExit, match=r"x\.csv: the output must end in \.jsonl or \.parquet"):
        data_main(["convert-gsm8k-calc", "--src", src, "--out", str(tmp_path / "x.csv")])
    none = _write_gsm8k(tmp_path / "plain.jsonl", ["She has 5 apples.\n#### 5"])
    with pytest.raises(SystemExit, match=r"plain\.jsonl: no calculator annotation kept of 0 \(none\); is this "
                                         r"GSM8K's file with its <<expr=value>> steps\? Else raise --max-operators"):
        data_main(["convert-gsm8k-calc", "--src", none, "--out", str(tmp_path / "x.jsonl")])
    (tmp_path / "other.jsonl").write_text(json.dumps({"problem": "q", "solution": "4"}) + "\n")
    with pytest.raises(SystemExit, match=r"other\.jsonl:1: field 'question' must be a string; is this a GSM8K"):
        data_main(["convert-gsm8k-calc", "--src", str(tmp_path / "other.jsonl"), "--out", str(tmp_path / "x.jsonl")])
    assert not (tmp_path / "x.jsonl").exists()
