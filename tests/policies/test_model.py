"""`asyncrl.policies.model`: logits equal transformers' for every supported architecture; padding, packing,
token_logprobs / token_entropy, gradient checkpointing."""

from __future__ import annotations

import collections
import warnings
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.policies import save_pretrained
from asyncrl.policies.attention_layouts import packed_attention_mask
from asyncrl.policies.model import token_entropy, token_logprobs
from tests.policies.helpers import VOCAB, make_prompts, tiny_config, tiny_model
from tests.tolerances import close_tol, forward_tol

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
# head_dim 16, theta 1e4: wavelengths 6.3 … 19869, so with original context 64 and low/high factors 1/4 the
# llama3 rule leaves some frequencies alone, divides some by 8 and interpolates the rest (all three branches).
ARCHS = {
    "qwen2-tied": dict(model_type="qwen2"),
    "qwen2-untied": dict(model_type="qwen2", tie_word_embeddings=False),
    "llama-llama3-rope": dict(model_type="llama", tie_word_embeddings=False, rope_scaling=LLAMA3_ROPE,
                              rope_theta=10000.0),
    "qwen3-qknorm-headdim": dict(model_type="qwen3", head_dim=32),  # 4 heads × 32 != hidden 64
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None),
}


@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch, tmp_path, transformers):
    # init 0.1 keeps logits O(3): float32 rounding (RoPE tables are computed slightly differently) is a few
    # 1e-6, the tolerance ~5e-5, while any structural difference (bias, norm, rope, GQA, tying) is O(0.1..1).
    model = tiny_model(seed=7, perturb=True, initializer_range=0.1, **ARCHS[arch])
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert type(hf).__name__.lower().startswith(ARCHS[arch]["model_type"])
    ids = torch.tensor(make_prompts([96, 96], seed=1))
    with torch.no_grad():
        ours = model.logits(model(ids))
        theirs = hf(ids).logits.float()
    assert ours.shape == theirs.shape == (2, 96, VOCAB)
    assert ours.std() > 0.5  # the comparison is not between two near-constant tensors
    diff, atol = (ours - theirs).abs().max().item(), forward_tol(theirs, model.config)
    assert diff <= atol, f"{arch}: max |logits − HF logits| = {diff:.3g} > {atol:.3g}"


