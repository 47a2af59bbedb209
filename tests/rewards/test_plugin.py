"""Reward plug-ins (`--reward.fn`): loading files and modules, the two signatures, results, the error
messages, and which reward scores which data source."""

from __future__ import annotations

import math
import pathlib
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.rewards import gsm8k_reward
from asyncrl.rewards.plugin import (
    RewardResult, RewardTable, RewardValueError, load_reward, normalize_result, parse_reward_spec, wrap_reward,
)
from asyncrl.rewards.registry import BUILTIN_REWARDS
from asyncrl.types import Prompt

# verl's custom reward file shape (a `custom_reward_function.path`), with a sibling import and a
# dict result whose `pred` is a string.
VERL_FILE = """
    import re

    from verl_helpers import LAST_NUMBER


    def extract_solution(solution_str):
        found = LAST_NUMBER.findall(solution_str)
        return found[-1] if found else None


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        answer = extract_solution(solution_str)
        return {"score": float(answer == ground_truth), "acc": answer == ground_truth, "pred": answer or "",
                "split": (extra_info or {}).get("split", "?")}
"""


def _write(directory: pathlib.Path, name: str, source: str) -> pathlib.Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def _prompt(**kw) -> Prompt:
    defaults = dict(prompt_ids=[1], data_source="x", ground_truth="7", text="What is 3 + 4?", index=12,
                    extra_info={"split": "train"}, fields={"ability": "math"})
    return Prompt(**{**defaults, **kw})


# --- loading -------------------------------------------------------------------------------------------------------


def test_file_spec_relative_and_absolute_and_its_siblings_import(tmp_path, monkeypatch):
    _write(tmp_path, "helpers_for_reward.py", "BONUS = 0.5\n")
    path = _write(tmp_path, "my_reward.py", """
        from helpers_for_reward import BONUS

        def score(response, ground_truth):
            return float(response.strip() == ground_truth) + BONUS
    """)
    monkeypatch.chdir(tmp_path)
    relative = load_reward("my_reward.py:score")
    absolute = load_reward(f"{path}:score")
    for fn in (relative, absolute):
        assert (fn.name, fn.style, fn.is_async) == ("my_reward.py:score", "asyncrl", False)
        assert fn.call("7", _prompt()) == 1.5 and fn.call("8", _prompt()) == 0.5
    assert relative.spec == "my_reward.py:score" and absolute.spec == f"{path}:score"


