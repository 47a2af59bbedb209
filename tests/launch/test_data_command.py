"""`asyncrl data` end to end in subprocesses: help, convert-gsm8k, inspect, and error exits; the GSM8K preset
refusing its placeholder model path before it writes anything (the data path: test_sources)."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.cli_forks import cli_forks, run
from tests.timing import limit

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _asyncrl(*args, timeout=limit(120)):
    # the environment (ASYNCRL_CACHE from the session fixture) is inherited
    return run(list(args), cwd=ROOT, timeout=timeout)


def _help(capsys, *args) -> str:
    """`asyncrl ARGS --help` in this process (the parsing is tyro's, as in the subprocess)."""
    from asyncrl.cli import main
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--help"])
    assert exit_.value.code in (0, None)
    return capsys.readouterr().out


def test_help_reads(capsys):
    out = _asyncrl("data", "--help")  # one in a process of its own, as a user runs it
    assert out.returncode == 0, out.stderr
    assert "convert-gsm8k" in out.stdout and "inspect" in out.stdout
    text = _help(capsys, "data", "convert-gsm8k")
    assert "--src PATH" in text and "--out PATH" in text and "Let's think step by step" in text
    text = _help(capsys, "data", "inspect")
    for word in ("PATH", "--model", "--max-prompt-length", "--system-prompt"):
        assert word in text


def test_convert_then_inspect(tmp_path, gsm8k_test_file, smollm2_tokenizer):
    # the fixture converts SmolLM2 into the session cache, which the subprocess reuses
    out_file = tmp_path / "gsm8k" / "test.parquet"
    converted, out = cli_forks([["data", "convert-gsm8k", "--src", gsm8k_test_file, "--out", out_file],
                                ["data", "inspect", out_file, "--model", "smollm2", "--max-prompt-length", "100"]],
                               cwd=ROOT)
    assert converted.returncode == 0, converted.stderr
    assert f"wrote 1319 rows to {out_file}" in converted.stdout and out_file.is_file()

    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"{out_file}: 1319 rows" in text
    assert "data sources: openai/gsm8k (1319)" in text
    assert "prompt tokens (smollm2): min " in text and "p50 " in text and "p99 " in text
    # GSM8K's median prompt is ~103 SmolLM2 tokens, so about half exceed 100
    too_long = int(text.split("longer than --max-prompt-length 100: ")[1].split(" rows")[0])
    assert 300 < too_long < 1000
    assert text.count("--- row ") == 2 and "--- row 0: data_source 'openai/gsm8k', ground truth '18'" in text
    assert "<|im_start|>user\nJanet" in text


def test_errors_exit_with_the_location(tmp_path):
    src = tmp_path / "src.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n{broken\n")
    out = _asyncrl("data", "convert-gsm8k", "--src", src, "--out", tmp_path / "out.jsonl")
    assert out.returncode == 1
    assert f"asyncrl data: {src}:2: not valid JSON" in out.stderr and "Traceback" not in out.stderr


def test_gsm8k_preset_refuses_placeholders_before_writing(tmp_path):
    run_dir = tmp_path / "run"
    out = _asyncrl("train", "gsm8k-qwen2.5-0.5b", "--wandb", "off", "--run-dir", run_dir)
    assert out.returncode != 0
    assert "--model.path <path to Qwen2.5-0.5B-Instruct> is invalid" in out.stderr and "--model.path" in out.stderr
    assert not run_dir.exists()
