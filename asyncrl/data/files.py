"""Prompt files: JSONL and Parquet in verl's row format, rendered through the model's chat template.

    prompts, stats = load_prompt_file("data/gsm8k/train.parquet", tokenizer, max_prompt_length=1024)
    source = DatasetSource(prompts, seed=0)

Two row formats are read (they may be mixed in one file):

* verl's: `{"prompt": [{"role": "user", "content": "..."}], "data_source": "openai/gsm8k",
  "reward_model": {"ground_truth": "72"}, "extra_info": {...}}` (`extra_info` is optional);
* plain text: `{"prompt": "...", "ground_truth": "72", "data_source": "openai/gsm8k"}`.

`data_source` selects the reward function (a `--reward.fn` plug-in, or the built-in of
`asyncrl.rewards.registry`); the ground truth may be a string or a number (numbers are turned into
strings). `extra_info` and the row's other top-level fields ride along in the `Prompt` (`extra_info`,
`fields`) for reward functions that want them; values JSON cannot hold (timestamps, bytes) become strings.
Every error names the file, the row (`path:LINE` for JSONL, `path: row I` with I counted from 0 for
Parquet), the field and the fix.

Prompts longer than `max_prompt_length` tokens (after the chat template) are dropped (`on_long="filter"`)
or left-truncated (`on_long="truncate"`): the first tokens go, so the end of the prompt — the question's
last words and the template's generation prompt (`<|im_start|>assistant\\n`) — survives, as with verl's
`truncation="left"`. A left-truncated prompt loses its system message and the start of the question, so
filtering is the default; truncation is for data sets with a few overlong rows you'd rather keep.

Rows of other shapes (a Hub dataset's `question` / `answer` columns) are read through `RowKeys` (the
`--data.prompt-key / answer-key / data-source` flags): which field holds the prompt and the reference answer,
and the data_source to give every row.

`convert_gsm8k` writes the GSM8K files (`question`, `answer` ending in "#### N") in verl's format, the
same rows as verl's `examples/data_preprocess/gsm8k.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Literal, Mapping, Sequence

import pyarrow
import pyarrow.parquet as pq

from asyncrl.data.tasks import render_chat
from asyncrl.rewards.gsm8k import gsm8k_ground_truth
from asyncrl.types import Prompt

__all__ = [
    "read_jsonl", "read_parquet", "write_rows", "rows_to_prompts", "load_prompt_file", "read_gsm8k", "convert_gsm8k",
    "GSM8K_INSTRUCTION", "SUFFIXES", "RowKeys",
]

OnLong = Literal["filter", "truncate"]
OnEmpty = Literal["refuse", "drop"]
SUFFIXES = (".jsonl", ".parquet")
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."

_FORMATS = ('rows must look like verl\'s {"prompt": [{"role": "user", "content": "..."}], "data_source": "...", '
            '"reward_model": {"ground_truth": "..."}} or plain {"prompt": "...", "ground_truth": "...", '
            '"data_source": "..."}')


def _check_exists(path: pathlib.Path) -> None:
    if not path.is_file():
        raise ValueError(f"{path}: no such file" + ("" if not path.exists() else " (it is a directory)"))


def _read_jsonl_numbered(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """(line number, row) for every non-blank line."""
    path = pathlib.Path(path)
    _check_exists(path)
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err}); each line must be one JSON object"
                                 ) from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}")
            rows.append((number, row))
    return rows


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSONL file (one JSON object per line; blank lines are skipped).

    Raises:
      ValueError: the file is missing, or a line is not a JSON object (`path:LINE: ...`).
    """
    return [row for _, row in _read_jsonl_numbered(path)]


def read_parquet(path: str | os.PathLike) -> list[dict]:
    """The rows of a Parquet file as dicts (nested columns become nested dicts and lists).

    Raises:
      ValueError: the file is missing or is not Parquet.
    """
    path = pathlib.Path(path)
    _check_exists(path)
    try:
        return pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from None


