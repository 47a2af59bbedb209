"""CUDA variants of the engine checks: CUDA-graph decode vs eager decode, logprobs vs the training forward,
in-place weight updates seen by captured graphs. Skipped without a GPU (CI has none; run on a lent GPU)."""

import copy

import pytest
import torch

from asyncrl.policies import (
    ARCH_PRESETS, Engine, EngineConfig, SamplingParams, named_weights, random_model, token_logprobs,
)
from tests.policies.helpers import drain_across_an_update, logprob_tol

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CONFIG = dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.5)


@pytest.fixture(autouse=True)
def _exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(l),), generator=gen).tolist()
            for l in torch.randint(2, 20, (n,), generator=gen)]


def test_graph_decode_matches_eager_decode():
    model = random_model(CONFIG, seed=1, device="cuda")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=3)
    prompts = _prompts(7)
    outs = {}
    for graphs in (True, False):
        engine = Engine(model, EngineConfig(max_slots=8, max_len=64, attend_bucket=16, cuda_graphs=graphs))
        outs[graphs] = engine.generate(prompts, params)
    for a, b in zip(outs[True], outs[False]):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.token_ids == cb.token_ids, "graph replay sampled different tokens than eager decode"
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-4


def test_decode_ahead_with_graphs_samples_what_one_step_at_a_time_does():
    """The real overlap: captured graphs fed from device-resident rows, pinned copies and events; EOS on, more
    samples than slots (rows finish while a step is in flight, slots are moved and refilled)."""
    model = random_model(CONFIG, seed=4, device="cuda")
    prompts = _prompts(12, seed=5)
    params = [SamplingParams(n=1 + i % 2, temperature=0.9, max_new_tokens=40 + 2 * i, seed=i) for i in range(12)]
    outs = {}
    for ahead in (True, False):
        engine = Engine(model, EngineConfig(max_slots=8, max_len=96, attend_bucket=16, decode_ahead=ahead))
        outs[ahead] = engine.generate(prompts, params)
    stops = 0
    for a, b in zip(outs[True], outs[False]):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.token_ids == cb.token_ids and ca.finish_reason == cb.finish_reason
            assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs)) < 1e-4
            stops += ca.finish_reason == "stop"
    assert stops > 0, "no row stopped at EOS: rows finishing in flight went untested"


def test_cuda_engine_logprobs_match_training_forward():
    model = random_model(CONFIG, seed=2, device="cuda")
    engine = Engine(model, EngineConfig(max_slots=16, max_len=80, attend_bucket=16))
    outs = engine.generate(_prompts(5, seed=1), SamplingParams(n=3, temperature=0.8, max_new_tokens=50, seed=1))
    worst = 0.0
    for out in outs:
        for c in out.completions:
            seq = torch.tensor([out.prompt_ids + c.token_ids], device="cuda")
            with torch.no_grad():
                logits = model.logits(model(seq))[0, len(out.prompt_ids) - 1:-1]
            train = token_logprobs(logits, seq[0, len(out.prompt_ids):], temperature=0.8)
            worst = max(worst, (train - torch.tensor(c.logprobs, device="cuda")).abs().max().item())
    # fp32 without TF32; decode (masked SDPA over the cache) and the training forward (causal SDPA) use
    # different attention kernels, and this model's logits are large (init std 0.5): allow 5e-4
    assert worst <= 5e-4, f"engine vs training forward max |Δlogp| = {worst}"


def test_update_weights_reaches_captured_graphs():
    old, new = random_model(CONFIG, seed=3, device="cuda"), random_model(CONFIG, seed=4, device="cuda")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    prompts = _prompts(4, seed=2)
    engine = Engine(old, EngineConfig(max_slots=8, max_len=64, attend_bucket=16))
    engine.generate(prompts, greedy)  # capture graphs with the old weights
    engine.update_weights(named_weights(new), version=1)
    after = engine.generate(prompts, greedy)
    fresh = Engine(random_model(CONFIG, seed=4, device="cuda"), EngineConfig(max_slots=8, max_len=64,
                                                                             attend_bucket=16))
    expected = fresh.generate(prompts, greedy)
    assert [o.completions[0].token_ids for o in after] == [o.completions[0].token_ids for o in expected]
    assert all(v == 1 for o in after for v in o.completions[0].versions)


