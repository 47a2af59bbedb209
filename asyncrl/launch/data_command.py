"""`asyncrl data`: make and check prompt files.

    asyncrl data convert-gsm8k --src gsm8k/train.jsonl --out data/gsm8k/train.parquet
    asyncrl data convert-gsm8k-calc --src gsm8k/train.jsonl --out data/gsm8k-calc/train.parquet
    asyncrl data inspect data/gsm8k/train.parquet --model /models/Qwen2.5-0.5B-Instruct --max-prompt-length 1024
"""

from __future__ import annotations

import collections
import sys
from typing import Annotated

import tyro

from asyncrl.data.files import GSM8K_INSTRUCTION, convert_gsm8k, load_prompt_file
from asyncrl.data.gsm8k_calc import convert_gsm8k_calc, format_drops
from asyncrl.tools.hub import dataset_name, model_name, resolve_dataset, resolve_model
from asyncrl.policies.loading import load_tokenizer
from asyncrl.launch.model_checks import check_model_path

__all__ = ["data_main", "convert_gsm8k_command", "convert_gsm8k_calc_command", "inspect_command"]


_Path = Annotated[str, tyro.conf.arg(metavar="PATH")]


def convert_gsm8k_command(
    src: _Path, out: _Path,
    instruction: Annotated[str, tyro.conf.arg(metavar="TEXT", help_behavior_hint="(default: verl's: "
                                              f"{GSM8K_INSTRUCTION})")] = GSM8K_INSTRUCTION,
) -> None:
    """Convert GSM8K to verl's row format (user prompt, data_source "openai/gsm8k", ground truth).

    Args:
        src: The GSM8K split: a .jsonl or .parquet file of {"question", "answer"} rows (the answer ending in
            "#### N"), or its Hub name, hf:openai/gsm8k:main/train (through the local Hugging Face cache).
        out: Where to write the rows: a .parquet or .jsonl path (parent directories are created).
        instruction: Appended to every question after a space.
    """
    count = convert_gsm8k(_local_data(src, "--src"), out, instruction=instruction)
    print(f"wrote {count} rows to {out}")


def convert_gsm8k_calc_command(src: _Path, out: _Path, max_operators: int = 2, max_digits: int = 4,
                               dedupe: bool = True, exclude: _Path | None = None) -> None:
    """GSM8K-calc: each calculator annotation of GSM8K (<<48/2=24>>) as a prompt, "Compute 48/2.", truth "24".

    The rows' data_source is "gsm8k-calc" (its reward: the last number of the response equals the value). The
    expressions are parsed, never run: numbers, + - * /, a leading - and parentheses, computed exactly. An
    annotation whose exact value differs from the one it states, or that is refused, filtered or a repeat, is
    dropped; the drops are printed by reason (asyncrl.data.gsm8k_calc lists them).

    Args:
        src: The GSM8K split: a .jsonl or .parquet file of {"question", "answer"} rows (the answer with its
            <<expr=value>> steps), or its Hub name, hf:openai/gsm8k:main/train (through the local Hugging Face cache).
        out: Where to write the rows: a .parquet or .jsonl path (parent directories are created).
        max_operators: Most binary operators in an expression (a difficulty knob).
        max_digits: Most digits in an expression's longest number, leading zeros aside (a difficulty knob).
        dedupe: Keep only the first of expressions written the same way.
        exclude: Another GSM8K split (same forms as --src) whose calculator expressions are left out: give the
            training split when writing an evaluation file, so that it holds no prompt trained on.
    """
    stats = convert_gsm8k_calc(_local_data(src, "--src"), out, max_operators=max_operators, max_digits=max_digits,
                               dedupe=dedupe, exclude=None if exclude is None else _local_data(exclude, "--exclude"))
    print(f"read {stats.rows} rows with {stats.annotations} calculator annotations; dropped "
          f"{sum(stats.drops.values())}: {format_drops(stats.drops) or 'none'}")
    print(f"wrote {stats.written} rows to {out}")


