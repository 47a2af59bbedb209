"""The HF path (`--model.impl hf`): any transformers causal LM trains through `HFCausalLM` with asyncrl's packing,
log-prob head, publication names, checkpoints and exports, and the load-time probes turn off what would train
wrong (tests/hf_zoo.py builds the tiny random models; no download)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from asyncrl.checkpoint import export_hf, load_checkpoint, save_checkpoint
from asyncrl.config import GRPO
from asyncrl.learner import build_learner, full_weights, train_step
from asyncrl.learner.forward import micro_logprobs
from asyncrl.learner.layout import RowLengths, plan_micro_batches
from asyncrl.policies.hf_model import HFCausalLM, checkpoint_names
from asyncrl.policies.hf_probes import attention_probe, head_probe, packing_probe
from asyncrl.policies.loading import load_model
from asyncrl.policies.model_files import safetensors_shapes
from tests.hf_zoo import ATTENTION_ONLY, ZOO
from tests.learner_helpers import on_policy, synthetic_groups, trainer_config
from tests.tolerances import close_tol

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _rows(vocab: int, seed: int = 0):
    """Three right-padded rows of prompt + response tokens, their lengths, and the response width."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses = [4, 6, 3], [5, 2, 7]
    width = max(p + r for p, r in zip(prompts, responses))
    tokens = torch.zeros(3, width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        tokens[i, :p + r] = torch.randint(3, vocab, (p + r,), generator=gen)
    return tokens, RowLengths(prompts, responses, width), max(responses)


def _reference_logprobs(model: HFCausalLM, tokens, lengths, width) -> torch.Tensor:
    """log softmax of the transformers model's own logits at each response token, one row at a time: [3, T]."""
    out = torch.zeros(len(lengths.prompt), width)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(lengths.prompt, lengths.response)):
            ids = tokens[i:i + 1, :p + r]
            logits = model.hf(input_ids=ids, use_cache=False).logits.float()
            out[i, :r] = torch.log_softmax(logits, -1)[0, p - 1:p + r - 1].gather(-1, ids[0, p:, None])[:, 0]
    return out


@pytest.mark.parametrize("model_type", list(ZOO))
def test_logprobs_packed_and_padded_equal_the_transformers_model(hf_zoo, model_type):
    model = load_model(str(hf_zoo(model_type)))
    assert isinstance(model, HFCausalLM) and model.config.model_type == model_type
    tokens, lengths, width = _rows(model.config.vocab_size)
    want = _reference_logprobs(model, tokens, lengths, width)
    for packed in (True, False):
        micro, = plan_micro_batches(tokens, [[0, 1, 2]], lengths, packed=packed)
        with torch.no_grad():
            got, _ = micro_logprobs(model, micro, width)
        mask = torch.arange(width)[None] < torch.tensor(lengths.response)[:, None]
        tol = close_tol(torch.float32, want.abs().max(), terms=model.config.hidden_size, depth=4)
        assert float((got - want)[mask].abs().max()) <= tol, (model_type, packed)


def test_probe_verdicts_packing_off_for_the_hybrid_and_plain_head_for_softcapped_logits(hf_zoo, caplog):
    for model_type in ATTENTION_ONLY:
        features = load_model(str(hf_zoo(model_type))).features
        assert features.packing and features.document_attention, (model_type, features)
        assert features.fused_head == (model_type != "gemma2"), model_type
    with caplog.at_level(logging.WARNING, logger="asyncrl.policies.hf_probes"):
        hybrid = load_model(str(hf_zoo("qwen3_5_text")))
    assert not hybrid.features.packing and hybrid.features.document_attention
    assert "packing probe" in hybrid.features.reasons[0]
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncrl.policies.hf_probes"]
    assert len(lines) == 1 and "qwen3_5_text: packing off" in lines[0]  # one line that says why


def test_granite_logit_scaling_folds_into_the_temperature(hf_zoo):
    model = load_model(str(hf_zoo("granite")))
    assert model.logit_scale == pytest.approx(1 / ZOO["granite"]["logits_scaling"])
    assert head_probe(model).ok


def test_a_logit_transform_the_head_does_not_know_is_refused(hf_zoo, monkeypatch):
    from asyncrl.policies import hf_model
    monkeypatch.setattr(hf_model, "_logit_transform", lambda text: (1.0, None))  # granite's scaling ignored
    with pytest.raises(ValueError, match="granite: its logits are not lm_head.*head probe"):
        load_model(str(hf_zoo("granite")))


def test_the_attention_probe_catches_dropped_attention_sinks(hf_zoo, monkeypatch):
    # gpt-oss's sinks take part of each softmax; an attention that drops them (as SDPA would) must not pass
    model = load_model(str(hf_zoo("gpt_oss")))
    assert attention_probe(model).ok
    from asyncrl.policies import hf_attention
    real = hf_attention.document_attention
    monkeypatch.setattr(hf_attention, "_eager", lambda q, k, v, scaling, window, softcap, sinks, dropout:
                        hf_attention._sdpa(q, k, v, scaling, window, dropout))
    hf_attention.register_document_attention()
    try:
        with torch.no_grad():
            assert not attention_probe(model).ok
    finally:
        monkeypatch.setattr(hf_attention, "document_attention", real)
        hf_attention.register_document_attention()


def test_a_kv_cache_would_defeat_position_id_packing(hf_zoo):
    # why HFCausalLM passes use_cache=False: with a cache, transformers' own SDPA path sees no packed sequences
    model = load_model(str(hf_zoo("qwen3_moe")))
    model.use_native_attention()
    docs = [torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 5)]
    positions = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        alone = model.hf(input_ids=docs[1], use_cache=False).logits[0]
        cached = model.hf(input_ids=torch.cat(docs, 1), position_ids=positions, use_cache=True).logits[0, 7:]
        uncached = model.hf(input_ids=torch.cat(docs, 1), position_ids=positions, use_cache=False).logits[0, 7:]
    assert float((cached - alone).abs().max()) > 1e-3 > float((uncached - alone).abs().max())
    assert packing_probe(load_model(str(hf_zoo("qwen3_moe")))).ok