def write_rows(rows: Sequence[Mapping[str, Any]], out_path: str | os.PathLike) -> int:
    """Write rows as `.jsonl` or `.parquet` (by suffix), atomically (a temporary file renamed over `out_path`)."""
    out = pathlib.Path(out_path)
    if out.suffix not in SUFFIXES:
        raise ValueError(f"{out}: the output must end in .jsonl or .parquet")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        if out.suffix == ".parquet":
            pq.write_table(pyarrow.Table.from_pylist([dict(r) for r in rows]), tmp)
        else:
            with tmp.open("w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return len(rows)


@dataclasses.dataclass(frozen=True)
class RowKeys:
    """Where a row keeps its prompt and reference answer, and the data_source every row gets (None: its own)."""

    prompt: str = "prompt"
    answer: str | None = None
    """A field name, dotted for a nested one ("reward_model.ground_truth"); None: the row format's."""
    data_source: str | None = None

    def apply(self, row, where: str):
        """The row in the format `_parse_row` reads (the row itself when every key is the default)."""
        if self == RowKeys() or not isinstance(row, Mapping):
            return row
        out = dict(row)
        if self.prompt != "prompt":
            if self.prompt not in row:
                raise ValueError(f"{where}: missing field {self.prompt!r} (--data.prompt-key); the row's fields: "
                                 f"{_field_names(row)}")
            out["prompt"] = row[self.prompt]
        if self.answer is not None:
            value = row
            for part in self.answer.split("."):
                if not isinstance(value, Mapping) or part not in value:
                    raise ValueError(f"{where}: missing field {self.answer!r} (--data.answer-key); the row's fields: "
                                     f"{_field_names(row)}")
                value = value[part]
            reward_model = row.get("reward_model") if isinstance(row.get("reward_model"), Mapping) else {}
            out["ground_truth"], out["reward_model"] = value, {**reward_model, "ground_truth": value}
        if self.data_source is not None:
            out["data_source"] = self.data_source
        return out


def _field_names(row: Mapping) -> str:
    names = ", ".join(map(str, row))
    return names if len(names) <= 200 else names[:200] + "..."


def _ground_truth(value, where: str, field: str) -> str:
    if value is None:
        raise ValueError(f"{where}: missing field '{field}'; {_FORMATS}")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: field '{field}' must be a string or a number, got {type(value).__name__} "
                         f"({str(value)[:60]}); store the reference answer as text")
    return str(value)