def test_arch_variants_are_really_exercised():
    """The configs above reach the code paths they are named after."""
    plain = tiny_model(model_type="llama")
    scaled = tiny_model(model_type="llama", rope_scaling=LLAMA3_ROPE)
    inv, inv_scaled = plain.model.rope_inv_freq, scaled.model.rope_inv_freq
    assert torch.equal(inv_scaled[:1], inv[:1])  # high frequencies (wavelength < 64/4) untouched
    torch.testing.assert_close(inv_scaled[-2:], inv[-2:] / 8)  # low frequencies divided by the factor
    mid = (inv_scaled != inv) & ~torch.isclose(inv_scaled, inv / 8)
    assert mid.any()  # and some interpolated
    q3 = tiny_model(model_type="qwen3", head_dim=32)
    attn = q3.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 32, 64) and hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    assert attn.q_proj.bias is None
    assert tiny_model(model_type="qwen2").model.layers[0].self_attn.q_proj.bias is not None
    untied = tiny_model(tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    tied = tiny_model()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.mark.parametrize("arch", ["qwen2-tied", "qwen3-qknorm-headdim"])
def test_right_padding_does_not_change_real_positions(arch):
    model = tiny_model(seed=3, perturb=True, **ARCHS[arch])
    a, b = make_prompts([13, 30], seed=2)
    batch = torch.zeros(2, 30, dtype=torch.long)
    batch[0, :13] = torch.tensor(a)
    batch[0, 13:] = 99  # padding id: anything, causal attention never lets earlier positions see it
    batch[1] = torch.tensor(b)
    with torch.no_grad():
        padded = model.logits(model(batch))
        alone_a = model.logits(model(torch.tensor([a])))[0]
        alone_b = model.logits(model(torch.tensor([b])))[0]
    # logits up to ~17: rounding of another batch shape ~1e-5, the tolerance ~3e-4; a pad token leaking
    # into real positions moves them by O(0.1)
    torch.testing.assert_close(padded[0, :13], alone_a, atol=forward_tol(alone_a, model.config), rtol=0)
    torch.testing.assert_close(padded[1], alone_b, atol=forward_tol(alone_b, model.config), rtol=0)


def test_packed_rows_give_the_same_logprobs_as_separate_rows():
    model = tiny_model(seed=4, perturb=True, initializer_range=0.2)
    lens = [5, 17, 1, 9]
    seqs = make_prompts(lens, seed=3)
    positions, mask = packed_attention_mask(lens)
    assert positions.tolist() == [list(range(5)) + list(range(17)) + [0] + list(range(9))]
    assert mask.shape == (1, 1, 32, 32)
    packed = torch.tensor([sum(seqs, [])])
    with torch.no_grad():
        logits = model.logits(model(packed, positions, attn_mask=mask))[0]
        start = 0
        for seq in seqs:
            n = len(seq)
            ref = model.logits(model(torch.tensor([seq])))[0]
            atol = forward_tol(ref, model.config)  # ~1e-4; the leak checked below is > 1e-2
            torch.testing.assert_close(logits[start:start + n], ref, atol=atol, rtol=0)
            if n > 1:
                targets = torch.tensor(seq[1:])
                torch.testing.assert_close(token_logprobs(logits[start:start + n - 1], targets),
                                           token_logprobs(ref[:-1], targets), atol=atol, rtol=0)
            start += n
        # without the block-diagonal mask the later documents would see the earlier ones
        leaky = model.logits(model(packed, positions))[0]
        assert (leaky[5:22] - logits[5:22]).abs().max() > 1e-2


def test_packed_attention_mask_rejects_bad_lengths():
    with pytest.raises(ValueError, match="seq_lens"):
        packed_attention_mask([3, 0, 2])
    with pytest.raises(ValueError, match="seq_lens"):
        packed_attention_mask([[3, 2]])


def test_positions_default_and_explicit_agree():
    model = tiny_model(seed=5)
    ids = torch.tensor(make_prompts([12, 12], seed=4))
    with torch.no_grad():
        implicit = model(ids)
        explicit = model(ids, torch.arange(12).expand(2, 12))
        shifted = model(ids, torch.arange(12).expand(2, 12) + 7)
        unrotated = model(ids, torch.zeros(2, 12, dtype=torch.long))
    assert torch.equal(implicit, explicit)
    # RoPE: only relative positions count (rounding of other angles; tolerance ~6e-5; no RoPE is > 1e-2)
    torch.testing.assert_close(shifted, implicit, atol=forward_tol(implicit, model.config), rtol=0)
    assert (unrotated - implicit)[:, 1:].abs().max() > 1e-2  # … and it is applied


def test_token_logprobs_is_log_softmax_at_temperature():
    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0)) * 4
    targets = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    for temp in (1.0, 0.7, 1.6):
        expected = torch.log_softmax(logits.double() / temp, -1).gather(-1, targets[..., None])[..., 0]
        # float32 against float64: z / T, then the log-sum-exp over 50 terms (≤ 1.6e-4 for |z| / T up to 20)
        atol = close_tol(torch.float32, logits / temp, terms=50, depth=2)
        torch.testing.assert_close(token_logprobs(logits, targets, temp).double(), expected, atol=atol, rtol=0)
    assert token_logprobs(logits.bfloat16(), targets).dtype == torch.float32


@given(st.lists(st.floats(-30, 30, allow_nan=False), min_size=1, max_size=40),
       st.floats(0.1, 3.0))
def test_token_entropy_bounds_and_definition(values, temp):
    logits = torch.tensor(values, dtype=torch.float32)
    h = token_entropy(logits, temp).item()
    v = len(values)
    # logsumexp(z) − Σ p·z cancels two numbers of size |z|: allow float32 rounding at that scale
    # (a nearly one-hot row at |z| = 300 comes out as −3e-5, not 0; the tolerance there is ~2e-3), and at
    # least the rounding of the O(1) terms p·log p when the logits are near 0
    tol = close_tol(torch.float32, max(logits.abs().max().item() / temp, 1.0), terms=v, depth=2)
    assert -tol <= h <= math.log(v) + tol
    p = torch.softmax(logits.double() / temp, -1)
    ref = -(p * torch.log(p.clamp_min(1e-300))).sum().item()
    assert h == pytest.approx(ref, abs=tol)


def test_token_entropy_extremes():
    # float32 sums over v terms of size max(|z|, log v): ≤ 2.3e-3 at v = 49152, 1.9e-3 for the peak at 200;
    # a wrong normalisation is off by O(0.1) or more
    for v in (1, 2, 256, 49152):
        tol = close_tol(torch.float32, max(3.5, math.log(v)), terms=v, depth=2)
        assert token_entropy(torch.full((v,), 3.5)).item() == pytest.approx(math.log(v), abs=tol)
    peaked = torch.zeros(100)
    peaked[17] = 200.0
    tol = close_tol(torch.float32, 200.0, terms=100, depth=2)
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=tol)
    logits = torch.randn(4, 9, 256, generator=torch.Generator().manual_seed(2))
    h = token_entropy(logits)
    assert h.shape == (4, 9)
    # higher temperature flattens, lower sharpens
    assert (token_entropy(logits, 2.0) > h).all() and (token_entropy(logits, 0.5) < h).all()
    torch.testing.assert_close(token_entropy(logits, 2.0), token_entropy(logits / 2.0))