def _local_data(path: str, flag: str) -> str:
    """A prompt file's local path: the file itself, or a Hub dataset split's file (`asyncrl.tools.hub`)."""
    return resolve_dataset(path, flag).path if dataset_name(path) else path


def _tokenizer(model: str):
    if model.startswith("random:"):
        raise ValueError(f"--model {model}: random models have no tokenizer; give 'smollm2', an HF model directory "
                         "or a .gguf file")
    if model_name(model) is not None:
        model = resolve_model(model, "--model").path
    problem, _ = check_model_path(model, "--model")
    if problem is not None:
        raise ValueError(problem)
    return load_tokenizer(model)


def _percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile of a sorted, non-empty list."""
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n·q/100), at least 1
    return sorted_values[int(rank) - 1]


def inspect_command(path: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="PATH")],
                    model: Annotated[str, tyro.conf.arg(metavar="smollm2|PATH")] = "smollm2",
                    max_prompt_length: int = 1024, system_prompt: str | None = None, examples: int = 2) -> None:
    """Check a prompt file and show what training would see: rows, data sources, examples, prompt lengths.

    Every row is validated and rendered through the model's chat template, as `asyncrl train --data.path` does.

    Args:
        path: A .jsonl or .parquet prompt file, or a Hub dataset split (hf:ORG/NAME[@REVISION][:[CONFIG/]SPLIT]).
        model: Tokenizer and chat template: 'smollm2' (packaged), an HF model directory, a Hub name
            (ORG/NAME[@REVISION]) or a .gguf file.
        max_prompt_length: Count the prompts longer than this (rollout.max_prompt_length filters them).
        system_prompt: System message for rows without one (data.system_prompt).
        examples: How many rendered prompts to print.
    """
    tokenizer = _tokenizer(model)
    prompts, stats = load_prompt_file(_local_data(path, "PATH"), tokenizer, max_prompt_length=sys.maxsize,
                                      system_prompt=system_prompt)
    print(f"{path}: {stats['rows']} rows")
    if not prompts:
        return
    sources = collections.Counter(p.data_source for p in prompts)
    print("data sources: " + ", ".join(f"{name} ({count})" for name, count in sources.most_common()))
    lengths = sorted(len(p.prompt_ids) for p in prompts)
    print(f"prompt tokens ({model}): min {lengths[0]}, p50 {_percentile(lengths, 50)}, "
          f"p90 {_percentile(lengths, 90)}, p99 {_percentile(lengths, 99)}, max {lengths[-1]}")
    too_long = sum(n > max_prompt_length for n in lengths)
    print(f"longer than --max-prompt-length {max_prompt_length}: {too_long} rows ({100 * too_long / len(lengths):.1f}%)"
          + (" - dropped by data.on_long=filter, left-truncated by data.on_long=truncate" if too_long else ""))
    for prompt in prompts[:examples]:
        print(f"\n--- row {prompt.index}: data_source {prompt.data_source!r}, ground truth {prompt.ground_truth!r}, "
              f"{len(prompt.prompt_ids)} tokens ---")
        print(tokenizer.decode(prompt.prompt_ids, skip_special_tokens=False))


_DESCRIPTION = """Make and check prompt files (.jsonl / .parquet in verl's row format).

  asyncrl data convert-gsm8k --src gsm8k/train.jsonl --out data/gsm8k/train.parquet
  asyncrl data convert-gsm8k-calc --src gsm8k/train.jsonl --out data/gsm8k-calc/train.parquet
  asyncrl data inspect data/gsm8k/train.parquet --model /models/Qwen2.5-0.5B-Instruct"""

COMMANDS = {"convert-gsm8k": convert_gsm8k_command, "convert-gsm8k-calc": convert_gsm8k_calc_command,
            "inspect": inspect_command}


def data_main(args: list[str]) -> None:
    try:
        tyro.extras.subcommand_cli_from_dict(COMMANDS, prog="asyncrl data", args=args,
                                             description=_DESCRIPTION)
    except ValueError as err:  # data errors name the file, the row and the field
        raise SystemExit(f"asyncrl data: {err}") from None


if __name__ == "__main__":
    data_main(sys.argv[1:])
