"""A float8 K/V cache (`--rollout.kv-dtype fp8`, asyncrl/policies/kv_cache.py): half a bf16 cache's bytes; decode
attention over it close to the full-precision cache's (fp8 e4m3 keeps 3 mantissa bits) and never NaN past e4m3's
range; the embedded engine generates with it, its behaviour log-probs off the training forward by more than fp32's
round-off but by little; the launch checks ask for the recomputed π_old that corrects the mismatch, and refuse vLLM's
fp8 cache on CPU; the memory check counts one byte an element."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.policies import Engine, EngineConfig, SamplingParams, random_model, token_logprobs
from asyncrl.policies.kv_cache import FP8_MAX, KVCache, kv_storage


def _cache(storage):
    return KVCache(2, 3, 2, 16, 8, torch.float32, "cpu", storage=storage)


def test_an_fp8_cache_holds_a_byte_an_element_and_attends_close_to_the_full_one():
    gen = torch.Generator().manual_seed(0)
    full, fp8 = _cache(None), _cache(kv_storage("fp8", torch.float32))
    assert fp8.k.dtype == torch.float8_e4m3fn and fp8.nbytes * 4 == full.nbytes
    assert kv_storage("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="--rollout.kv-dtype int4"):
        kv_storage("int4", torch.float32)
    k, v = (torch.randn(3, 2, 10, 8, generator=gen) for _ in range(2))
    q = torch.randn(3, 4, 1, 8, generator=gen)
    slots, positions = torch.arange(3), torch.tensor([9, 4, 7])
    outs = []
    for cache in (full, fp8):
        cache.write_prefill(0, slots, k, v)
        nk, nv = (torch.randn(3, 2, 1, 8, generator=torch.Generator().manual_seed(1)) for _ in range(2))
        outs.append(cache.attend_decode(0, q, nk, nv, positions))
    error = (outs[1] - outs[0]).abs().max() / outs[0].abs().max()
    assert 0 < error < 0.1, float(error)  # rounded, by e4m3's precision at most
    span_k, _ = fp8.write_extend(1, slots, torch.zeros(3, 1, dtype=torch.long), k[:, :, :1] * 1e4, v[:, :, :1], 4)
    assert span_k.dtype == torch.float32 and torch.isfinite(span_k).all()  # saturated at ±448, not NaN
    assert float(span_k.abs().max()) == FP8_MAX


def test_the_engine_generates_from_an_fp8_cache_with_a_small_mismatch():
    model = random_model("tiny-qwen2", dtype=torch.float32)
    prompts = [[3, 5, 7, 11], [13, 17, 19]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=4)
    mismatch = {}
    for kv in ("auto", "fp8"):
        engine = Engine(model, EngineConfig(max_slots=4, max_len=32, kv_dtype=kv))
        outs = engine.generate(prompts, params)
        diffs = []
        for out in outs:
            for c in out.completions:
                seq = torch.tensor([out.prompt_ids + c.token_ids])
                with torch.inference_mode():
                    logits = model.logits(model(seq))[0, len(out.prompt_ids) - 1:-1]
                diffs.append((torch.tensor(c.logprobs) - token_logprobs(logits, seq[0, len(out.prompt_ids):])).abs())
        assert all(len(c.token_ids) == 12 for out in outs for c in out.completions)
        mismatch[kv] = float(torch.cat(diffs).mean())
    assert mismatch["auto"] < 1e-4 < mismatch["fp8"] < 0.1, mismatch
    with pytest.raises(ValueError, match="kv_dtype='fp16'"):
        EngineConfig(kv_dtype="fp16").validate()


def _problems(**changes):
    from asyncrl.config.presets import CPU_DEMO
    from asyncrl.launch.model_checks import implementation_problems
    rollout = dataclasses.replace(CPU_DEMO.rollout, kv_dtype="fp8", **changes.pop("rollout", {}))
    cfg = dataclasses.replace(CPU_DEMO, rollout=rollout, **changes)
    return [p for p in implementation_problems(cfg) if p.startswith("--rollout.kv-dtype fp8")]


def test_fp8_kv_asks_for_a_recomputed_pi_old_and_refuses_vllm_on_cpu():
    from asyncrl.config import OffPolicyConfig
    from asyncrl.config.presets import CPU_DEMO
    (recompute,) = _problems()
    assert "--trainer.off-policy.no-use-rollout-log-probs" in recompute
    trainer = dataclasses.replace(CPU_DEMO.trainer, off_policy=OffPolicyConfig(use_rollout_log_probs=False))
    assert _problems(trainer=trainer) == []
    (vllm,) = _problems(trainer=trainer, rollout=dict(backend="vllm"))
    assert "vLLM runs on GPUs" in vllm and "--rollout.backend asyncrl" in vllm


def test_the_memory_check_counts_a_byte_an_fp8_element():
    from asyncrl.config.presets import CPU_DEMO
    from asyncrl.launch.memory_checks import _engine
    from asyncrl.planning.predict import ModelShape
    from asyncrl.policies.model_configs import hf_config
    shape = ModelShape.from_hf(hf_config("qwen2.5-0.5b"))
    bf16 = dataclasses.replace(CPU_DEMO, model=dataclasses.replace(CPU_DEMO.model, engine_dtype="bfloat16"))
    fp8 = dataclasses.replace(bf16, rollout=dataclasses.replace(bf16.rollout, kv_dtype="fp8"))
    a, b = _engine(bf16, shape, 64), _engine(fp8, shape, 64)
    assert b.kv_cache * 2 == a.kv_cache and b.weights == a.weights


def test_the_run_spec_gives_the_engine_its_kv_dtype():
    from asyncrl.config.presets import CPU_DEMO
    from asyncrl.launch.run_spec import build_spec
    cfg = dataclasses.replace(CPU_DEMO, rollout=dataclasses.replace(CPU_DEMO.rollout, kv_dtype="fp8"))
    spec = build_spec(cfg)
    assert spec.engine_config(spec.agents[0], 0).kv_dtype == "fp8"
