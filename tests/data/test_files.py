"""Prompt files: the GSM8K converter on the real test split, rendering through SmolLM2's chat template,
the promised error messages, and the length filter / left truncation."""

from __future__ import annotations

import json
import re

import pytest

from asyncrl.data.files import (
    GSM8K_INSTRUCTION, RowKeys, convert_gsm8k, load_prompt_file, read_jsonl, read_parquet, rows_to_prompts,
    write_rows,
)
from asyncrl.data.scoring import Scorer
from asyncrl.data.tasks import ArithmeticTask, render_chat
from asyncrl.rewards.gsm8k import gsm8k_ground_truth
from asyncrl.rewards.registry import BUILTIN_REWARDS
from asyncrl.types import Completion

GSM8K_ROWS = 1319


def _write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _verl_row(question: str, truth="7", source="openai/gsm8k") -> dict:
    return {"prompt": [{"role": "user", "content": question}], "data_source": source,
            "reward_model": {"style": "rule", "ground_truth": truth}}


# --- GSM8K converter ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_converted(gsm8k_test_file, tmp_path_factory):
    """The real test split converted to both formats: {suffix: path}, plus the original rows."""
    out = tmp_path_factory.mktemp("gsm8k")
    paths = {}
    for suffix in (".parquet", ".jsonl"):
        paths[suffix] = out / f"nested/test{suffix}"  # parent directories are created
        assert convert_gsm8k(gsm8k_test_file, paths[suffix]) == GSM8K_ROWS
    return paths, read_jsonl(gsm8k_test_file)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_convert_gsm8k_round_trips_the_test_split(gsm8k_converted, suffix):
    paths, original = gsm8k_converted
    rows = (read_parquet if suffix == ".parquet" else read_jsonl)(paths[suffix])
    assert len(rows) == len(original) == GSM8K_ROWS
    for index, (row, src) in enumerate(zip(rows, original)):
        assert row["prompt"] == [{"role": "user", "content": src["question"] + " " + GSM8K_INSTRUCTION}]
        assert row["data_source"] == "openai/gsm8k"
        assert row["reward_model"] == {"style": "rule", "ground_truth": gsm8k_ground_truth(src["answer"])}
        assert row["extra_info"] == {"index": index, "question": src["question"], "answer": src["answer"]}
    # spot checks against the file itself: the first answer is 18, and commas are removed ("1,000" style)
    assert rows[0]["reward_model"]["ground_truth"] == "18"
    assert all("," not in r["reward_model"]["ground_truth"] for r in rows)
    assert not list(paths[suffix].parent.glob(".*tmp*")), "the atomic write left a temporary file"


def test_gsm8k_file_renders_through_the_chat_template(gsm8k_converted, smollm2_tokenizer):
    paths, original = gsm8k_converted
    prompts, stats = load_prompt_file(paths[".parquet"], smollm2_tokenizer, max_prompt_length=1024)
    assert {k: stats[k] for k in ("rows", "kept", "filtered_too_long", "truncated", "empty")} == \
        {"rows": GSM8K_ROWS, "kept": GSM8K_ROWS, "filtered_too_long": 0, "truncated": 0, "empty": 0}
    assert stats["first_row_of_source"] == {"openai/gsm8k": f"{paths['.parquet']}: row 0"}
    assert stats["longest"] == max(len(p.prompt_ids) for p in prompts)
    from_jsonl, _ = load_prompt_file(paths[".jsonl"], smollm2_tokenizer, max_prompt_length=1024)
    assert from_jsonl == prompts  # the two formats carry the same rows
    for prompt, src in zip(prompts[:50], original):
        content = src["question"] + " " + GSM8K_INSTRUCTION
        assert prompt.prompt_ids == render_chat(smollm2_tokenizer, content)
        assert prompt.text == content and prompt.ground_truth == gsm8k_ground_truth(src["answer"])
    assert [p.index for p in prompts] == list(range(GSM8K_ROWS))
    text = smollm2_tokenizer.decode(prompts[0].prompt_ids)
    assert "<|im_start|>user\nJanet" in text and text.endswith("<|im_start|>assistant\n")
    # the reward table scores a response to a file prompt through its data_source
    scorer = Scorer(BUILTIN_REWARDS, tokenizer=smollm2_tokenizer)
    right = Completion(smollm2_tokenizer.encode("16 - 3 - 4 = 9 eggs, 9 * 2 = 18\n#### 18"), [], [])
    wrong = Completion(smollm2_tokenizer.encode("#### 17"), [], [])
    assert scorer(prompts[0], right) == 1.0 and scorer(prompts[0], wrong) == 0.0