@pytest.mark.parametrize("model_type", list(ZOO))
def test_published_names_and_shapes_are_the_checkpoints(hf_zoo, model_type):
    path = hf_zoo(model_type)
    model = load_model(str(path))
    header = safetensors_shapes(path)
    if model.config.tie_word_embeddings:
        header.pop("lm_head.weight", None)
    assert dict(checkpoint_names(model)) == header
    published = dict(full_weights(model))
    assert {n: tuple(t.shape) for n, t in published.items()} == header
    if model_type == "qwen3_moe":  # fused [E, 2I, H] in memory, per expert in the checkpoint and publications
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in published
        assert not any(n.endswith("experts.gate_up_proj") for n in published)


def _learner(model_type, hf_zoo, seed=0):
    policy = load_model(str(hf_zoo(model_type)))
    return build_learner(policy, trainer_config(lr=1e-2), GRPO())


@pytest.mark.parametrize("model_type", ["gemma3_text", "phi3", "olmo2", "granite", "glm4", "qwen3_5_text", "qwen3_next",
                                        "qwen3_moe", "gemma2"])
def test_a_grpo_step_changes_the_weights_and_a_checkpoint_resumes_and_exports(hf_zoo, tmp_path, model_type):
    import transformers
    state = _learner(model_type, hf_zoo)
    before = {n: t.clone() for n, t in state.policy.state_dict().items()}
    groups = on_policy(state.policy, synthetic_groups(2, 4, seed=1, response_lens=(2, 6)))
    _, metrics = train_step(state, groups)
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values() if isinstance(v, (int, float)))
    changed = [n for n, t in state.policy.state_dict().items() if not torch.equal(t, before[n])]
    assert len(changed) > len(before) // 2, changed

    ckpt = save_checkpoint(tmp_path / "run", state)
    resumed = _learner(model_type, hf_zoo)
    load_checkpoint(ckpt, resumed)
    for name, tensor in state.policy.state_dict().items():
        assert torch.equal(resumed.policy.state_dict()[name], tensor), name
    assert resumed.step == state.step

    ids = torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = state.policy.logits(state.policy(ids))
    for out in (export_hf(state, tmp_path / "live"), export_hf(ckpt, tmp_path / "from_checkpoint")):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        assert hf.config.model_type == model_type
        with torch.no_grad():
            got = hf(ids, use_cache=False).logits
        tol = close_tol(torch.float32, want.abs().max(), terms=state.policy.config.hidden_size, depth=4)
        assert float((got - want).abs().max()) <= tol


def test_the_ppo_critic_is_refused_on_the_hf_path(hf_zoo):
    from asyncrl.config import PPO
    with pytest.raises(ValueError, match="PPO critic runs on asyncrl's own models only"):
        build_learner(load_model(str(hf_zoo("olmo2"))), trainer_config(), PPO())


def test_own_types_keep_the_own_model_unless_hf_is_asked(tmp_path):
    from asyncrl.policies import CausalLM, save_pretrained
    from tests.learner_helpers import tiny_policy
    own = tiny_policy()
    path = save_pretrained(own, tmp_path / "qwen2")
    assert isinstance(load_model(str(path)), CausalLM)
    hf = load_model(str(path), impl="hf")
    assert isinstance(hf, HFCausalLM) and hf.features.packing
    tokens, lengths, width = _rows(own.config.vocab_size)
    micro, = plan_micro_batches(tokens, [[0, 1, 2]], lengths, packed=True)
    with torch.no_grad():
        a, _ = micro_logprobs(own, micro, width)
        b, _ = micro_logprobs(hf, micro, width)
    assert float((a - b).abs().max()) <= close_tol(torch.float32, a.abs().max(), terms=64, depth=4)
    assert dataclasses.asdict(hf.config)["impl"] == "hf"


def test_asyncrl_eval_refuses_an_hf_path_checkpoint_with_the_reason(hf_zoo, tmp_path):
    from asyncrl.config import DataConfig
    from asyncrl.evaluate import evaluate
    ckpt = save_checkpoint(tmp_path / "run", _learner("olmo2", hf_zoo))
    with pytest.raises(ValueError, match="olmo2 model trains through transformers.*--eval"):
        evaluate(str(ckpt), DataConfig(task="toy"), num_prompts=1, n=1, max_new_tokens=2)


def test_recomputing_layers_in_the_backward_gives_the_same_step(hf_zoo):
    """--trainer.gradient-checkpointing on the HF path: transformers' own (non-reentrant) recompute of each decoder
    layer; the step's weights equal those of the step that kept every activation."""
    results = []
    for checkpointing in (False, True):
        policy = load_model(str(hf_zoo("gemma3_text")))
        state = build_learner(policy, trainer_config(lr=1e-2, gradient_checkpointing=checkpointing), GRPO())
        assert policy.gradient_checkpointing == checkpointing
        layers_recompute = [getattr(block, "gradient_checkpointing", False) for block in policy.blocks()]
        assert layers_recompute == [checkpointing] * len(policy.blocks())  # transformers' flag on each layer
        state, _ = train_step(state, on_policy(policy, synthetic_groups(2, 4, seed=5, response_lens=(2, 6))))
        results.append({n: t.clone() for n, t in state.policy.state_dict().items()})
    for name, tensor in results[0].items():
        torch.testing.assert_close(results[1][name], tensor, rtol=0, atol=1e-6, msg=name)
