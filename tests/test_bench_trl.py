"""scripts/bench_trl.py: a 2-step TRL GRPO run of a tiny random Llama on GSM8K writes its JSON summary.
Skipped where TRL is not installed (it is not a project dependency)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.run_helpers import ROOT

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama with SmolLM2's tokenizer (and chat template), saved as an HF directory."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from asyncrl.policies.loading import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.slow
def test_bench_trl_smoke(tiny_model_dir, gsm8k_test_file, tmp_path):
    target = tmp_path / "trl.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_trl.py"), "--model", str(tiny_model_dir),
           "--data", str(gsm8k_test_file), "--steps", "2", "--prompts-per-step", "2", "--n", "2",
           "--max-completion-length", "16", "--out", str(target)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(target.read_text())
    assert result["tool"] == "trl" and result["world_size"] == 1 and result["device"] == "cpu"
    assert len(result["steps"]) == 2 and result["time_per_step_s"] == result["steps"][1] > 0
    assert result["config"]["completions_per_step"] == 4 and result["config"]["gradient_accumulation_steps"] == 1
    for length, tokens, total in zip(result["mean_completion_length"], result["completion_tokens"],
                                     result["total_tokens"]):
        assert 0 < length <= 16 and tokens == round(4 * length) and total > tokens
    assert result["completion_tokens_per_s"] > 0 and result["total_tokens_per_s"] > result["completion_tokens_per_s"]
    assert all(0.0 <= r <= 1.0 for r in result["reward_mean"])
    assert "s/step" in out.stdout