def test_render_chat_takes_a_message_list_and_keeps_its_old_signature(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert render_chat(tok, "What is 2 + 2?") == render_chat(tok, [{"role": "user", "content": "What is 2 + 2?"}])
    with_system = render_chat(tok, "hi", system="Be brief.")
    assert with_system == render_chat(tok, [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "hi"}])
    assert "Be brief." in tok.decode(with_system) and "SmolLM" not in tok.decode(with_system)
    # a row's own system message wins over the configured one
    own = [{"role": "system", "content": "Row system."}, {"role": "user", "content": "hi"}]
    assert render_chat(tok, own, system="Be brief.") == render_chat(tok, own)
    # the procedural tasks still render as before
    prompt = ArithmeticTask().prompt(0, tok)
    assert prompt.prompt_ids == render_chat(tok, prompt.text)


# --- malformed data ------------------------------------------------------------------------------------------------


def test_bad_json_line_names_file_and_line(tmp_path, word_tokenizer):
    path = _write_jsonl(tmp_path / "x.jsonl", [_verl_row("a b"), "", _verl_row("c d"), '{"prompt": [oops'])
    with pytest.raises(ValueError, match=r"x\.jsonl:4: not valid JSON \(") as err:
        read_jsonl(path)
    assert str(tmp_path) in str(err.value)
    with pytest.raises(ValueError, match=r"x\.jsonl:4: not valid JSON"):
        load_prompt_file(path, word_tokenizer, max_prompt_length=64)
    path = _write_jsonl(tmp_path / "list.jsonl", [_verl_row("a b"), "[1, 2]"])
    with pytest.raises(ValueError, match=r"list\.jsonl:2: expected a JSON object per line, got list"):
        read_jsonl(path)