def test_module_spec(tmp_path, monkeypatch):
    _write(tmp_path, "asyncrl_test_plugins/__init__.py", "")
    _write(tmp_path, "asyncrl_test_plugins/rewards.py", """
        def exact(response, ground_truth, **row):
            return float(response == ground_truth)
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("asyncrl_test_plugins.rewards:exact")
    assert (fn.name, fn.style) == ("asyncrl_test_plugins.rewards:exact", "asyncrl")
    assert fn.call("7", _prompt()) == 1.0
    # an installed module works the same way: the built-in GSM8K reward as a plug-in
    fn = load_reward("asyncrl.rewards.gsm8k:gsm8k_reward")
    assert fn.fn is gsm8k_reward and fn.call("#### 7", _prompt()) == 1.0


def test_a_verl_compute_score_file_works_unchanged(tmp_path):
    _write(tmp_path, "verl_helpers.py", "import re\nLAST_NUMBER = re.compile(r'-?\\d+')\n")
    path = _write(tmp_path, "verl_reward.py", VERL_FILE)
    fn = load_reward(f"{path}:compute_score")
    assert fn.style == "verl" and fn.name == "verl_reward.py:compute_score"
    raw = fn.call("3 + 4 = 7", _prompt())
    assert raw == {"score": 1.0, "acc": True, "pred": "7", "split": "train"}  # extra_info was passed
    assert normalize_result(raw, fn_name=fn.name, data_source="x", index=12) == RewardResult(1.0, {"acc": 1.0})


def test_verl_style_gets_extra_info_only_when_it_takes_it(tmp_path):
    seen = []

    def without(data_source, solution_str, ground_truth):
        seen.append((data_source, solution_str, ground_truth))
        return 1.0

    def with_kwargs(data_source, solution_str, ground_truth, **kwargs):
        seen.append(kwargs)
        return 1.0

    assert wrap_reward(without).call("r", _prompt()) == 1.0
    assert wrap_reward(with_kwargs).call("r", _prompt()) == 1.0
    assert seen == [("x", "r", "7"), {"extra_info": {"split": "train"}}]


def test_our_signature_gets_the_row_as_keywords(tmp_path):
    seen = {}

    def everything(response, ground_truth, **row):
        seen["all"] = row
        return 0.0

    def some(response, ground_truth, *, index, extra_info=None):
        seen["some"] = {"index": index, "extra_info": extra_info}
        return 0.0

    prompt = _prompt(fields={"ability": "math", "response": "a reference answer", "index": 99})
    wrap_reward(everything).call("r", prompt)
    wrap_reward(some).call("r", prompt)
    # the row's own fields come too; a field named like a positional parameter is not passed again, and the
    # four standard keywords win over top-level fields of the same name
    assert seen["all"] == {"ability": "math", "data_source": "x", "extra_info": {"split": "train"},
                           "prompt": "What is 3 + 4?", "index": 12}
    assert seen["some"] == {"index": 12, "extra_info": {"split": "train"}}


def test_async_functions_are_detected(tmp_path):
    path = _write(tmp_path, "judge.py", """
        async def judge(response, ground_truth, **row):
            return 1.0

        class Judge:
            async def __call__(self, response, ground_truth):
                return 1.0

        JUDGE = Judge()
    """)
    assert load_reward(f"{path}:judge").is_async
    assert load_reward(f"{path}:JUDGE").is_async
    assert not wrap_reward(lambda response, ground_truth: 1.0).is_async


# --- load errors: one message naming the flag, the spec, the problem and the fix -------------------------------------


LOAD_ERRORS = [
    ("ok.py", None, ["no ':NAME' part", "PATH.py:NAME or package.module:NAME"]),
    ("missing.py:score", None, ["missing.py does not exist", "relative to the current directory"]),
    ("boom.py:score", "x = 1\n\n1 / 0\n", ["raised ZeroDivisionError: division by zero", "boom.py:3)"]),
    ("syntax.py:score", "def score(:\n", ["raised SyntaxError: invalid syntax", "syntax.py:1)"]),
    ("needs.py:score", "import asyncrl_no_such_dependency\n",
     ["raised ModuleNotFoundError", "asyncrl_no_such_dependency", "needs.py:1)", "install"]),
    ("asyncrl_no_such_module.rewards:score", None, ["no module named 'asyncrl_no_such_module.rewards'", "PYTHONPATH"]),
    ("ok.py:scor", None, ["ok.py has no 'scor'", "it defines half_verl, other, score",
                          "did you mean --reward.fn ok.py:score?"]),
    ("ok.py:THRESHOLD", None, ["ok.py:THRESHOLD is not callable (it is float 0.5)", "at a reward function"]),
    ("ok.py:other", None, ["ok.py:other has an unsupported signature other(response)",
                           "verl's compute_score(data_source, solution_str, ground_truth, extra_info=None)",
                           "(response, ground_truth, **row)"]),
    ("ok.py:half_verl", None, ["half_verl(data_source, solution_str)", "cannot be called with keywords"]),
]


@pytest.mark.parametrize("spec, source, expected", LOAD_ERRORS, ids=[e[0] for e in LOAD_ERRORS])
def test_every_load_error_names_the_flag_the_spec_and_the_problem(tmp_path, monkeypatch, spec, source, expected):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "ok.py", """
        import math

        THRESHOLD = 0.5

        def score(response, ground_truth):
            return 1.0

        def other(response):
            return 1.0

        def half_verl(data_source, solution_str):
            return 1.0
    """)
    if source is not None:
        _write(tmp_path, spec.split(":")[0], source)
    with pytest.raises(ValueError) as err:
        load_reward(spec)
    message = str(err.value)
    assert message.startswith(f"--reward.fn {spec!r}: ")
    assert "\n" not in message and "Traceback" not in message
    for text in expected:
        assert text in message


def test_a_failed_import_leaves_no_half_module_behind(tmp_path):
    import sys
    path = _write(tmp_path, "half.py", "def score(r, g):\n    return 1.0\n\nraise RuntimeError('config missing')\n")
    with pytest.raises(ValueError, match="RuntimeError: config missing"):
        load_reward(f"{path}:score")
    assert not [name for name in sys.modules if name.startswith("asyncrl_user_half_")]


# --- results -------------------------------------------------------------------------------------------------------


def _normalize(raw):
    return normalize_result(raw, fn_name="my_reward.py:score", data_source="x", index=12)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_finite_float_is_its_own_score(value):
    assert _normalize(value) == RewardResult(value, {})
    assert _normalize({"score": value}) == RewardResult(value, {})


@given(st.sampled_from([math.nan, math.inf, -math.inf]), st.booleans())
def test_a_non_finite_score_always_raises_naming_function_source_and_row(value, as_dict):
    with pytest.raises(RewardValueError) as err:
        _normalize({"score": value} if as_dict else value)
    assert f"my_reward.py:score returned {value} for data_source='x', row 12" == str(err.value)


@pytest.mark.parametrize("raw, score", [
    (1, 1.0), (True, 1.0), (False, 0.0), (np.float32(0.25), 0.25), (np.int64(3), 3.0), (np.bool_(True), 1.0),
    (np.array(0.5), 0.5), (torch.tensor(0.75), 0.75), (torch.tensor(2, dtype=torch.int32), 2.0),
])
def test_numbers_of_every_kind(raw, score):
    assert _normalize(raw) == RewardResult(score, {})


def test_dict_extras_keep_numeric_finite_entries():
    raw = {"score": np.float64(1.0), "acc": True, "pred": "72", "length": 31, "judge": torch.tensor(0.5),
           "bad": math.nan, "nested": {"a": 1}}
    assert _normalize(raw) == RewardResult(1.0, {"acc": 1.0, "length": 31.0, "judge": 0.5})


@pytest.mark.parametrize("raw, message", [
    ("1.0", r"returned '1\.0' \(str\), not a number, for data_source='x', row 12"),
    (None, r"returned None \(NoneType\), not a number"),
    (torch.tensor([1.0, 2.0]), r"returned tensor\(\[1\., 2\.\]\) \(Tensor\), not a number"),
    ({"acc": 1.0}, r"returned a dict without 'score' \(keys: acc\) for data_source='x', row 12"),
    ({"score": "high"}, r"returned 'high' \(str\), not a number"),
    pytest.param(10 ** 400, r"returned inf for", id="huge-int"),
])
def test_anything_else_raises(raw, message):
    with pytest.raises(RewardValueError, match=r"my_reward\.py:score " + message):
        _normalize(raw)


# --- which reward scores which data source -------------------------------------------------------------------------


@pytest.mark.parametrize("text, parsed", [
    ("my.py:score", (None, "my.py:score")),
    ("pkg.mod:score", (None, "pkg.mod:score")),
    ("countdown=my.py:score", ("countdown", "my.py:score")),
    ("countdown=pkg.mod:score", ("countdown", "pkg.mod:score")),
    ("openai/gsm8k=rewards/judge.py:score", ("openai/gsm8k", "rewards/judge.py:score")),
    ("=my.py:score", ("", "my.py:score")),
    ("/abs/dir:x=1/my.py:score", (None, "/abs/dir:x=1/my.py:score")),  # a ':' before '=': no prefix
])
def test_parse_reward_spec(text, parsed):
    assert parse_reward_spec(text) == parsed


def test_a_path_with_an_equals_sign_is_not_a_prefix_when_the_file_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "runs/lr=0.1/r.py", "def score(response, ground_truth):\n    return 1.0\n")
    assert parse_reward_spec("runs/lr=0.1/r.py:score") == (None, "runs/lr=0.1/r.py:score")
    assert RewardTable.from_specs(["runs/lr=0.1/r.py:score"]).default_plugin.name == "r.py:score"


@given(st.text(st.characters(blacklist_characters="=:/", blacklist_categories=["Cs"]), min_size=1),
       st.sampled_from(["my.py:score", "pkg.mod:score", "sub/dir/r.py:f"]))
def test_a_data_source_prefix_round_trips(data_source, target):
    assert parse_reward_spec(f"{data_source}={target}") == (data_source, target)


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("everywhere", "judge", "countdown_v2"):
        _write(tmp_path, f"{name}.py", "def score(response, ground_truth):\n    return 1.0\n")


def test_resolution_prefix_then_unprefixed_then_builtin(plugins):
    table = RewardTable.from_specs(["openai/gsm8k=judge.py:score", "everywhere.py:score"])
    assert table.resolve("openai/gsm8k").name == "judge.py:score"
    assert table.resolve("openai/gsm8k").spec == "openai/gsm8k=judge.py:score"
    assert table.resolve("countdown").name == "everywhere.py:score"  # the unprefixed plug-in beats the built-in
    assert table.resolve("anything").name == "everywhere.py:score"
    assert table.missing(["anything", "else"]) == []

    table = RewardTable.from_specs(["countdown=countdown_v2.py:score"])
    assert table.resolve("countdown").name == "countdown_v2.py:score"
    assert table.resolve("openai/gsm8k").fn is BUILTIN_REWARDS["openai/gsm8k"]
    assert table.resolve("toy").style == "asyncrl" and table.resolve("toy").keywords == frozenset()
    assert table.missing(["toy", "mine", "countdown", "mine", "yours"]) == ["mine", "yours"]
    assert table.known == sorted(BUILTIN_REWARDS)


def test_no_reward_names_the_row_the_known_sources_and_the_flag(plugins):
    table = RewardTable.from_specs(["countdown=countdown_v2.py:score"], builtins={"toy": BUILTIN_REWARDS["toy"]})
    with pytest.raises(ValueError) as err:
        table.resolve("mine", row=4, file="data/train.jsonl")
    assert str(err.value).startswith("no reward for data_source 'mine' (row 4 of data/train.jsonl): "
                                     "known data sources: countdown, toy; pass --reward.fn PATH.py:NAME")
    with pytest.raises(ValueError, match=r"no reward for data_source 'mine': known"):
        table.resolve("mine")


@pytest.mark.parametrize("specs, message", [
    (["everywhere.py:score", "judge.py:score"], r"--reward\.fn: two reward functions for every data source "
                                                r"\('everywhere\.py:score' and 'judge\.py:score'\)"),
    (["x=judge.py:score", "x=everywhere.py:score"], r"--reward\.fn: two reward functions for data_source 'x'"),
    (["=judge.py:score"], r"--reward\.fn '=judge\.py:score': nothing before '='"),
    (["x=missing.py:score"], r"--reward\.fn 'missing\.py:score': .*missing\.py does not exist"),
])
def test_table_errors_name_the_flag(plugins, specs, message):
    with pytest.raises(ValueError, match=message):
        RewardTable.from_specs(specs)


def test_reward_files_are_made_absolute_for_processes_started_elsewhere(tmp_path, monkeypatch):
    from asyncrl.rewards.plugin import absolute_reward_spec
    (tmp_path / "r.py").write_text("def score(response, ground_truth):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    assert absolute_reward_spec("r.py:score") == f"{tmp_path / 'r.py'}:score"
    assert absolute_reward_spec("openai/gsm8k=r.py:score") == f"openai/gsm8k={tmp_path / 'r.py'}:score"
    assert absolute_reward_spec("my_pkg.rewards:score") == "my_pkg.rewards:score"  # a module stays a module
    assert absolute_reward_spec("missing.py:score") == "missing.py:score"  # its load error names it as typed
