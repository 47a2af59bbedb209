"""Packed micro-batches against padded ones, and the fused log-prob head against a plain log_softmax.

Packing concatenates a micro-batch's rows into one sequence with document-causal attention. It must change
nothing but round-off: the loss, every gradient and every metric equal the padded path's, for every
algorithm, with ragged lengths, one-token and empty responses and tokens masked inside a response.
fp32 models (the learner's dtype); the tolerance is the issue's 1e-5 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config import GRPO, OffPolicyConfig
from asyncrl.learner import (build_learner, collate, linear_logprobs, plan_micro_batches, policy_gradients,
                             response_logprobs, split_rows, train_step)
from asyncrl.learner.forward import row_lengths
from asyncrl.policies.attention_layouts import DocumentLayout
from asyncrl.types import Completion
from tests.learner_helpers import ALGORITHM_CASES, frozen_copy, max_rel_diff, on_policy, synthetic_groups, tiny_policy, trainer_config
from tests.tolerances import adam_weights_tol, close_tol

REL_TOL = 1e-5

_CONFIGS = ALGORITHM_CASES + [
    pytest.param(GRPO(entropy_coef=0.01, kl_loss_coef=0.1, loss_agg_mode="seq-mean-token-mean"), {}, id="entropy+kl"),
    pytest.param(GRPO(), {"off_policy": OffPolicyConfig(use_rollout_log_probs=False, is_level="token",
                                                        rs_stat="k1", rs_upper=2.0, rs_level="token")},
                 id="decoupled+TIS+rejection"),
    pytest.param(GRPO(), {"off_policy": OffPolicyConfig(max_version_lag=0, stale_level="token")}, id="token-lag-cap"),
]


def _ragged(policy):
    """5 groups × 4: prompts of 1–9 tokens, responses of 1–14 (1-token ones included), one empty response,
    a NaN behaviour log-prob inside a response (masked out there) and old-version tokens inside others."""
    groups = synthetic_groups(5, 4, seed=11, prompt_lens=(1, 9), response_lens=(1, 14))
    groups[0].completions[0] = Completion([7], [-1.0], [0], "stop")
    groups[1].completions[3] = Completion([9], [-2.0], [0], "stop")
    groups[2].completions[1] = Completion([], [], [], "abort")
    groups = on_policy(policy, groups, shift=0.05)
    lengthy = next(c for g in groups for c in g.completions if len(c.token_ids) >= 6)
    lengthy.logprobs[3] = float("nan")
    for c in groups[3].completions:
        c.versions = [-1 if j % 3 == 1 else 0 for j in range(len(c.token_ids))]
    return groups


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _learner(policy, algo, trainer, packed: bool):
    reference = frozen_copy(tiny_policy(1)) if algo.needs_reference else None
    cfg = trainer_config(use_dynamic_bsz=True, max_tokens_per_micro_batch=40, pack_sequences=packed,
                         mini_batch_size=2, **trainer)
    return build_learner(copy.deepcopy(policy), cfg, algo, reference=reference)


@pytest.mark.parametrize("algo, trainer", _CONFIGS)
def test_packed_and_padded_steps_give_the_same_gradients_weights_and_metrics(algo, trainer):
    policy = tiny_policy(0)
    groups = _ragged(policy)
    batch = collate(groups)
    assert batch.nonfinite_logprobs == 1 and 1 in batch.response_lens.tolist() and 0 in batch.response_lens.tolist()
    grads = {p: policy_gradients(_learner(policy, algo, trainer, p), groups) for p in (False, True)}
    assert max(float(g.abs().max()) for g in grads[False].values()) > 1e-3  # a real gradient
    assert max_rel_diff(grads[False], grads[True]) <= REL_TOL
    results = {}
    for packed in (False, True):
        state = _learner(policy, algo, trainer, packed)
        for _ in range(2):
            state, metrics = train_step(state, groups)
        results[packed] = (state, metrics)
    (padded, m_padded), (packed, m_packed) = results[False], results[True]
    assert m_padded.keys() == m_packed.keys()
    for key, value in m_padded.items():
        if key.startswith("timing_s/"):
            continue
        assert m_packed[key] == pytest.approx(value, rel=REL_TOL, abs=1e-7), key
    # weights after several Adam updates (mini-batches of 2 groups: 3 a step): to a share of lr (adam_weights_tol);
    # the gradients themselves are held to rounding above
    for name in ("policy", "critic"):
        a, b = getattr(padded, name), getattr(packed, name)
        if a is not None:
            lr = (padded.scheduler if name == "policy" else padded.critic_scheduler).get_last_lr()[0]
            worst = max(float((x - y).abs().max()) for x, y in zip(_params(a).values(), _params(b).values()))
            assert worst <= adam_weights_tol(lr), (name, worst, lr)


def test_a_packed_micro_batch_is_one_sequence_without_padding():
    """The layout itself: rows end to end, positions restarting per row, every response token predicted from
    the position before it in its own row."""
    groups = synthetic_groups(2, 3, seed=4, prompt_lens=(2, 5), response_lens=(0, 6))
    batch = collate(groups)
    lengths = row_lengths(batch)
    rows = [4, 0, 2]
    micro, = plan_micro_batches(batch.tokens, [rows], lengths, packed=True)
    totals = [lengths.total(r) for r in rows]
    assert micro.tokens.shape == (1, sum(totals)) and micro.documents.lengths == tuple(totals)
    want_tokens = torch.cat([batch.tokens[r, :lengths.total(r)] for r in rows])
    assert torch.equal(micro.tokens[0], want_tokens)
    assert micro.positions[0].tolist() == [j for n in totals for j in range(n)]
    assert micro.documents.cu_seqlens.tolist() == [0] + torch.tensor(totals).cumsum(0).tolist()
    start = 0
    for i, r in enumerate(rows):
        p, n = lengths.prompt[r], lengths.response[r]
        sel = micro.out_rows == i
        assert micro.out_cols[sel].tolist() == list(range(n))
        assert micro.predict_at[sel].tolist() == [start + p - 1 + j for j in range(n)]
        assert micro.targets[sel].tolist() == batch.tokens[r, p:p + n].tolist()
        start += p + n
    assert micro.num_targets == sum(lengths.response[r] for r in rows)


def test_packed_forward_equals_each_row_on_its_own():
    """Document-causal attention: each packed row's logits equal a forward of that row alone (no token sees
    another row), at every position."""
    model = tiny_policy(2).eval()
    gen = torch.Generator().manual_seed(0)
    lens = [5, 1, 9, 3]
    seqs = [torch.randint(3, 200, (n,), generator=gen) for n in lens]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = model.logits(model(torch.cat(seqs)[None], positions, documents=DocumentLayout(tuple(lens), cu)))[0]
        alone = torch.cat([model.logits(model(s[None]))[0] for s in seqs])
    tol = close_tol(torch.float32, alone, terms=model.config.hidden_size, depth=4)
    torch.testing.assert_close(packed, alone, rtol=0, atol=tol)


def test_response_logprobs_are_the_same_packed_and_padded():
    model = tiny_policy(3).eval()
    batch = collate(synthetic_groups(3, 3, seed=8, prompt_lens=(1, 7), response_lens=(1, 10)))
    with torch.no_grad():
        padded = response_logprobs(model, batch, [5, 0, 8, 2], temperature=0.7, entropy=True, packed=False)
        packed = response_logprobs(model, batch, [5, 0, 8, 2], temperature=0.7, entropy=True, packed=True)
    for a, b in zip(padded, packed):
        torch.testing.assert_close(b, a, rtol=REL_TOL, atol=1e-6)


# ============================================================================================ the head
def _plain(hidden, weight, targets, temperature):
    logp_all = torch.log_softmax((hidden @ weight.T) / temperature, dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), vocab=st.integers(2, 70), hidden=st.integers(1, 24), chunk=st.integers(1, 50),
       temperature=st.sampled_from([1.0, 0.7, 1.6]), entropy_grad=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_head_equals_log_softmax_gather_and_its_gradient(n, vocab, hidden, chunk, temperature,
                                                               entropy_grad, seed):
    """float64, so the chunked forward, the recomputing backward and the hand-derived gradients
    (onehot − p for log π, −p ⊙ (z − E_p z) for H) must equal autograd through log_softmax to ~1e-12."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=torch.float64) * 2
    w = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=gen)
    g_logp, g_ent = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    results = []
    for fn in (lambda a, b: linear_logprobs(a, b, y, temperature=temperature, chunk_tokens=chunk),
               lambda a, b: _plain(a, b, y, temperature)):
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = fn(a, b)
        loss = (logp * g_logp).sum() + ((ent * g_ent).sum() if entropy_grad else 0.0)
        if n:
            loss.backward()
        results.append((logp.detach(), ent.detach(), a.grad, b.grad))
    for got, want in zip(*results):
        if want is None:
            assert got is None or not bool(got.abs().max() > 0)
            continue
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_fused_head_in_float32_matches_within_the_dtype_tolerance():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(300, 64, generator=gen)
    w = torch.randn(256, 64, generator=gen) * 0.3
    y = torch.randint(0, 256, (300,), generator=gen)
    logp, ent = linear_logprobs(h, w, y, chunk_tokens=64)
    want_logp, want_ent = _plain(h.double(), w.double(), y, 1.0)
    tol = close_tol(torch.float32, (h @ w.T), terms=64, depth=2)
    torch.testing.assert_close(logp.double(), want_logp, rtol=0, atol=tol)
    torch.testing.assert_close(ent.double(), want_ent, rtol=0, atol=tol)


def test_fused_head_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="hidden \\[n, H\\], weight \\[V, H\\], targets \\[n\\]"):
        linear_logprobs(torch.zeros(3, 4), torch.zeros(5, 6), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        linear_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), temperature=0.0)


def test_split_rows_packs_more_rows_per_micro_batch_than_padding():
    """Ragged lengths: the same budget holds more rows packed than padded (the point of packing)."""
    lengths = [int(x) for x in torch.randint(10, 400, (64,), generator=torch.Generator().manual_seed(0))]
    rows = list(range(64))
    padded = split_rows(rows, lengths, trainer_config(use_dynamic_bsz=True, max_tokens_per_micro_batch=1024,
                                                      pack_sequences=False))
    packed = split_rows(rows, lengths, trainer_config(use_dynamic_bsz=True, max_tokens_per_micro_batch=1024))
    assert len(packed) < len(padded)
