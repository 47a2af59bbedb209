"""scripts/moe_shapes.py --weights: a random bf16 HF directory of a MoE shape, with the checkpoint's names, that
transformers and asyncrl's loader open, the same for the same seed."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from asyncrl.policies.loading import safetensors_files
from scripts.moe_shapes import SHAPES, write_random_weights


def _tiny() -> dict:
    return {**SHAPES["qwen3-30b-a3b"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
            "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2}


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in safetensors_files(path):
        with safe_open(str(file), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def test_random_weights_are_a_bf16_checkpoint_with_per_expert_names_and_seeded(tmp_path):
    from transformers import AutoModelForCausalLM
    config = _tiny()
    a = _tensors(write_random_weights(config, tmp_path / "a", seed=3, shard_gb=0.0001))  # several shards
    assert len(safetensors_files(tmp_path / "a")) > 1
    assert {t.dtype for t in a.values()} == {torch.bfloat16}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in a and "model.layers.0.mlp.gate.weight" in a
    saved = json.loads((tmp_path / "a" / "config.json").read_text())  # transformers names it num_local_experts
    assert saved["model_type"] == "qwen3_moe" and saved["num_hidden_layers"] == 2 and saved["dtype"] == "bfloat16"
    b = _tensors(write_random_weights(config, tmp_path / "b", seed=3))
    c = _tensors(write_random_weights(config, tmp_path / "c", seed=4))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("down_proj.weight"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), dtype=torch.bfloat16)
    assert torch.equal(dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"],
                       a["model.layers.0.self_attn.q_proj.weight"])
