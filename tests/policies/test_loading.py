"""`asyncrl.policies.loading`: the packaged SmolLM2 GGUF, save/load round trips, transformers interop,
tokenizer, random presets, `named_weights`, error messages."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from asyncrl.policies import (
    ARCH_PRESETS, CausalLM, Engine, EngineConfig, SamplingParams, load_gguf, load_model, load_pretrained,
    load_tokenizer, named_weights, random_model, save_pretrained, smollm2_gguf_path,
)
from asyncrl.policies.loading import empty_model, gguf_cache_dir, resolve_model_dir
from tests.policies.helpers import forward_logprobs, logprob_tol, make_prompts, tiny_config, tiny_model
from tests.tolerances import forward_tol


@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


# ---------------------------------------------------------------------------------------------- SmolLM2
@pytest.mark.slow
def test_smollm2_loads_and_is_cached(smollm2, smollm2_cache):
    assert isinstance(smollm2, CausalLM) and not smollm2.training
    cfg = smollm2.config
    assert (cfg.model_type, cfg.vocab_size, cfg.num_layers, cfg.hidden_size) == ("llama", 49152, 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_word_embeddings) == (9, 3, 64, True)
    assert smollm2.dtype == torch.float32 and smollm2.lm_head.weight is smollm2.model.embed_tokens.weight
    cached = gguf_cache_dir(smollm2_gguf_path())
    assert str(cached).startswith(str(smollm2_cache))  # the fixture's private cache, not ~/.cache
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (cached / name).is_file(), name
    assert resolve_model_dir(smollm2_gguf_path()) == cached
    # the second load reads the converted copy (save_pretrained → load_pretrained) and is identical
    again = load_model("smollm2")
    assert again is not smollm2
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314]])
    with torch.no_grad():
        assert torch.equal(again.logits(again(ids)), smollm2.logits(smollm2(ids)))
    assert torch.equal(load_gguf(smollm2_gguf_path(), dtype=torch.bfloat16).model.norm.weight,
                       smollm2.model.norm.weight.bfloat16())


@pytest.mark.slow
def test_smollm2_transformers_tokenizer_and_engine_agree(smollm2, transformers):
    cached = gguf_cache_dir(smollm2_gguf_path())
    tok = load_tokenizer(str(smollm2_gguf_path()))
    assert load_tokenizer(cached).get_vocab() == tok.get_vocab()
    text = "The capital of France is"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(cached), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        ours, theirs = smollm2.logits(smollm2(x)), hf(x).logits
    # logits up to ~31: measured 4e-5, the tolerance ~1.4e-3, a structural difference O(0.1..1)
    diff, atol = (ours - theirs).abs().max().item(), forward_tol(theirs, smollm2.config)
    assert diff <= atol, f"SmolLM2: our logits vs transformers' differ by {diff:.3g} > {atol:.3g}"
    engine = Engine(smollm2, EngineConfig(max_slots=2, max_len=64))
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=8))[0].completions[0]
    with torch.no_grad():
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8)[0, len(ids):]
    assert out.token_ids == ref.tolist()[:len(out.token_ids)]
    assert "Paris" in tok.decode(out.token_ids)
    torch.testing.assert_close(torch.tensor(out.logprobs), forward_logprobs(smollm2, ids, out.token_ids),
                               atol=logprob_tol(smollm2, ids, out.token_ids), rtol=0)


def test_smollm2_path_and_missing_gguf(tmp_path):
    path = smollm2_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    with pytest.raises(ValueError, match="no such GGUF"):
        load_gguf(tmp_path / "missing.gguf")


# ------------------------------------------------------------------------------------ save / load, interop
@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip_and_transformers_open_it(tmp_path, tied, transformers):
    model = tiny_model(seed=1, perturb=True, tie_word_embeddings=tied)
    out = save_pretrained(model, tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["dtype"] == "float32"
    loaded = load_pretrained(out)
    assert not loaded.training
    assert dataclasses.replace(loaded.config, hf_config={}) == dataclasses.replace(model.config, hf_config={})
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert torch.equal(loaded.model.rope_inv_freq, model.model.rope_inv_freq)
    assert load_model(str(out)).state_dict().keys() == model.state_dict().keys()
    ids = torch.tensor(make_prompts([40, 40], seed=2))
    with torch.no_grad():
        ref = model.logits(model(ids))
        assert torch.equal(loaded.logits(loaded(ids)), ref)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        diff = (hf(ids).logits - ref).abs().max().item()
    assert diff <= forward_tol(ref, model.config)  # ~3e-4 at init 0.5; a dropped bias or norm is O(0.1..1)
    # every HF parameter name is one of ours (update_weights relies on it)
    hf_names = set(hf.state_dict()) - ({"lm_head.weight"} if tied else set())
    assert {n for n, _ in named_weights(model)} == hf_names
    # bfloat16 on disk, float32 in memory
    half = save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    from_bf16 = load_pretrained(half)
    assert from_bf16.dtype == torch.float32
    assert torch.equal(from_bf16.model.norm.weight, model.model.norm.weight.bfloat16().float())


@pytest.mark.parametrize("tied", [False, True])
def test_an_empty_model_has_the_shapes_and_buffers_of_the_built_one_and_takes_its_weights(tmp_path, tied):
    """`empty_model` (a failover's learner, which a restore point fills): the loaded or drawn model's parameters,
    dtypes, tying and buffers, without its weights; given them, it computes what the built model does."""
    model = tiny_model(seed=1, perturb=True, tie_word_embeddings=tied)
    out = save_pretrained(model, tmp_path / "m")
    for built, empty in ((load_pretrained(out), empty_model(str(out), cast_buffers=False)),
                         (random_model("tiny-qwen2", dtype=torch.bfloat16),
                          empty_model("tiny-qwen2", dtype=torch.bfloat16))):
        assert [(n, p.shape, p.dtype) for n, p in empty.named_parameters()] == \
            [(n, p.shape, p.dtype) for n, p in built.named_parameters()]
        assert (empty.lm_head.weight is empty.model.embed_tokens.weight) == \
            (built.lm_head.weight is built.model.embed_tokens.weight)
        assert all(b.dtype == built.get_buffer(n).dtype and torch.equal(b, built.get_buffer(n))
                   for n, b in empty.named_buffers())
        assert not empty.training
        with torch.no_grad():
            for name, p in empty.named_parameters():
                p.copy_(built.get_parameter(name))
            ids = torch.tensor(make_prompts([12, 12], seed=2))
            assert torch.equal(empty.logits(empty(ids)), built.logits(built(ids)))


def test_llama3_rope_config_round_trips(tmp_path):
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)
    model = tiny_model(seed=2, model_type="llama", rope_scaling=rope)
    loaded = load_pretrained(save_pretrained(model, tmp_path))
    assert loaded.config.rope_scaling == rope
    assert torch.equal(loaded.model.rope_inv_freq, model.model.rope_inv_freq)
    # transformers >= 5 writes rope_parameters (with rope_theta inside): read it the same way
    cfg = tiny_config("llama", rope_parameters=dict(rope, rope_theta=5000.0))
    m2 = random_model(cfg)
    assert m2.config.rope_theta == 5000.0 and m2.config.rope_scaling == rope


def test_random_models_and_presets():
    a = load_model("random:tiny-qwen2", seed=3)
    b = random_model("tiny-qwen2", seed=3)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)
    c = random_model("tiny-qwen2", seed=4)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert abs(a.model.embed_tokens.weight.std().item() - 0.02) < 0.002  # HF's default init scale
    assert torch.equal(a.model.norm.weight, torch.ones(64))
    assert torch.equal(a.model.layers[0].self_attn.q_proj.bias, torch.zeros(64))
    assert random_model("tiny-qwen2", dtype=torch.bfloat16).dtype == torch.bfloat16
    for name, preset in ARCH_PRESETS.items():
        from asyncrl.policies import TransformerConfig
        cfg = TransformerConfig.from_hf(preset)
        assert cfg.vocab_size == preset["vocab_size"] and cfg.num_layers == preset["num_hidden_layers"], name
    smol = TransformerConfig.from_hf(ARCH_PRESETS["smollm2-135m"])
    assert 130e6 < smol.num_params_estimate < 140e6


def test_loading_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="not a preset"):
        load_model("random:no-such-preset")
    model = tiny_model(seed=5)
    out = save_pretrained(model, tmp_path / "m")
    os.remove(out / "model.safetensors")
    with pytest.raises(ValueError, match="safetensors"):
        load_pretrained(out)
    # weights of another architecture: named missing / unexpected keys
    save_pretrained(tiny_model(seed=5, model_type="llama"), tmp_path / "llama")
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    cfg["model_type"] = "qwen2"  # qwen2 expects q/k/v biases that a llama checkpoint lacks
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_pretrained(tmp_path / "llama")