def test_gradient_checkpointing_gives_the_same_gradients(monkeypatch):
    ids = torch.tensor(make_prompts([24, 24], seed=5))
    grads, calls = [], []
    real_checkpoint = torch.utils.checkpoint.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(1)
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting_checkpoint)
    for ckpt in (False, True):
        model = tiny_model(seed=6, perturb=True, initializer_range=0.2).train().requires_grad_(True)
        model.gradient_checkpointing = ckpt
        logits = model.logits(model(ids))
        loss = -token_logprobs(logits[:, :-1], ids[:, 1:], 0.9).mean() + 0.1 * token_entropy(logits).mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert len(calls) == 2  # one checkpointed call per layer, only in the checkpointed run
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert grads[0][name].abs().sum() > 0, name
        # the same float32 forward and backward recomputed (one more pass of the same ops): rounding only
        atol = forward_tol(grads[0][name], model.config)
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=atol, rtol=0, msg=name)


def test_unsupported_configs_are_rejected():
    from asyncrl.policies import random_model
    with pytest.raises(ValueError, match="model_type 'not_a_model' is not implemented by the installed transformers"):
        random_model(tiny_config("not_a_model"))
    with pytest.raises(ValueError, match="hidden_act"):
        random_model(tiny_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope type"):
        random_model(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_fused_kernels_given_to_one_model_leave_the_others_eager(monkeypatch):
    """A colocated trainer and engine share a process: the engine's compiled pieces (`model=`) must not run
    in the trainer's model, whose other shapes and grad modes would spend the compiler's recompile budget."""
    from asyncrl.policies import model as model_mod

    calls = collections.Counter()

    def fake_compile(fn, **kwargs):
        def compiled(*args):
            calls[fn.__name__] += 1
            return fn(*args)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    engine_model, trainer_model = tiny_model(0, perturb=True), tiny_model(0, perturb=True)
    tokens = torch.tensor(make_prompts([5, 5], seed=1))
    assert model_mod.use_fused_kernels(True, "cpu", torch.float32, model=engine_model) == dict.fromkeys(
        ("rms_norm", "add_rms_norm", "apply_rope", "norm_rope", "silu_mul"), True)
    calls.clear()  # the probes ran each piece
    with torch.no_grad():
        want = trainer_model(tokens)
        assert not calls  # the other model stays eager
        got = engine_model(tokens)
    assert {"_rms_norm", "_add_rms_norm", "_apply_rope", "_silu_mul"} <= set(calls)
    torch.testing.assert_close(got, want)
    assert model_mod._Kernels.rms_norm is model_mod._rms_norm  # the process-wide pieces are untouched


def test_compiled_norm_rope_rounds_where_eager_does():
    """Qwen3's q/k norms and RoPE compiled as one piece keep eager's bf16 rounding of the norms' output: the
    compiled piece gives eager's bits (unrounded, RoPE's differences turned a few-ulp change into errors past the
    probe's tolerance, and the piece fell back to eager at random)."""
    from asyncrl.policies import model as model_mod
    q3 = tiny_model(model_type="qwen3", head_dim=32).to(torch.bfloat16)
    assert model_mod.use_fused_kernels(True, "cpu", torch.bfloat16, model=q3)["norm_rope"]
    compiled = q3.model.layers[0].self_attn.kernels.norm_rope
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        q, k = (torch.randn(3, 5, h, 32, generator=gen).bfloat16() for h in (4, 2))
        wq, wk, cos, sin = (torch.randn(*shape, generator=gen).bfloat16() for shape in ((32,), (32,), (3, 5, 32), (3, 5, 32)))
        want, got = model_mod._norm_rope(q, k, wq, wk, 1e-6, cos, sin), compiled(q, k, wq, wk, 1e-6, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), seed


def test_each_models_compiled_pieces_have_their_own_recompile_budget(monkeypatch):
    """Engines of several dtypes in one process: each model's pieces are compiled from code objects of their own,
    so one model's dtype is not another's recompile (past the limit a fullgraph compile fails, or stays eager)."""
    import torch._dynamo
    from asyncrl.policies import model as model_mod

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real_compile(fn, backend="eager", **kw))
    torch._dynamo.reset()  # at the default limit (8): a model compiles each piece ~3 times (probe shapes, its forward)
    tokens = torch.tensor(make_prompts([5], seed=1))
    try:
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            model = tiny_model(0, perturb=True).to(dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a piece left eager warns
                status = model_mod.use_fused_kernels(True, "cpu", dtype, model=model)
            assert all(status.values()), (dtype, status)
            pieces = model.model.layers[0].kernels
            assert model_mod.use_fused_kernels(True, "cpu", dtype, model=model) == status  # a second engine
            assert model.model.layers[0].kernels is pieces  # reuses them (and what they compiled)
            with torch.no_grad():
                assert torch.isfinite(model(tokens).float()).all()
    finally:
        torch._dynamo.reset()
