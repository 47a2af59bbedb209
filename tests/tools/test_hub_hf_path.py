"""A model asyncrl does not implement itself, named by its Hub name (ORG/NAME, from the local Hugging Face cache):
the checks before launch resolve the name, take the HF path (--model.impl auto) and vLLM (--rollout.backend auto),
and the spec the run launches builds the transformers model and serves vLLM the snapshot directory itself."""

from __future__ import annotations

import pytest
import tyro

from asyncrl.config import RunConfig
from asyncrl.config.presets import PRESETS
from asyncrl.launch.preflight import preflight
from tests.hf_zoo import save_tiny
from tests.hub_helpers import COMMIT_A, snapshot
from tests.run_helpers import needs_vllm

NO_EVAL = ["--eval.every-versions", "0", "--eval.no-at-start", "--eval.no-at-end"]


@pytest.fixture
def gemma_hub(tmp_path, monkeypatch, smollm2_tokenizer):
    home = tmp_path / "hf-home"
    directory = save_tiny("gemma3_text", snapshot(home, "model", "acme/tiny-gemma3", COMMIT_A),
                          vocab_size=len(smollm2_tokenizer))
    smollm2_tokenizer.save_pretrained(str(directory))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return directory


def test_a_gemma3_hub_name_takes_the_hf_path_and_vllm(gemma_hub, tmp_path):
    needs_vllm()
    args = ["--wandb", "off", *NO_EVAL, "--model.path", "acme/tiny-gemma3", "--run-dir", str(tmp_path / "run")]
    cfg = tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1], args=args)
    report = preflight(cfg)
    assert report.ok, report.problems
    assert report.config.model.path.endswith(f"snapshots/{COMMIT_A}")
    facts = "\n".join(report.facts)
    assert "trains through transformers, --model.impl hf" in facts and "engine: vLLM" in facts
    spec = report.spec
    assert spec.model.impl == "hf" and spec.agents[0].engine_factory.func.__name__ == "build_vllm_engine"
    policy = spec.model.build()
    assert type(policy).__name__ == "HFCausalLM" and policy.config.model_type == "gemma3_text"
    assert spec.model.directory("cpu", "float32").path == report.config.model.path  # vLLM loads the snapshot itself
