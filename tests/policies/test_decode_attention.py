"""The Triton decode-attention kernel (`asyncrl.policies.triton_decode`) against SDPA under a length mask, run by
Triton's interpreter on CPU, and how the engine chooses between them."""

import random

import pytest
import torch

from asyncrl.policies import ARCH_PRESETS, Engine, EngineConfig, SamplingParams, random_model
from asyncrl.policies.decode_attention import decode_attention, sdpa_decode
from tests.policies.helpers import run_kernel_cases
from tests.tolerances import forward_tol

pytest.importorskip("triton")


def _cases() -> list[dict]:
    """Grouped-query shapes of real models (group 1..7, head_dim 64/128, a non-power-of-two 80, a tiny 16), rows
    of length 1 and of the whole bucket, one to several splits per row (empty splits included)."""
    rng = random.Random(0)
    shapes = [(2, 1, 64), (8, 2, 128), (2, 7, 64), (3, 3, 64), (4, 4, 128), (2, 2, 80), (2, 2, 16)]
    cases = []
    for i, (kv_heads, group, dim) in enumerate(shapes):
        batch, max_len = rng.randint(1, 5), rng.choice([40, 130, 300])
        positions = [rng.randrange(max_len) for _ in range(batch)]
        positions[0] = 0
        if batch > 1:
            positions[-1] = max_len - 1
        cases.append(dict(seed=i, batch=batch, kv_heads=kv_heads, group=group, dim=dim, max_len=max_len,
                          positions=positions, block_n=rng.choice([16, 32, 64]), splits=[1, 2, 3, 5][i % 4]))
    return cases


def _width_cases() -> list[dict]:
    """Several queries a slot (a speculative step's newest token and draft, causal among themselves): widths 2..9,
    a slot whose first query sees one position, splits whose keys some queries do not see yet."""
    rng = random.Random(1)
    cases = []
    for i, (kv_heads, group, dim, width) in enumerate([(2, 1, 64, 3), (8, 2, 128, 5), (2, 7, 64, 9), (2, 2, 80, 2)]):
        batch, max_len = rng.randint(1, 4), rng.choice([40, 130, 300])
        positions = [rng.randrange(width - 1, max_len) for _ in range(batch)]
        positions[0] = width - 1  # its first query sees position 0 alone
        cases.append(dict(seed=100 + i, batch=batch, kv_heads=kv_heads, group=group, dim=dim, max_len=max_len,
                          positions=positions, block_n=rng.choice([16, 32]), splits=[1, 3, 5, 2][i], width=width))
    return cases


@pytest.mark.e2e
def test_triton_kernel_with_several_queries_a_slot_matches_causal_attention():
    results = run_kernel_cases("tests.policies.decode_kernel_cases", _width_cases())
    assert len(results) == len(_width_cases())
    for r in results:
        assert r["max_abs_diff"] <= r["atol"], r


def _shared_cases() -> list[dict]:
    """Shared prompts (`--rollout.kv-layout shared-prompt`): groups of 1..11 rows (11: two readers) in scattered
    slots, prompts of 1 position to the whole prompt slot, responses of 1 position to the whole response slot, and
    padding rows that no prompt serves, over real models' head groupings; and groups that read another's prompt
    prefix before their own prompt (`--rollout.share-prefix`)."""
    shapes = [(2, 1, 64, [3, 1]), (8, 2, 128, [11]), (2, 7, 64, [2, 5, 1]), (2, 2, 80, [4, 4])]
    rng = random.Random(2)
    cases = []
    for i, (kv_heads, group, dim, sizes) in enumerate(shapes):
        max_prompt_len = rng.choice([20, 70, 150])
        lengths = [rng.randint(1, max_prompt_len) for _ in sizes]
        lengths[0] = max_prompt_len if i % 2 else 1
        cases.append(dict(seed=200 + i, kv_heads=kv_heads, group=group, dim=dim, groups=sizes, padding=i % 3,
                          prompt_lens=lengths, max_prompt_len=max_prompt_len, max_len=max_prompt_len + 90))
    # requests sharing the first one's prompt prefix (two prompt levels): 9 and 2 rows over 6- and 7-token shares
    cases.append(dict(seed=210, kv_heads=4, group=2, dim=64, groups=[3, 9, 2], padding=1, prompt_lens=[30, 5, 12],
                      max_prompt_len=40, max_len=130, share=6))
    return cases


@pytest.mark.e2e
def test_shared_prompt_kernel_matches_attention_over_the_whole_sequence():
    """The Triton kernel (a prompt read once per reader, merged with each row's responses) and SDPA over the gathered
    prompt, both against float64 attention over each row's sequence."""
    results = run_kernel_cases("tests.policies.decode_kernel_cases", _shared_cases())
    assert len(results) == len(_shared_cases())
    for r in results:
        assert r["max_abs_diff"] <= r["atol"], r
    assert results[-1]["rows_sharing"] == 11  # the second and third groups read the first one's prompt prefix


@pytest.mark.e2e
def test_triton_kernel_matches_sdpa():
    """Under Triton's interpreter on CPU; compiled where a GPU is."""
    results = run_kernel_cases("tests.policies.decode_kernel_cases", _cases())
    assert len(results) == len(_cases())
    for r in results:
        assert r["max_abs_diff"] <= r["atol"], r


def test_auto_takes_sdpa_off_cuda_and_triton_refuses_there():
    assert decode_attention("auto", torch.device("cpu"), torch.float32, 64) is sdpa_decode
    assert decode_attention("sdpa", torch.device("cpu"), torch.float32, 64) is sdpa_decode
    with pytest.raises(ValueError, match="--rollout.decode-attention triton: .*CUDA"):
        decode_attention("triton", torch.device("cpu"), torch.float32, 64)
    with pytest.raises(ValueError, match="decode_attention='flash'"):
        Engine(random_model(ARCH_PRESETS["tiny-qwen2"], seed=0), EngineConfig(decode_attention="flash"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_and_sdpa_engines_sample_the_same_tokens_on_cuda():
    """fp32 (exact dot products in the kernel): both engines sample the same tokens with log-probs equal to fp32
    rounding. Eager pieces: compiled ones of a second engine dtype would spend the process's recompile budget."""
    model = random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.5), seed=1, device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in torch.randint(2, 40, (9,), generator=gen)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=120, ignore_eos=True, seed=5)
    outs = {}
    old, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        for kernel in ("triton", "sdpa"):
            engine = Engine(model, EngineConfig(max_slots=32, max_len=192, attend_bucket=32, decode_attention=kernel,
                                                fused_kernels=False))
            assert engine.decode_kernel == kernel
            outs[kernel] = [c for o in engine.generate(prompts, params) for c in o.completions]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    with torch.no_grad():  # the log-probs' rounding follows the logits' scale
        logits = model.logits(model(torch.tensor([prompts[0] + outs["sdpa"][0].token_ids], device="cuda")))
    atol = forward_tol(logits, model.config)
    for a, b in zip(outs["triton"], outs["sdpa"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= atol