def _parse_row(row, where: str) -> tuple[str | list[dict], str, str]:
    """(the prompt text or message list, data_source, ground truth) of one row."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a row object, got {type(row).__name__}; {_FORMATS}")
    prompt = row.get("prompt")
    if prompt is None:
        raise ValueError(f"{where}: missing field 'prompt'; {_FORMATS}; or name the row's fields with "
                         f"--data.prompt-key / --data.answer-key / --data.data-source (the row's fields: "
                         f"{_field_names(row)})")
    if isinstance(prompt, str):
        ground_truth = _ground_truth(row.get("ground_truth"), where, "ground_truth")
    elif isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError(f"{where}: field 'prompt' is an empty message list; give at least one user message")
        for i, message in enumerate(prompt):
            if not isinstance(message, Mapping):
                raise ValueError(f"{where}: prompt[{i}] must be a message object {{\"role\": ..., \"content\": ...}}, "
                                 f"got {type(message).__name__}")
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    got = "nothing" if message.get(key) is None else type(message.get(key)).__name__
                    raise ValueError(f"{where}: prompt[{i}].{key} must be a string, got {got}")
        reward_model = row.get("reward_model")
        if reward_model is not None and not isinstance(reward_model, Mapping):
            raise ValueError(f"{where}: field 'reward_model' must be an object {{\"ground_truth\": ...}}, "
                             f"got {type(reward_model).__name__}")
        ground_truth = _ground_truth((reward_model or {}).get("ground_truth"), where, "reward_model.ground_truth")
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise ValueError(f"{where}: field 'prompt' must be a message list or a string, got {type(prompt).__name__}; "
                         f"{_FORMATS}")
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        got = "missing" if data_source is None else f"{data_source!r} ({type(data_source).__name__})"
        raise ValueError(f"{where}: field 'data_source' must be a non-empty string (it selects the reward function, "
                         f"e.g. 'openai/gsm8k'), got {got}")
    return prompt, data_source, ground_truth


_ROW_KEYS = frozenset({"prompt", "data_source", "reward_model", "ground_truth", "extra_info"})


def _jsonable(value, where: str, field: str):
    """`value` as plain JSON data (a checkpoint stores prompts as JSON); other values become strings."""
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: field '{field}' cannot be stored as JSON ({err}); use strings, numbers, "
                         "lists and objects with string keys") from None


def _row_extras(row: Mapping, where: str) -> tuple[dict, dict]:
    """(extra_info, the other top-level fields) of one row, as JSON data."""
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, Mapping):
        raise ValueError(f"{where}: field 'extra_info' must be an object {{...}}, got {type(extra_info).__name__}; "
                         "wrap the value, e.g. {\"extra_info\": {\"value\": ...}}")
    fields = {str(k): v for k, v in row.items() if k not in _ROW_KEYS}
    return _jsonable(dict(extra_info or {}), where, "extra_info"), _jsonable(fields, where, "(top-level fields)")


def rows_to_prompts(rows: Sequence[Mapping], tokenizer, *, source: str, max_prompt_length: int,
                    on_long: OnLong = "filter", on_empty: OnEmpty = "refuse", system_prompt: str | None = None,
                    line_numbers: Sequence[int] | None = None, keys: RowKeys = RowKeys()) -> tuple[list[Prompt], dict]:
    """Render rows (either format, see the module docstring) into `Prompt`s through the chat template.

    Args:
      source: the file the rows came from (for error messages).
      max_prompt_length: longest prompt in tokens; longer ones are dropped or left-truncated (`on_long`).
      on_empty: a row whose prompt (its last message) is empty or blank raises ("refuse") or is left out ("drop").
      system_prompt: system message for rows without one of their own.
      line_numbers: the JSONL line of each row, for error messages (default: `row I`, counted from 0).
      keys: where the rows keep their prompt and answer, and the data_source to give them (`RowKeys`).

    Returns:
      (prompts, stats) with stats {"rows", "kept", "filtered_too_long", "truncated", "empty", "longest" (tokens
      of the longest prompt, before filtering), "first_row_of_source" (data_source -> where its first row is)}. `Prompt.index` is the
      row's position in `rows`; `Prompt.text` is the plain prompt, or the content of the last message;
      `Prompt.extra_info` the row's `extra_info` ({} without one); `Prompt.fields` its other top-level fields.

    Raises:
      ValueError: a row misses a field or has the wrong type (file, row, field and the fix), or bad arguments.
    """
    if tokenizer is None:
        raise ValueError(f"{source}: rendering prompts needs a tokenizer (a random model has none); "
                         "use a model with a tokenizer (an HF directory, a .gguf file or 'smollm2')")
    if max_prompt_length < 1:
        raise ValueError(f"rows_to_prompts: max_prompt_length={max_prompt_length} must be >= 1")
    if on_long not in ("filter", "truncate"):
        raise ValueError(f"rows_to_prompts: on_long={on_long!r} must be 'filter' or 'truncate'")
    if line_numbers is not None and len(line_numbers) != len(rows):
        raise ValueError(f"rows_to_prompts: {len(line_numbers)} line numbers for {len(rows)} rows")
    if on_empty not in ("refuse", "drop"):
        raise ValueError(f"rows_to_prompts: on_empty={on_empty!r} must be 'refuse' or 'drop'")
    stats = {"rows": len(rows), "kept": 0, "filtered_too_long": 0, "truncated": 0, "empty": 0, "longest": 0,
             "first_row_of_source": {}}
    prompts = []
    for index, row in enumerate(rows):
        where = f"{source}:{line_numbers[index]}" if line_numbers is not None else f"{source}: row {index}"
        row = keys.apply(row, where)
        prompt, data_source, ground_truth = _parse_row(row, where)
        extra_info, fields = _row_extras(row, where)
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        if not text.strip():
            if on_empty == "refuse":
                raise ValueError(f"{where}: the prompt is empty; fix the row, or pass --data.on-empty drop to leave "
                                 "such rows out")
            stats["empty"] += 1
            continue
        stats["first_row_of_source"].setdefault(data_source, where)
        ids = render_chat(tokenizer, prompt, system=system_prompt)
        stats["longest"] = max(stats["longest"], len(ids))
        if len(ids) > max_prompt_length:
            if on_long == "filter":
                stats["filtered_too_long"] += 1
                continue
            ids = ids[-max_prompt_length:]
            stats["truncated"] += 1
        prompts.append(Prompt(list(ids), data_source=data_source, ground_truth=ground_truth, text=text, index=index,
                              extra_info=extra_info, fields=fields))
    stats["kept"] = len(prompts)
    return prompts, stats


def load_prompt_file(path: str | os.PathLike, tokenizer, *, max_prompt_length: int, on_long: OnLong = "filter",
                     on_empty: OnEmpty = "refuse", system_prompt: str | None = None,
                     keys: RowKeys = RowKeys()) -> tuple[list[Prompt], dict]:
    """Read a `.jsonl` or `.parquet` prompt file and render it (`rows_to_prompts`): (prompts, stats)."""
    path = pathlib.Path(path)
    if path.suffix == ".jsonl":
        numbered = _read_jsonl_numbered(path)
        rows, lines = [row for _, row in numbered], [n for n, _ in numbered]
    elif path.suffix == ".parquet":
        rows, lines = read_parquet(path), None
    else:
        raise ValueError(f"{path}: unknown prompt file type {path.suffix!r}; give a .jsonl or .parquet file")
    return rows_to_prompts(rows, tokenizer, source=str(path), max_prompt_length=max_prompt_length, on_long=on_long,
                           on_empty=on_empty, system_prompt=system_prompt, line_numbers=lines, keys=keys)


def read_gsm8k(src: str | os.PathLike) -> list[tuple[str, dict]]:
    """(where, row) for every row of a GSM8K .jsonl or .parquet file; `where` is `path:LINE` (JSONL) or
    `path: row I` (Parquet) for error messages.

    Raises:
      ValueError: the file is missing or unreadable, or a row's `question` or `answer` is not a string.
    """
    src = pathlib.Path(src)
    if src.suffix == ".parquet":
        numbered = [(f"{src}: row {i}", row) for i, row in enumerate(read_parquet(src))]
    else:
        numbered = [(f"{src}:{number}", row) for number, row in _read_jsonl_numbered(src)]
    for where, row in numbered:
        for field in ("question", "answer"):
            if not isinstance(row.get(field), str):
                raise ValueError(f"{where}: field '{field}' must be a string; is this a GSM8K file "
                                 "(fields 'question' and 'answer')?")
    return numbered


def convert_gsm8k(src_jsonl: str | os.PathLike, out_path: str | os.PathLike, *,
                  instruction: str = GSM8K_INSTRUCTION) -> int:
    """Convert a GSM8K .jsonl or .parquet file (`question`, `answer` ending in "#### N") to verl rows; returns
    the row count.

    Each row: prompt [{"role": "user", "content": question + " " + instruction}], data_source "openai/gsm8k",
    reward_model {"style": "rule", "ground_truth": N (commas removed)}, extra_info {"index", "question",
    "answer"}. The output is `.parquet` or `.jsonl` by its suffix.
    """
    out = pathlib.Path(out_path)
    if out.suffix not in SUFFIXES:
        raise ValueError(f"{out}: the output must end in .jsonl or .parquet")
    rows = []
    for index, (where, row) in enumerate(read_gsm8k(src_jsonl)):
        try:
            truth = gsm8k_ground_truth(row["answer"])
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{row['question']} {instruction}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": index, "question": row["question"], "answer": row["answer"]},
        })
    if not rows:
        raise ValueError(f"{src_jsonl}: no rows to convert")
    return write_rows(rows, out)