@pytest.mark.parametrize("row, message", [
    ({"prompt": [{"role": "user", "content": "q"}], "data_source": "d"},
     r"missing field 'reward_model\.ground_truth'; rows must look like verl's"),
    ({"prompt": [{"role": "user", "content": "q"}], "data_source": "d", "reward_model": {"style": "rule"}},
     r"missing field 'reward_model\.ground_truth'"),
    ({"prompt": "q", "data_source": "d"}, r"missing field 'ground_truth'"),
    ({"data_source": "d", "ground_truth": "1"}, r"missing field 'prompt'"),
    ({"prompt": "q", "ground_truth": "1"}, r"field 'data_source' must be a non-empty string .* got missing"),
    ({"prompt": 5, "ground_truth": "1", "data_source": "d"},
     r"field 'prompt' must be a message list or a string, got int"),
    ({"prompt": [{"role": "user", "content": 5}], "data_source": "d", "reward_model": {"ground_truth": "1"}},
     r"prompt\[0\]\.content must be a string, got int"),
    ({"prompt": [{"content": "q"}], "data_source": "d", "reward_model": {"ground_truth": "1"}},
     r"prompt\[0\]\.role must be a string, got nothing"),
    ({"prompt": ["q"], "data_source": "d", "reward_model": {"ground_truth": "1"}},
     r"prompt\[0\] must be a message object"),
    ({"prompt": [], "data_source": "d", "reward_model": {"ground_truth": "1"}},
     r"field 'prompt' is an empty message list"),
    ({"prompt": [{"role": "user", "content": "q"}], "data_source": "d", "reward_model": {"ground_truth": [1, 2]}},
     r"field 'reward_model\.ground_truth' must be a string or a number, got list"),
    ({"prompt": [{"role": "user", "content": "q"}], "data_source": "d", "reward_model": "7"},
     r"field 'reward_model' must be an object"),
    ({"prompt": "q", "ground_truth": True, "data_source": "d"},
     r"field 'ground_truth' must be a string or a number, got bool"),
    ({"prompt": "q", "ground_truth": "1", "data_source": "d", "extra_info": "train"},
     r"field 'extra_info' must be an object \{\.\.\.\}, got str"),
])
def test_malformed_row_names_file_line_and_field(tmp_path, word_tokenizer, row, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", [_verl_row("fine row"), "", row])  # the bad row is on line 3
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: " + message):
        load_prompt_file(path, word_tokenizer, max_prompt_length=64)


def test_parquet_errors_name_the_row_index(tmp_path, word_tokenizer):
    path = tmp_path / "bad.parquet"
    write_rows([_verl_row("one"), {**_verl_row("two"), "data_source": ""}], path)
    with pytest.raises(ValueError, match=r"bad\.parquet: row 1: field 'data_source' must be a non-empty string"):
        load_prompt_file(path, word_tokenizer, max_prompt_length=64)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet: not a readable Parquet file"):
        load_prompt_file(tmp_path / "junk.parquet", word_tokenizer, max_prompt_length=64)


def test_bad_paths_and_arguments(tmp_path, word_tokenizer, gsm8k_test_file):
    with pytest.raises(ValueError, match=r"missing\.jsonl: no such file"):
        load_prompt_file(tmp_path / "missing.jsonl", word_tokenizer, max_prompt_length=64)
    with pytest.raises(ValueError, match=r"unknown prompt file type '\.csv'; give a \.jsonl or \.parquet file"):
        load_prompt_file(tmp_path / "x.csv", word_tokenizer, max_prompt_length=64)
    with pytest.raises(ValueError, match=r"must end in \.jsonl or \.parquet"):
        convert_gsm8k(gsm8k_test_file, tmp_path / "out.csv")
    rows = [_verl_row("q")]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        rows_to_prompts(rows, None, source="s", max_prompt_length=8)
    with pytest.raises(ValueError, match="on_long='drop' must be 'filter' or 'truncate'"):
        rows_to_prompts(rows, word_tokenizer, source="s", max_prompt_length=8, on_long="drop")
    with pytest.raises(ValueError, match="max_prompt_length=0 must be >= 1"):
        rows_to_prompts(rows, word_tokenizer, source="s", max_prompt_length=0)


def test_convert_gsm8k_names_the_bad_source_line(tmp_path):
    src = _write_jsonl(tmp_path / "src.jsonl", [{"question": "q", "answer": "so 4\n#### 4"},
                                                {"question": "q", "answer": "no final line"}])
    with pytest.raises(ValueError, match=r"src\.jsonl:2: gsm8k_ground_truth: no '####'"):
        convert_gsm8k(src, tmp_path / "out.jsonl")
    src = _write_jsonl(tmp_path / "other.jsonl", [{"problem": "q", "solution": "4"}])
    with pytest.raises(ValueError, match=r"other\.jsonl:1: field 'question' must be a string; is this a GSM8K file"):
        convert_gsm8k(src, tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


# --- length filter and truncation ----------------------------------------------------------------------------------


def _rows_of_lengths(words: list[int]) -> list[dict]:
    """Rows whose rendered prompts have exactly w + 2 tokens with the WordTokenizer (<user> words <assistant>);
    even rows in verl's format, odd rows plain."""
    rows = []
    for i, n in enumerate(words):
        text = " ".join(f"w{i}_{j}" for j in range(n))
        rows.append(_verl_row(text, truth=i) if i % 2 == 0
                    else {"prompt": text, "ground_truth": str(i), "data_source": "plain"})
    return rows


def test_length_filter_counts(word_tokenizer):
    words = [1, 10, 6, 7, 30, 5, 8]  # rendered lengths 3, 12, 8, 9, 32, 7, 10
    prompts, stats = rows_to_prompts(_rows_of_lengths(words), word_tokenizer, source="s", max_prompt_length=9)
    assert {k: stats[k] for k in ("rows", "kept", "filtered_too_long", "truncated")} == \
        {"rows": 7, "kept": 4, "filtered_too_long": 3, "truncated": 0}
    assert [p.index for p in prompts] == [0, 2, 3, 5]  # exactly max_prompt_length (9 tokens) is kept
    assert [len(p.prompt_ids) for p in prompts] == [3, 8, 9, 7]
    assert [p.ground_truth for p in prompts] == ["0", "2", "3", "5"]  # numbers become strings
    assert [p.data_source for p in prompts] == ["openai/gsm8k", "openai/gsm8k", "plain", "plain"]


def test_row_keys_read_rows_of_another_shape(word_tokenizer):
    """--data.prompt-key / answer-key (dotted) / data-source: a Hub dataset's own columns, no conversion."""
    rows = [{"query": [{"role": "user", "content": "two words"}], "meta": {"solution": 7}, "data_source": "x"},
            {"query": "three more words", "meta": {"solution": "8"}}]
    keys = RowKeys(prompt="query", answer="meta.solution", data_source="sums")
    prompts, _ = rows_to_prompts(rows, word_tokenizer, source="s", max_prompt_length=99, keys=keys)
    assert [(p.text, p.ground_truth, p.data_source) for p in prompts] == [
        ("two words", "7", "sums"), ("three more words", "8", "sums")]
    assert prompts[0].fields == {"query": rows[0]["query"], "meta": {"solution": 7}}  # the row's own fields ride along
    with pytest.raises(ValueError, match=r"s: row 0: missing field 'meta.answer' \(--data.answer-key\); the row's "
                                         r"fields: query, meta, data_source"):
        rows_to_prompts(rows, word_tokenizer, source="s", max_prompt_length=99,
                        keys=RowKeys(prompt="query", answer="meta.answer"))
    with pytest.raises(ValueError, match="missing field 'prompt'.*--data.prompt-key"):
        rows_to_prompts([{"question": "q?", "answer": "1"}], word_tokenizer, source="s", max_prompt_length=99)


def test_truncation_keeps_the_end_of_the_prompt(word_tokenizer):
    rows = _rows_of_lengths([1, 10, 6, 7, 30])
    full, _ = rows_to_prompts(rows, word_tokenizer, source="s", max_prompt_length=10_000)
    prompts, stats = rows_to_prompts(rows, word_tokenizer, source="s", max_prompt_length=9, on_long="truncate")
    assert {k: stats[k] for k in ("rows", "kept", "filtered_too_long", "truncated")} == \
        {"rows": 5, "kept": 5, "filtered_too_long": 0, "truncated": 2}
    assert [len(p.prompt_ids) for p in prompts] == [3, 9, 8, 9, 9]
    for short, long in zip(prompts, full):
        assert short.prompt_ids == long.prompt_ids[-9:]  # left truncation: the generation prompt survives
    assert word_tokenizer.decode(prompts[1].prompt_ids).endswith("w1_9 <assistant>")
    assert "<user>" not in word_tokenizer.decode(prompts[1].prompt_ids)


def test_system_prompt_applies_to_rows_without_one(word_tokenizer):
    own_system = [{"role": "system", "content": "own"}, {"role": "user", "content": "q two"}]
    rows = [_verl_row("q one"), {**_verl_row("q two"), "prompt": own_system}]
    prompts, _ = rows_to_prompts(rows, word_tokenizer, source="s", max_prompt_length=64, system_prompt="be brief")
    assert word_tokenizer.decode(prompts[0].prompt_ids) == "<system> be brief <user> q one <assistant>"
    assert word_tokenizer.decode(prompts[1].prompt_ids) == "<system> own <user> q two <assistant>"
    assert prompts[1].text == "q two"  # the last message, for logs


def test_rows_carry_extra_info_and_their_other_fields_into_the_prompt(tmp_path, word_tokenizer):
    import dataclasses
    import datetime

    from asyncrl.types import Prompt

    rows = [{**_verl_row("q one"), "ability": "math", "extra_info": {"index": 4, "split": "train"}},
            {"prompt": "q two", "ground_truth": "3", "data_source": "plain", "level": 2,
             "when": datetime.date(2024, 5, 1)},  # parquet may hold dates: they become strings
            {**_verl_row("q three"), "extra_info": None}]
    prompts, _ = rows_to_prompts(rows, word_tokenizer, source="s", max_prompt_length=64)
    assert [p.extra_info for p in prompts] == [{"index": 4, "split": "train"}, {}, {}]
    assert [p.fields for p in prompts] == [{"ability": "math"}, {"level": 2, "when": "2024-05-01"}, {}]
    # a checkpoint stores unfinished prompts as JSON and rebuilds them; one written before these fields loads too
    for prompt in prompts:
        assert Prompt(**json.loads(json.dumps(dataclasses.asdict(prompt)))) == prompt
    old = {k: v for k, v in dataclasses.asdict(prompts[0]).items() if k not in ("extra_info", "fields")}
    assert Prompt(**old).extra_info == {} and Prompt(**old).fields == {}
    # from Parquet alike, where a date column holds dates
    path = tmp_path / "rows.parquet"
    write_rows([{**rows[0], "when": datetime.date(2024, 5, 1)}], path)
    (from_parquet,), _ = load_prompt_file(path, word_tokenizer, max_prompt_length=64)
    assert from_parquet.extra_info == {"index": 4, "split": "train"}
    assert from_parquet.fields == {"ability": "math", "when": "2024-05-01"}


def test_empty_prompts_are_refused_naming_the_row_or_dropped_and_counted(word_tokenizer, tmp_path):
    rows = _rows_of_lengths([2, 3]) + [{"prompt": "  ", "ground_truth": "1", "data_source": "plain"},
                                       _verl_row("", truth=4)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:3: the prompt is empty; .*--data\.on-empty drop"):
        load_prompt_file(path, word_tokenizer, max_prompt_length=64)
    prompts, stats = load_prompt_file(path, word_tokenizer, max_prompt_length=64, on_empty="drop")
    assert [p.index for p in prompts] == [0, 1] and stats["empty"] == 2 and stats["kept"] == 2