def test_sleep_wake_recaptures_graphs():
    model = random_model(CONFIG, seed=5, device="cuda")
    engine = Engine(model, EngineConfig(max_slots=8, max_len=64, attend_bucket=16))
    params = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True, seed=9)
    prompts = _prompts(3, seed=3)
    reference = engine.generate(prompts, params)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(5):
        engine.step()
    engine.sleep()
    assert not engine.cache.allocated and engine.step() == []
    engine.wake_up()
    done = {}
    while len(done) < len(ids):
        done.update({o.request_id: o for o in engine.step()})
    for rid, ref in zip(ids, reference):
        assert done[rid].completions[0].token_ids == ref.completions[0].token_ids


def test_capture_while_another_thread_copies_to_host_and_allocates():
    """Colocated runs decode on one thread while the trainer's thread works on the same GPU (a checkpoint
    gathers weights to host memory): a graph captured meanwhile must neither fail nor break the other thread."""
    import threading

    model = random_model(CONFIG, seed=4, device="cuda")
    engine = Engine(model, EngineConfig(max_slots=64, max_len=96, attend_bucket=16))
    weights = [torch.randn(256, 256, device="cuda") for _ in range(32)]
    stop, errors, copies = threading.Event(), [], [0]

    def trainer_like():
        try:
            while not stop.is_set():
                for w in weights:
                    _ = w.cpu()                                  # device-to-host copy, synchronising
                    _ = torch.empty(1 << 20, device="cuda")      # an allocation
                copies[0] += 1
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    thread = threading.Thread(target=trainer_like)
    thread.start()
    try:
        for n in (1, 3, 7, 13, 29, 50, 64):  # every new batch size (and attend bucket) captures new graphs
            outs = engine.generate(_prompts(n, seed=n), SamplingParams(temperature=1.0, max_new_tokens=40,
                                                                       ignore_eos=True, seed=n))
            assert all(len(o.completions[0].token_ids) == 40 for o in outs)
    finally:
        stop.set()
        thread.join()
    assert not errors, f"the other thread failed during capture: {errors[0]!r}"
    assert copies[0] > 0
    assert len(engine._steps.graphs) >= 7, "the decode steps above did not run as captured graphs"


def test_speculation_in_captured_graphs_keeps_plain_decodings_tokens():
    """The verifying step replayed from CUDA graphs (`asyncrl.policies.verify_steps`): the tokens of plain decoding
    (fp32, vocabulary 256), the draft kept where plain decoding drew it."""
    from asyncrl.config.speculation import SpeculationConfig
    model = random_model(CONFIG, seed=1, device="cuda")
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=40, seed=3)
    prompts = _prompts(5)
    plain = Engine(model, EngineConfig(max_slots=20, max_len=64, attend_bucket=16)).generate(prompts, params)
    reference = {(tuple(o.prompt_ids), j): c.token_ids for o in plain for j, c in enumerate(o.completions)}

    class Oracle:  # the reference's next tokens, every third one wrong
        def propose(self, key, prompt, completions, own, limit):
            want = reference[(tuple(prompt), own)][len(completions[own]):][:limit]
            return [t if i % 3 < 2 else (t + 1) % 256 for i, t in enumerate(want)]

    spec = SpeculationConfig(tokens=4, max_rows=20)
    engine = Engine(model, EngineConfig(max_slots=20, max_len=64, attend_bucket=16, speculation=spec), drafter=Oracle())
    for a, b in zip(plain, engine.generate(prompts, params)):
        for ca, cb in zip(a.completions, b.completions):
            assert ca.token_ids == cb.token_ids and ca.finish_reason == cb.finish_reason
            torch.testing.assert_close(torch.tensor(cb.logprobs), torch.tensor(ca.logprobs), atol=1e-4, rtol=0)
    assert engine.stats["spec_accepted_tokens"] > 0 and engine._verify.graphs, "the verifying step was not captured"


@pytest.mark.parametrize("share", [0, 8], ids=["own-prompts", "common-prefix"])
@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_shared_prompts_in_captured_graphs_give_per_slot_tokens(kv, share):
    """`kv_layout="shared-prompt"` on CUDA: the Triton kernel reading each prompt once per reader (groups of up to 9
    samples: two readers), replayed from graphs with rows finishing in flight, moved and refilled, through a
    weight update mid-generation: the tokens of the per-slot layout (fp32). A prompt slot for every request, so that
    both layouts admit each request at the same step (before or after the update). `common-prefix`: every prompt
    begins with the same 12 tokens, which later requests read from the first's slot (`share_prefix` 8: two prompt
    levels), and the longer prompts spill past their 20-position slots."""
    model, new = random_model(CONFIG, seed=4, device="cuda"), random_model(CONFIG, seed=5, device="cuda")
    common = torch.randint(3, 256, (12,), generator=torch.Generator().manual_seed(7)).tolist() if share else []
    prompts = [common + p for p in _prompts(9, seed=6)]
    params = [SamplingParams(n=1 + (4 * i) % 9, temperature=0.9, max_new_tokens=30 + 3 * i, seed=i) for i in range(9)]
    outs = {}
    for layout in ("slot", "shared-prompt"):
        shared = dict(kv_layout=layout, max_prompt_len=20, max_prompts=9, share_prefix=share) if layout != "slot" else {}
        engine = Engine(copy.deepcopy(model), EngineConfig(max_slots=24, max_len=96, attend_bucket=16, **shared))
        for p, sp in zip(prompts, params):
            engine.add_request(p, sp)
        outs[layout] = drain_across_an_update(engine, named_weights(new), at_step=25, kv=kv)
        assert engine.decode_kernel == "triton" and engine._steps.graphs
        assert layout == "slot" or bool(engine.stats["shared_prefix_tokens"]) == bool(share)
    assert outs["slot"].keys() == outs["shared-prompt"].keys()
    flips = 0
    for rid, a in outs["slot"].items():
        for ca, cb in zip(a.completions, outs["shared-prompt"][rid].completions):
            # fp32 rounding of two reduction orders, at the scale of either weights' logits
            atol = max(logprob_tol(m, a.prompt_ids, ca.token_ids, 0.9) for m in (model, new))
            k = boundary_flip(ca.token_ids, cb.token_ids)
            flips += k is not None
            upto = len(ca.token_ids) if k is None else k
            torch.testing.assert_close(torch.tensor(cb.logprobs[:upto]), torch.tensor(ca.logprobs[:upto]), atol=atol,
                                       rtol=0)
            if k is None:
                assert ca.finish_reason == cb.finish_reason and ca.versions == cb.versions
            else:
                assert ca.versions[:k] == cb.versions[:k]
    # a common prefix's K/V comes from another request's prefill (another GEMM shape), so at most one of the ~2,000
    # draws may land within rounding of a CDF boundary (seen once on an H200: a token of p 1.3e-6 and its neighbour)
    assert flips <= (1 if share else 0), f"{flips} samples diverged"


def boundary_flip(a: list[int], b: list[int]) -> int | None:
    """None where two samplings give the same tokens; else the first position where they differ, which must be an
    inverse-CDF boundary flip of rounding size: neighbouring token ids (the uniform fell between their CDF values as
    each engine rounded them), at the same length or later."""
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        assert len(a) == len(b), f"same tokens, lengths {len(a)} and {len(b)}"
        return None
    assert abs(a[k] - b[k]) == 1, f"token {k}: {a[k]} against {b[k]} is not a CDF-boundary flip"
    return k
