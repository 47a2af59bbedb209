"""Tests of `asyncrl.learner`: batching, exact gradient accumulation, every algorithm config, the critic,
off-policy masks and weights, skipped updates, schedules, config validation, and a short DAPO loop with the
engine.

Models are `tiny-qwen2` (vocab 256, 2 layers) on the CPU. Gradient-equality tests use a float64 copy: the
learner's log-probs are fp32 per token either way, and in float64 the sums over micro-batches agree to
~1e-16 relative, so any real normalisation error (a wrong denominator, a dropped row) stands out by orders of
magnitude.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl import algos
from asyncrl.config import (
    CISPO, DAPO, GRPO, GSPO, PPO, RLOO, CriticConfig, DrGRPO, OffPolicyConfig, OptimConfig, ReinforcePP,
    TrainerConfig,
)
from asyncrl.learner import (
    build_learner, collate, filter_groups, full_weights, make_scheduler, policy_gradients, split_rows,
    response_logprobs, response_values, train_step,
)
from asyncrl.policies import Engine, EngineConfig, SamplingParams
from asyncrl.types import Completion, Group
from tests.learner_helpers import (
    ALGORITHM_CASES, VOCAB, frozen_copy, max_rel_diff, on_policy, reward_even_fraction, seq_mean_logprobs, synthetic_groups,
    tiny_policy, trainer_config, weights,
)
from tests.run_helpers import NO_EVAL, train_here
from tests.tolerances import FORWARD_DEPTH, close_tol, forward_tol

NAN = float("nan")
GRAD_TOL = 1e-9  # float64 model: observed ~1e-15; the issue asks for <= 1e-6 relative to the gradient's scale

VERL_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm", "actor/entropy",
                "actor/lr", "critic/score/mean", "response_length/mean")


def _grads(algo, groups, *, policy=None, reference=None, version: int = 0, **trainer) -> dict[str, torch.Tensor]:
    """`policy_gradients` of a fresh float64 learner (policy seed 0 unless given)."""
    policy = policy if policy is not None else tiny_policy(0).double()
    state = build_learner(policy, trainer_config(**trainer), algo, reference=reference)
    state.version = version
    return policy_gradients(state, groups)


@torch.no_grad()
def _logprob_tol(policy, groups: list[Group]) -> float:
    """How far two float32 computations of the same log-probs of `groups` under `policy` may differ (other
    padding, micro-batches, grad mode): `forward_tol` at the scale of the logits over the padded batch."""
    return forward_tol(policy.logits(policy(collate(groups).tokens)), policy.config)


def _ragged_groups(policy) -> list[Group]:
    """4 groups × 4 completions: prompts of 1–9 tokens, responses of 0–12 tokens (one empty response, as an
    abort at once would give), behaviour log-probs the policy's own (ratios ≈ 1, so nothing is clipped)."""
    groups = synthetic_groups(4, 4, seed=1, prompt_lens=(1, 9), response_lens=(1, 12))
    groups[2].completions[1] = Completion([], [], [], "abort")
    return on_policy(policy, groups)


# ============================================================================================ collate
def test_collate_places_each_response_token_after_its_prompt():
    groups = synthetic_groups(3, 3, seed=5, prompt_lens=(1, 6), response_lens=(1, 7))
    groups[1].completions[2].versions = [4] * len(groups[1].completions[2].token_ids)
    batch = collate(groups, pad_id=0)
    rows = [(k, g, c, j) for k, g in enumerate(groups) for j, c in enumerate(g.completions)]
    assert batch.num_rows == len(rows) == 9
    assert batch.prompt_ids == [g.prompt_id for g in groups]
    s = max(len(g.prompt_ids) + len(c.token_ids) for _, g, c, _ in rows)
    t = max(len(c.token_ids) for _, _, c, _ in rows)
    assert batch.tokens.shape == (9, s) and batch.response_mask.shape == (9, t)
    for i, (k, g, c, j_c) in enumerate(rows):
        p, r = len(g.prompt_ids), len(c.token_ids)
        assert int(batch.prompt_lens[i]) == p and int(batch.group_index[i]) == k
        assert batch.tokens[i, :p].tolist() == g.prompt_ids
        for j in range(r):
            assert int(batch.tokens[i, p + j]) == c.token_ids[j]
        assert batch.tokens[i, p + r:].eq(0).all()  # right padding
        assert batch.response_mask[i].tolist() == [True] * r + [False] * (t - r)
        torch.testing.assert_close(batch.logp_behaviour[i, :r], torch.tensor(c.logprobs))
        assert batch.token_versions[i, :r].tolist() == c.versions
        assert float(batch.rewards[i]) == g.rewards[j_c]


def test_response_logprobs_match_an_unpadded_forward_of_each_row():
    """Row i's log-prob of response token j is read at position prompt_len + j − 1 of its own sequence,
    whatever the padding and the other rows of the micro-batch."""
    model = tiny_policy(2).eval()
    groups = synthetic_groups(2, 3, seed=6, prompt_lens=(1, 6), response_lens=(1, 8))
    batch = collate(groups)
    with torch.no_grad():
        logp, ent = response_logprobs(model, batch, torch.tensor([4, 0, 2]), temperature=0.7, entropy=True)
        for out_row, i in enumerate([4, 0, 2]):
            p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
            seq = batch.tokens[i:i + 1, :p + r]
            z = model.logits(model(seq))[0].float() / 0.7
            ref = torch.log_softmax(z, -1)[torch.arange(p - 1, p + r - 1), seq[0, p:p + r]]
            atol = forward_tol(z, model.config)  # logits / T of init 0.1: ~7e-5; a shifted position is O(0.1)
            torch.testing.assert_close(logp[out_row, :r], ref, atol=atol, rtol=0)
            probs = torch.softmax(z[p - 1:p + r - 1], -1)
            torch.testing.assert_close(ent[out_row, :r], -(probs * probs.log()).sum(-1), atol=atol, rtol=0)


@pytest.mark.parametrize("field", ["logprobs", "versions"])
def test_collate_rejects_mismatched_completion_lengths(field):
    groups = synthetic_groups(2, 2, seed=0)
    comp = groups[1].completions[0]
    setattr(comp, field, getattr(comp, field)[:-1] if len(comp.token_ids) > 1 else getattr(comp, field) * 2)
    with pytest.raises(ValueError, match=r"group 1 has a completion with \d+ tokens, \d+ logprobs and \d+ versions"):
        collate(groups)


def test_collate_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="no groups"):
        collate([])


def test_collate_overlong_shaping_subtracts_the_dapo_penalty_inside_the_buffer():
    # L_max = 10, buffer 4 (starts after 6 tokens), factor 0.5: penalty = −0.5·(L − 6)/4 for 6 < L ≤ 10
    lengths = [2, 6, 7, 8, 9, 10]
    base = [1.0, 0.0, 1.0, 0.5, 1.0, 0.25]
    comps = [Completion(list(range(3, 3 + n)), [-1.0] * n, [0] * n, "stop") for n in lengths]
    groups = [Group(0, [5, 6], comps[:3], base[:3]), Group(1, [7], comps[3:], base[3:])]
    shaped = collate(groups, max_response_length=10, overlong_buffer_len=4, overlong_penalty_factor=0.5).rewards
    assert shaped.tolist() == [1.0, 0.0, 1.0 - 0.125, 0.5 - 0.25, 1.0 - 0.375, 0.25 - 0.5]
    assert collate(groups).rewards.tolist() == base  # no buffer: untouched
    with pytest.raises(ValueError, match="max_response_length"):
        collate(groups, overlong_buffer_len=4)


def test_dapo_train_step_scores_the_shaped_rewards():
    policy = tiny_policy(0)
    groups = on_policy(policy, synthetic_groups(3, 4, seed=2, response_lens=(1, 9)))
    shaped = collate(groups, max_response_length=10, overlong_buffer_len=4).rewards
    assert (shaped < collate(groups).rewards).any()  # some response does run into the buffer
    state = build_learner(policy, trainer_config(max_response_length=10), DAPO(overlong_buffer_len=4))
    _, metrics = train_step(state, groups)
    assert metrics["critic/score/mean"] == pytest.approx(float(shaped.mean()), abs=1e-6)
    # DAPO's default buffer (a fifth of the rollout budget) needs that budget
    state = build_learner(tiny_policy(0), trainer_config(), DAPO())
    with pytest.raises(ValueError, match="max_response_length"):
        train_step(state, groups)


# ================================================================================ DAPO dynamic sampling
@given(st.lists(st.lists(st.sampled_from([0.0, 0.25, 1.0, -1.0]), min_size=1, max_size=5), max_size=10))
def test_filter_groups_drops_exactly_the_all_equal_groups(reward_lists):
    groups = [Group(i, [5], [Completion([7], [-1.0], [0])] * len(rs), list(rs)) for i, rs in enumerate(reward_lists)]
    kept, dropped = filter_groups(groups)
    informative = [len(rs) == 1 or len(set(rs)) > 1 for rs in reward_lists]
    assert [g.prompt_id for g in kept] == [i for i, ok in enumerate(informative) if ok]
    assert [g.prompt_id for g in dropped] == [i for i, ok in enumerate(informative) if not ok]
    assert all(a is groups[a.prompt_id] for a in kept + dropped)  # the groups themselves, not copies


def test_all_equal_groups_carry_no_gradient():
    groups = synthetic_groups(3, 4, seed=4, rewards=[[1.0] * 4, [0.0] * 4, [0.5] * 4])
    grads = _grads(GRPO(), groups, policy=tiny_policy(0).double())
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


# ===================================================================== 1. the objective improves on a batch
@pytest.mark.parametrize("algo", [GRPO(), GSPO(), CISPO()], ids=lambda a: type(a).__name__)
def test_repeated_steps_raise_good_responses_and_lower_bad_ones(algo):
    """π_old recomputed every step, so each step is one exact policy-gradient step on Σ A·logp: the
    advantage-weighted log-likelihood rises every step, positive-advantage completions become likelier and
    negative ones less likely."""
    policy = tiny_policy(0)
    groups = synthetic_groups(4, 4, seed=3)
    off = OffPolicyConfig(use_rollout_log_probs=False)
    state = build_learner(policy, trainer_config(lr=3e-3, off_policy=off), algo)
    adv = torch.cat([torch.tensor(g.rewards) - sum(g.rewards) / len(g.rewards) for g in groups])
    start = seq_mean_logprobs(policy, groups)
    objective = [float((adv * start).sum())]
    for _ in range(6):
        state, metrics = train_step(state, groups)
        assert metrics["actor/skipped_updates"] == 0
        objective.append(float((adv * seq_mean_logprobs(policy, groups)).sum()))
    delta = seq_mean_logprobs(policy, groups) - start
    assert all(b > a for a, b in zip(objective, objective[1:])), objective
    assert float(delta[adv > 0].mean()) > 0.5 and float(delta[adv < 0].mean()) < -0.5, delta
    assert (delta[adv > 0] > 0).float().mean() >= 0.75 and (delta[adv < 0] < 0).float().mean() >= 0.75


def test_ppo_surrogate_falls_to_its_clip_bound_with_a_fixed_old_policy():
    """With π_old = the behaviour log-probs (fixed), the clipped surrogate falls step after step until every
    token is clipped, where token-mean PPO loss = −Σ_{A>0}(1+ε)A − Σ_{A<0}(1−ε)A over N tokens."""
    policy = tiny_policy(0)
    groups = on_policy(policy, synthetic_groups(4, 4, seed=3))
    state = build_learner(policy, trainer_config(lr=3e-3), GRPO())
    batch = collate(groups)
    adv = algos.grpo_advantage(batch.rewards, batch.group_index, batch.response_mask).advantages
    mask = batch.response_mask
    bound = float((torch.where(adv > 0, -1.2 * adv, -0.8 * adv) * mask).sum() / mask.sum())
    losses = []
    for _ in range(8):
        state, metrics = train_step(state, groups)
        losses.append(metrics["actor/pg_loss"])
    assert losses[1] < losses[0] - 0.05, losses
    # float32 token mean of N terms of size ≤ 1.2·|A| (~1.5e-5 here); the bound is approached to 0.01 below
    tol = close_tol(torch.float32, 1.2 * adv.abs().max(), terms=int(mask.sum()), depth=2)
    assert all(loss >= bound - tol for loss in losses), (losses, bound)
    assert losses[-1] == pytest.approx(bound, abs=0.01), (losses, bound)
    assert metrics["actor/pg_clipfrac"] > 0.9


# ============================================================ 2, 3. micro-batches accumulate exactly
_AGG_CASES = [
    pytest.param(GRPO(), id="token-mean"),
    pytest.param(GRPO(loss_agg_mode="seq-mean-token-mean"), id="seq-mean-token-mean"),
    pytest.param(GRPO(loss_agg_mode="seq-mean-token-sum"), id="seq-mean-token-sum"),
    pytest.param(DrGRPO(), id="seq-mean-token-sum-norm"),
    pytest.param(GSPO(), id="gspo"),
    pytest.param(CISPO(), id="cispo"),
    pytest.param(GRPO(entropy_coef=0.01, kl_loss_coef=0.1, loss_agg_mode="seq-mean-token-mean"), id="entropy+kl"),
]


@pytest.mark.parametrize("algo", _AGG_CASES)
def test_micro_batches_accumulate_to_the_whole_batch_gradient(algo):
    policy = tiny_policy(0).double()
    reference = frozen_copy(tiny_policy(1).double()) if algo.needs_reference else None
    groups = _ragged_groups(policy)
    whole = _grads(algo, groups, policy=copy.deepcopy(policy), reference=reference, micro_batch_size=64)
    single = _grads(algo, groups, policy=copy.deepcopy(policy), reference=reference, micro_batch_size=1)
    pairs = _grads(algo, groups, policy=copy.deepcopy(policy), reference=reference, micro_batch_size=3)
    assert max_rel_diff(whole, single) <= GRAD_TOL
    assert max_rel_diff(whole, pairs) <= GRAD_TOL
    # token budget, padded and packed: micro-batches of several rows, one row longer than the budget alone
    budget = 20
    lengths = (collate(groups).prompt_lens + collate(groups).response_lens).tolist()
    for packed in (False, True):
        cfg = TrainerConfig(max_tokens_per_micro_batch=budget, pack_sequences=packed)
        micros = split_rows(list(range(len(lengths))), lengths, cfg)
        assert max(lengths) > budget and any(len(m) > (1 if packed else 2) for m in micros)
        dynamic = _grads(algo, groups, policy=copy.deepcopy(policy), reference=reference, use_dynamic_bsz=True,
                         max_tokens_per_micro_batch=budget, pack_sequences=packed)
        assert max_rel_diff(whole, dynamic) <= GRAD_TOL


@pytest.mark.parametrize("algo", _AGG_CASES[:4])
def test_policy_gradient_equals_the_autograd_gradient_of_the_plain_loss(algo):
    """An independent check of the normalisation: at ratio ≈ 1 nothing is clipped, so the learner's
    gradient must be that of agg(−A·ratio) computed in one piece on the whole padded batch, with the
    whole batch's token / row counts (and the longest response as Dr.GRPO's constant)."""
    policy = tiny_policy(0).double()
    groups = _ragged_groups(policy)
    got = _grads(algo, groups, policy=copy.deepcopy(policy), micro_batch_size=2)
    batch = collate(groups)
    adv = algo.advantages(batch.rewards, None, batch.group_index, batch.response_mask, None).advantages
    policy.zero_grad()
    logp, _ = response_logprobs(policy, batch, torch.arange(batch.num_rows))
    ratio = torch.exp(torch.where(batch.response_mask, logp - batch.logp_behaviour, torch.zeros_like(logp)))
    algos.agg_loss(-(adv * ratio), batch.response_mask, algo.loss_agg_mode).backward()
    want = {n: p.grad for n, p in policy.named_parameters()}
    assert max_rel_diff(want, got) <= GRAD_TOL


def test_minibatches_and_epochs_each_take_one_optimizer_step():
    policy = tiny_policy(0)
    groups = on_policy(policy, synthetic_groups(7, 2, seed=3, response_lens=(1, 4)))
    state = build_learner(policy, trainer_config(ppo_epochs=2, mini_batch_size=3, shuffle=True), GRPO())
    state, metrics = train_step(state, groups)
    assert state.optimizer_steps == 2 * 3 and state.step == 1 and state.scheduler.last_epoch == 6
    assert metrics["training/num_groups"] == 7


@pytest.mark.parametrize("mini_batches", [1, 3])
def test_several_updates_per_batch_equal_a_loop_of_single_steps_against_the_batchs_proximal_policy(mini_batches):
    """Decoupled PPO with M mini-batches per learner step (verl's ppo_mini_batch_size < train_batch_size;
    here --trainer.mini-batch-size 6/M with a batch of 6 groups, as --async-training.require-batches M gives):
    π_prox is computed once, before the first update, so the result equals a hand-written loop of M one-update
    steps on the same mini-batches whose π_old is that same π_prox (the behaviour log-probs replaced by it).
    Recomputing π_prox at every update (M separate learner steps) is another algorithm: from the second update
    on the proximal clip acts only in the first."""
    policy = tiny_policy(0).double()
    groups = on_policy(policy, synthetic_groups(6, 3, seed=5, response_lens=(2, 6)), shift=0.3)  # μ ≠ π_θ
    decoupled = OffPolicyConfig(use_rollout_log_probs=False)
    size, lr = 6 // mini_batches, 0.05
    one = build_learner(copy.deepcopy(policy), trainer_config(mini_batch_size=size, off_policy=decoupled, lr=lr),
                        GRPO())
    one, metrics = train_step(one, groups)
    assert one.optimizer_steps == mini_batches
    # the loop: one learner step per mini-batch, π_old = the batch's π_prox, frozen before the first update
    loop = build_learner(copy.deepcopy(policy), trainer_config(mini_batch_size=size, lr=lr), GRPO())
    proximal = on_policy(policy, groups)
    for k in range(mini_batches):
        loop, _ = train_step(loop, proximal[k * size:(k + 1) * size])
    assert max_rel_diff(weights(one.policy), weights(loop.policy)) <= GRAD_TOL
    if mini_batches > 1:  # the later updates were clipped around the frozen π_prox ...
        assert metrics["actor/pg_clipfrac"] > 0
        again = build_learner(copy.deepcopy(policy), trainer_config(mini_batch_size=size, off_policy=decoupled,
                                                                    lr=lr), GRPO())
        for k in range(mini_batches):  # ... which a π_prox recomputed before each update never is
            again, step_metrics = train_step(again, groups[k * size:(k + 1) * size])
            assert step_metrics["actor/pg_clipfrac"] == 0
        assert max_rel_diff(weights(one.policy), weights(again.policy)) > 1e-6


@settings(max_examples=100)
@given(st.data())
def test_micro_batches_respect_the_token_budget_and_cover_every_row_once(data):
    n = data.draw(st.integers(0, 30))
    lengths = data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    rows = data.draw(st.permutations(range(n)))[:data.draw(st.integers(0, n))]
    budget = data.draw(st.integers(1, 120))
    for packed in (False, True):
        cfg = TrainerConfig(use_dynamic_bsz=True, max_tokens_per_micro_batch=budget, pack_sequences=packed)
        micros = split_rows(list(rows), lengths, cfg)
        flat = [r for m in micros for r in m]
        assert sorted(flat) == sorted(rows)  # every row exactly once, nothing else
        assert all(m for m in micros)
        for m in micros:
            # padded: rows × the longest row; packed: the sum of the rows' lengths (no padding)
            cost = sum(lengths[r] for r in m) if packed else len(m) * max(lengths[r] for r in m)
            assert len(m) == 1 or cost <= budget, (packed, m, [lengths[r] for r in m], budget)
        if packed:  # first fit: a row that opened a new micro-batch fitted in none of the earlier ones
            for k, m in enumerate(micros):
                assert all(sum(lengths[r] for r in earlier) + lengths[m[0]] > budget for earlier in micros[:k])
    fixed = split_rows(list(rows), lengths, TrainerConfig(use_dynamic_bsz=False, micro_batch_size=3))
    assert [r for m in fixed for r in m] == list(rows) and all(1 <= len(m) <= 3 for m in fixed)


# ========================================================================================= 4. the critic
def test_critic_learns_the_value_of_a_constant_reward():
    """Every reward 1, γ = λ = 1: the return of every response position is 1, so V → 1 there."""
    policy = tiny_policy(0)
    groups = synthetic_groups(4, 4, seed=3, rewards=[[1.0] * 4] * 4)
    state = build_learner(policy, trainer_config(lr=1e-4), PPO(gamma=1.0, lam=1.0, critic=CriticConfig(lr=1e-2)))
    batch = collate(groups)
    vf_losses = []
    for _ in range(25):
        state, metrics = train_step(state, groups)
        vf_losses.append(metrics["critic/vf_loss"])
    with torch.no_grad():
        values = response_values(state.critic, batch, torch.arange(batch.num_rows))[batch.response_mask]
    assert vf_losses[0] == pytest.approx(0.5, abs=1e-6)  # V ≡ 0 at the start: ½·(0 − 1)²
    assert float((values - 1).abs().max()) < 0.1, values
    assert max(vf_losses[-5:]) < 0.01 * vf_losses[0], vf_losses


@pytest.mark.parametrize("lag_steps", [0, 1])
def test_concurrent_and_sequential_critic_updates_give_identical_weights(lag_steps):
    """The critic's update in a worker thread reads the same prepared batch as the sequential one; with
    `warmup_steps` the actor is frozen meanwhile."""
    groups = synthetic_groups(4, 4, seed=3)
    results = []
    for concurrent in (True, False):
        policy = tiny_policy(0)
        algo = PPO(critic=CriticConfig(lr=1e-2, concurrent=concurrent, warmup_steps=lag_steps))
        state = build_learner(policy, trainer_config(lr=1e-3, ppo_epochs=2, mini_batch_size=2), algo)
        for _ in range(2):
            state, metrics = train_step(state, groups)
        results.append((weights(state.policy), weights(state.critic), metrics))
    (pa, ca, ma), (pb, cb, mb) = results
    assert all(torch.equal(pa[k], pb[k]) for k in pa) and all(torch.equal(ca[k], cb[k]) for k in ca)
    assert ma["critic/vf_loss"] == mb["critic/vf_loss"] and ma["actor/pg_loss"] == mb["actor/pg_loss"]
    initial = weights(tiny_policy(0))
    assert any(not torch.equal(initial[k], pa[k]) for k in pa)  # the actor did move after warm-up


def test_critic_warmup_steps_freeze_the_actor():
    policy = tiny_policy(0)
    before = weights(policy)
    state = build_learner(policy, trainer_config(lr=1e-3), PPO(critic=CriticConfig(lr=1e-2, warmup_steps=2)))
    critic_before = weights(state.critic)
    groups = synthetic_groups(2, 4, seed=3)
    for _ in range(2):
        state, metrics = train_step(state, groups)
        assert "actor/pg_loss" not in metrics and math.isfinite(metrics["critic/vf_loss"])
    assert all(torch.equal(before[k], v) for k, v in weights(policy).items())
    assert any(not torch.equal(critic_before[k], v) for k, v in weights(state.critic).items())
    state, metrics = train_step(state, groups)
    assert "actor/pg_loss" in metrics and any(not torch.equal(before[k], v) for k, v in weights(policy).items())


def test_critic_update_is_independent_of_micro_batching():
    groups = synthetic_groups(4, 4, seed=8, prompt_lens=(1, 9), response_lens=(1, 12))
    critics = []
    for micro in (1, 64):
        state = build_learner(tiny_policy(0).double(), trainer_config(lr=1e-3, micro_batch_size=micro),
                              PPO(critic=CriticConfig(lr=1e-2)))
        for _ in range(2):
            state, metrics = train_step(state, groups)
        critics.append(weights(state.critic))
    for k in critics[0]:
        torch.testing.assert_close(critics[0][k], critics[1][k], atol=1e-9, rtol=0)


# ====================================================================== 6. non-finite updates are skipped
class _NaNLossGRPO(GRPO):
    """GRPO whose policy loss is NaN (a stand-in for an overflow inside the loss)."""

    def policy_loss(self, *args, **kwargs):
        result = super().policy_loss(*args, **kwargs)
        return result._replace(loss=result.loss * NAN)


@pytest.mark.parametrize("inject", ["gradient-hook", "loss"])
@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_a_non_finite_gradient_skips_the_update_and_is_counted(inject, grad_clip):
    policy = tiny_policy(0)
    groups = on_policy(policy, synthetic_groups(3, 4, seed=2))
    cfg = trainer_config(optim=OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=grad_clip, warmup_steps=3))
    state = build_learner(policy, cfg, GRPO())
    state, clean = train_step(state, groups)
    assert clean["actor/skipped_updates"] == 0 and state.optimizer_steps == 1
    before, lr, epoch = weights(policy), state.scheduler.get_last_lr()[0], state.scheduler.last_epoch
    adam = copy.deepcopy(state.optimizer.state_dict()["state"])

    param = policy.model.layers[1].mlp.down_proj.weight
    if inject == "gradient-hook":
        handle = param.register_hook(lambda g: torch.full_like(g, NAN))
        state, metrics = train_step(state, groups)
        handle.remove()
    else:
        state.algorithm = _NaNLossGRPO()
        state, metrics = train_step(state, groups)
        state.algorithm = GRPO()

    assert metrics["actor/skipped_updates"] == 1 and state.skipped_updates == 1
    assert all(torch.equal(before[k], v) for k, v in weights(policy).items())
    assert all(p.grad is None for p in policy.parameters())  # the poisoned gradient is not carried over
    assert state.scheduler.last_epoch == epoch and state.scheduler.get_last_lr()[0] == lr == metrics["actor/lr"]
    after = state.optimizer.state_dict()["state"]
    for i, s in adam.items():
        assert float(after[i]["step"]) == float(s["step"]) == 1.0
        assert torch.equal(after[i]["exp_avg"], s["exp_avg"]) and torch.equal(after[i]["exp_avg_sq"], s["exp_avg_sq"])
    assert math.isfinite(metrics["actor/grad_norm"])

    state, metrics = train_step(state, groups)  # clean again: updates normally
    assert metrics["actor/skipped_updates"] == 1 and state.skipped_updates == 1
    assert any(not torch.equal(before[k], v) for k, v in weights(policy).items())
    assert state.scheduler.last_epoch == epoch + 1
    assert all(float(s["step"]) == 2.0 for s in state.optimizer.state_dict()["state"].values())


def test_grad_norm_metric_averages_only_the_updates_that_happened():
    """Two mini-batches, the first poisoned: the second still steps, and `actor/grad_norm` is its norm (a
    skipped update must not count as a zero norm)."""
    policy = tiny_policy(0).double()
    groups = on_policy(policy, synthetic_groups(4, 4, seed=2))
    reference = policy_gradients(build_learner(copy.deepcopy(policy), trainer_config(), GRPO()), groups[2:])
    want = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in reference.values()])))
    state = build_learner(policy, trainer_config(mini_batch_size=2, micro_batch_size=64), GRPO())
    calls = []

    def poison_first(grad):
        calls.append(1)
        return torch.full_like(grad, NAN) if len(calls) == 1 else grad

    handle = policy.model.layers[0].self_attn.q_proj.weight.register_hook(poison_first)
    state, metrics = train_step(state, groups)
    handle.remove()
    assert len(calls) == 2 and state.skipped_updates == 1 and state.optimizer_steps == 2
    assert all(float(s["step"]) == 1.0 for s in state.optimizer.state_dict()["state"].values())
    assert metrics["actor/grad_norm"] == pytest.approx(want, rel=1e-6)


# ================================================================================ 7. every algorithm
@pytest.mark.parametrize("algo, trainer", ALGORITHM_CASES)
def test_every_algorithm_trains_and_reports_finite_verl_metrics(algo, trainer):
    policy = tiny_policy(0)
    before = weights(policy)
    groups = on_policy(policy, synthetic_groups(4, 4, seed=7, response_lens=(1, 9)))
    state = build_learner(policy, trainer_config(lr=1e-3, mini_batch_size=2, **trainer), algo)
    assert (state.critic is not None) == isinstance(algo, PPO)
    for _ in range(2):
        state, metrics = train_step(state, groups)
    critic_metrics = ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm")
    names = VERL_METRICS + (critic_metrics if isinstance(algo, PPO) else ())
    for name in names:
        assert name in metrics and math.isfinite(metrics[name]), (name, metrics.get(name))
    assert "critic/vf_loss" in metrics if isinstance(algo, PPO) else "critic/vf_loss" not in metrics
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_updates"] == 0
    assert state.step == 2 and state.optimizer_steps == 4 and metrics["training/global_step"] == 2
    assert metrics["response_length/mean"] == pytest.approx(float(collate(groups).response_lens.float().mean()))
    assert any(not torch.equal(before[k], v) for k, v in weights(policy).items())


@pytest.mark.parametrize("field", ["kl_loss_coef", "kl_in_reward_coef"])
def test_a_kl_needs_a_reference_model(field):
    with pytest.raises(ValueError, match="kl_loss_coef / kl_in_reward_coef > 0 need a reference"):
        build_learner(tiny_policy(0), trainer_config(), GRPO(**{field: 0.1}))


def test_kl_loss_starts_at_zero_against_a_copy_and_grows_as_the_policy_moves():
    policy = tiny_policy(0)
    reference = frozen_copy(policy)
    ref_before = weights(reference)
    groups = on_policy(policy, synthetic_groups(3, 4, seed=2))
    state = build_learner(policy, trainer_config(lr=3e-3), GRPO(kl_loss_coef=0.1, kl_in_reward_coef=0.05),
                          reference=reference)
    lp_tol = _logprob_tol(policy, groups)  # ~5e-5 (logits O(3)); the KL after two steps is > 1e-4
    state, first = train_step(state, groups)
    # k3 = e^δ − δ − 1 with δ ≈ 0 cancels terms of size 1: float32 rounding over the token mean
    n_tokens = int(collate(groups).response_mask.sum())
    assert abs(first["actor/kl_loss"]) < close_tol(torch.float32, 1.0, terms=n_tokens, depth=2)
    assert abs(first["actor/reward_kl"]) < lp_tol
    for _ in range(2):
        state, metrics = train_step(state, groups)
    assert metrics["actor/kl_loss"] > 1e-4 and math.isfinite(metrics["actor/reward_kl"])
    assert all(torch.equal(ref_before[k], v) for k, v in weights(reference).items())
    assert not any(p.requires_grad for p in reference.parameters())


@pytest.mark.parametrize("kl", [0.5, 0.0], ids=["kl-above-target", "kl-below-target"])
def test_adaptive_kl_controller_moves_the_coefficient_toward_the_target(kl):
    """β ← β·(1 + clip(KL/target − 1, ±0.2)·N/horizon): up when the KL exceeds the target, down below it.
    The reward KL is k1(π_old, π_ref) with π_old the behaviour log-probs, here the reference's own + `kl`."""
    policy = tiny_policy(0)
    reference = frozen_copy(policy)
    groups = on_policy(policy, synthetic_groups(3, 4, seed=2), shift=-kl)
    algo = GRPO(kl_in_reward_coef=0.1, kl_target=0.05, kl_horizon=100)
    state = build_learner(policy, trainer_config(lr=1e-3), algo, reference=reference)
    beta, lp_tol = [], _logprob_tol(policy, groups)
    for _ in range(3):
        before = state.kl_coef
        state, metrics = train_step(state, groups)
        assert metrics["actor/kl_coef"] == before and metrics["actor/reward_kl"] == pytest.approx(kl, abs=lp_tol)
        error = min(max(metrics["actor/reward_kl"] / 0.05 - 1, -0.2), 0.2)
        assert state.kl_coef == pytest.approx(before * (1 + error * 12 / 100), rel=1e-12)
        beta.append(state.kl_coef)
    if kl > 0.05:
        assert 0.1 < beta[0] < beta[1] < beta[2] and beta[2] == pytest.approx(0.1 * 1.024 ** 3)
    else:
        assert 0.1 > beta[0] > beta[1] > beta[2] and beta[2] == pytest.approx(0.1 * 0.976 ** 3)


# =================================================================================== 8. off-policy knobs
def test_max_version_lag_removes_too_stale_rows_from_the_loss():
    policy = tiny_policy(0).double()
    groups = on_policy(policy, synthetic_groups(4, 4, seed=9, prompt_lens=(1, 8), response_lens=(1, 10)))
    for g, v in zip(groups, [5, 4, 3, 1]):  # lags 0, 1, 2, 4
        for c in g.completions:
            c.versions = [v] * len(c.versions)
    capped = OffPolicyConfig(max_version_lag=2)
    got = _grads(GRPO(), groups, policy=copy.deepcopy(policy), version=5, off_policy=capped)
    without = _grads(GRPO(), groups[:3], policy=copy.deepcopy(policy), version=5)
    uncapped = _grads(GRPO(), groups, policy=copy.deepcopy(policy), version=5)
    assert max_rel_diff(without, got) <= GRAD_TOL
    assert max_rel_diff(without, uncapped) > 1e-3  # the stale group did contribute before

    state = build_learner(copy.deepcopy(policy), trainer_config(off_policy=capped), GRPO())
    state.version = 5
    _, metrics = train_step(state, groups)
    lens = [len(c.token_ids) for g in groups for c in g.completions]
    assert metrics["training/stale_masked_fraction"] == pytest.approx(sum(lens[12:]) / sum(lens))
    assert metrics["training/version_lag/max"] == 4


def test_token_level_version_cap_masks_only_the_stale_tokens():
    groups = synthetic_groups(2, 2, seed=1, response_lens=(4, 4))
    versions = [[1, 2, 3, 3], [3, 3, 3, 3], [0, 0, 2, 3], [2, 3, 3, 3]]  # current 3, cap 1: lag > 1 is stale
    for c, v in zip([c for g in groups for c in g.completions], versions):
        c.versions = v
    policy = tiny_policy(0)
    off = OffPolicyConfig(max_version_lag=1, stale_level="token")
    state = build_learner(policy, trainer_config(off_policy=off), GRPO())
    state.version = 3
    _, metrics = train_step(state, on_policy(policy, groups))
    assert metrics["training/stale_masked_fraction"] == pytest.approx(3 / 16)


@pytest.mark.parametrize("off, metric", [
    (OffPolicyConfig(use_rollout_log_probs=False, rs_stat="k1", rs_level="mean", rs_upper=1.5),
     "rollout_corr/rejected_fraction"),
    # M2PO: λ = 1 (λ² = 1) on that group, ≈ 0 elsewhere; τ = 1e-3 is below 1 / (the other tokens' count), so every
    # token of the group has to go (one kept would leave a mean ≥ τ) and none of the others
    (OffPolicyConfig(use_rollout_log_probs=False, m2_threshold=1e-3), "rollout_corr/m2po_rejected_fraction"),
], ids=["sequence-rejection", "m2po"])
def test_a_mismatched_group_is_masked_and_only_it(off, metric):
    """One group's behaviour log-probs are 1 nat too low (ratio e ≫ 1.5); the others are on-policy. The gradient
    is the step's without that group, and the metric is its share of the tokens."""
    policy = tiny_policy(0).double()
    groups = on_policy(policy, synthetic_groups(4, 4, seed=9, prompt_lens=(1, 8), response_lens=(1, 10)))
    groups[1:2] = on_policy(policy, groups[1:2], shift=1.0)
    got = _grads(GRPO(), groups, policy=copy.deepcopy(policy), off_policy=off)
    without = _grads(GRPO(), groups[:1] + groups[2:], policy=copy.deepcopy(policy),
                     off_policy=OffPolicyConfig(use_rollout_log_probs=False))
    assert max_rel_diff(without, got) <= GRAD_TOL
    state = build_learner(copy.deepcopy(policy), trainer_config(off_policy=off), GRPO())
    _, metrics = train_step(state, groups)
    lens = [len(c.token_ids) for g in groups for c in g.completions]
    assert metrics[metric] == pytest.approx(sum(lens[4:8]) / sum(lens))


def test_the_behaviour_kl_term_adds_beta_times_its_gradient_and_vanishes_on_policy():
    """loss = policy loss + β·KL_k3(π_θ ‖ μ): the gradient is affine in β (g(2β) − g(0) = 2·(g(β) − g(0))),
    nonzero where behaviour log-probs differ from the policy's, and ~0 where they agree (k3's gradient at
    π_θ = μ is 0); the step reports the term as actor/behaviour_kl."""
    policy = tiny_policy(0).double()
    groups = on_policy(policy, synthetic_groups(3, 4, seed=5, prompt_lens=(1, 8), response_lens=(1, 10)))
    shifted = groups[:1] + on_policy(policy, groups[1:], shift=0.5)

    def grads(beta, data):
        return _grads(GRPO(), data, policy=copy.deepcopy(policy), off_policy=OffPolicyConfig(behaviour_kl_coef=beta))

    g0, g1, g2 = grads(0.0, shifted), grads(0.3, shifted), grads(0.6, shifted)
    delta1 = {k: g1[k] - g0[k] for k in g0}
    delta2 = {k: g2[k] - g0[k] for k in g0}
    scale = max(float(v.abs().max()) for v in g0.values())
    assert max(float(d.abs().max()) for d in delta1.values()) > 1e-2 * scale  # the term acts on mismatched data
    # the difference of two gradients keeps the rounding of each: bound it at the gradients' own scale
    assert max(float((2 * delta1[k] - delta2[k]).abs().max()) for k in g0) <= 1e-6 * scale
    on0, on1 = grads(0.0, groups), grads(0.6, groups)
    assert max(float((on1[k] - on0[k]).abs().max()) for k in on0) <= 1e-6 * scale
    state = build_learner(copy.deepcopy(policy), trainer_config(off_policy=OffPolicyConfig(behaviour_kl_coef=0.3)),
                          GRPO())
    _, metrics = train_step(state, shifted)
    assert metrics["actor/behaviour_kl"] > 0


def test_importance_weights_need_recomputed_log_probs():
    want = r"--trainer\.off-policy\.is-level token is invalid.*--trainer\.off-policy\.no-use-rollout-log-probs"
    with pytest.raises(ValueError, match=want):
        build_learner(tiny_policy(0), TrainerConfig(off_policy=OffPolicyConfig(is_level="token")), GRPO())


@pytest.mark.parametrize("is_level", ["token", "sequence"])
def test_is_weights_are_one_when_behaviour_and_proximal_policies_agree(is_level):
    policy = tiny_policy(0)
    groups = on_policy(policy, synthetic_groups(3, 4, seed=2))
    off = OffPolicyConfig(use_rollout_log_probs=False, is_level=is_level)
    state = build_learner(policy, trainer_config(off_policy=off), GRPO())
    lp_tol = _logprob_tol(policy, groups)  # ~5e-5: behaviour and proximal log-probs differ by rounding only
    _, metrics = train_step(state, groups)
    assert abs(metrics["rollout_corr/mismatch_kl"]) < lp_tol
    assert metrics["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=lp_tol)  # e^δ − 1 ≈ δ
    n_tokens = int(collate(groups).response_mask.sum())
    # ESS = (Σw)² / (N·Σw²) = 1 − O(δ²): float32 rounding of sums of N terms of size 1
    assert metrics["rollout_corr/ess"] == pytest.approx(1.0, abs=close_tol(torch.float32, 1.0, terms=n_tokens, depth=2))
    assert metrics["rollout_corr/is_truncated_fraction"] == 0.0


@pytest.mark.parametrize("threshold, scale", [(2.0, math.exp(0.1)), (1.05, 1.05)])
def test_token_is_weights_scale_the_gradient(threshold, scale):
    """Behaviour log-probs 0.1 below the policy's: every token weight is e^0.1 (or the truncation C)."""
    policy = tiny_policy(0).double()
    groups = on_policy(policy, synthetic_groups(4, 4, seed=9, prompt_lens=(1, 8), response_lens=(1, 10)), shift=0.1)
    recompute = OffPolicyConfig(use_rollout_log_probs=False)
    plain = _grads(GRPO(), groups, policy=copy.deepcopy(policy), off_policy=recompute)
    off = OffPolicyConfig(use_rollout_log_probs=False, is_level="token", is_threshold=threshold)
    weighted = _grads(GRPO(), groups, policy=copy.deepcopy(policy), off_policy=off)
    assert max_rel_diff({k: scale * v for k, v in plain.items()}, weighted) <= 1e-5
    state = build_learner(copy.deepcopy(policy), trainer_config(off_policy=off), GRPO())
    _, metrics = train_step(state, groups)
    assert metrics["rollout_corr/mismatch_kl"] == pytest.approx(-0.1, abs=1e-5)
    assert metrics["rollout_corr/is_truncated_fraction"] == (1.0 if threshold < math.exp(0.1) else 0.0)


def test_non_finite_behaviour_logprobs_are_masked_and_counted():
    """A NaN or ±inf behaviour log-prob (an engine or transport fault) is never trained on: collate leaves the
    token out of the mask and counts it, the step stays finite, and the outcome reward still reaches the row."""
    policy = tiny_policy(0).double()
    groups = on_policy(policy, synthetic_groups(2, 4, seed=3, response_lens=(4, 8)))
    bad = copy.deepcopy(groups)
    bad[0].completions[1].logprobs[2] = float("nan")
    bad[1].completions[0].logprobs[-1] = float("-inf")  # the last token: the row's reward moves to the one before
    batch = collate(bad)
    assert batch.nonfinite_logprobs == 2 and bool(torch.isfinite(batch.logp_behaviour).all())
    assert not batch.response_mask[1, 2] and batch.response_lens.tolist() == collate(groups).response_lens.tolist()
    for off in (OffPolicyConfig(), OffPolicyConfig(use_rollout_log_probs=False, is_level="token")):
        state = build_learner(copy.deepcopy(policy), trainer_config(off_policy=off), GRPO())
        _, metrics = train_step(state, bad)
        assert metrics["rollout/nonfinite_logprob_tokens"] == 2 and state.skipped_updates == 0
        assert all(bool(torch.isfinite(p).all()) for p in state.policy.parameters())
    grads = _grads(GRPO(), bad, policy=copy.deepcopy(policy))
    assert all(bool(torch.isfinite(g).all()) for g in grads.values())
    from asyncrl.learner.prepare import _token_rewards
    last = len(bad[1].completions[0].logprobs) - 1
    assert _token_rewards(batch)[4, last - 1] == batch.rewards[4] and _token_rewards(batch)[4, last] == 0


def test_the_ratio_uses_the_behaviour_logprobs_it_is_given():
    """use_rollout_log_probs: π_old is the behaviour log-prob as recorded, never silently the current policy's.
    Behaviour log-probs 0.05 below the policy's make every ratio e^0.05 (inside the clip range), so the PPO
    gradient is e^0.05 times the on-policy one."""
    policy = tiny_policy(0).double()
    groups = synthetic_groups(4, 4, seed=9, prompt_lens=(1, 8), response_lens=(1, 10))
    same = _grads(GRPO(), on_policy(policy, groups), policy=copy.deepcopy(policy))
    shifted = _grads(GRPO(), on_policy(policy, groups, shift=0.05), policy=copy.deepcopy(policy))
    assert max_rel_diff({k: math.exp(0.05) * v for k, v in same.items()}, shifted) <= 1e-6
    assert max_rel_diff(same, shifted) > 0.04


# ================================================================================ 9. config validation
_BAD = [
    (lambda: GRPO(clip_ratio_low=1.0), "--algorithm.clip-ratio-low"),
    (lambda: DAPO(clip_ratio_c=0.5), "--algorithm.clip-ratio-c"),
    (lambda: GSPO(loss_agg_mode="x"), "--algorithm.loss-agg-mode"),
    (lambda: PPO(kl_loss_type="k9"), "--algorithm.kl-loss-type"),
    (lambda: CISPO(clip_ratio_high=-0.1), "--algorithm.clip-ratio-high"),
    (lambda: RLOO(entropy_coef=-1.0), "--algorithm.entropy-coef"),
    (lambda: DrGRPO(overlong_buffer_len=-1), "--algorithm.overlong-buffer-len"),
    (lambda: TrainerConfig(optim=OptimConfig(lr=0.0)), "--trainer.optim.lr"),
    (lambda: TrainerConfig(optim=OptimConfig(schedule="cosine")), "--trainer.optim.total-steps"),
    (lambda: TrainerConfig(optim=OptimConfig(min_lr_ratio=1.5)), "--trainer.optim.min-lr-ratio"),
    (lambda: TrainerConfig(mini_batch_size=0), "--trainer.mini-batch-size"),
    (lambda: TrainerConfig(max_tokens_per_micro_batch=0), "--trainer.max-tokens-per-micro-batch"),
    (lambda: TrainerConfig(temperature=0.0), "--trainer.temperature"),
    (lambda: TrainerConfig(off_policy=OffPolicyConfig(is_level="sequence")), "--trainer.off-policy.is-level"),
    (lambda: TrainerConfig(off_policy=OffPolicyConfig(rs_stat="k2")), "--trainer.off-policy.rs-upper"),
    (lambda: TrainerConfig(off_policy=OffPolicyConfig(max_version_lag=-1)), "--trainer.off-policy.max-version-lag"),
    (lambda: TrainerConfig(off_policy=OffPolicyConfig(use_rollout_log_probs=False, m2_threshold=0.0)),
     "--trainer.off-policy.m2-threshold"),
    (lambda: TrainerConfig(off_policy=OffPolicyConfig(m2_threshold=0.04)), "--trainer.off-policy.m2-threshold"),
    (lambda: TrainerConfig(off_policy=OffPolicyConfig(behaviour_kl_coef=-0.1)), "--trainer.off-policy.behaviour-kl-coef"),
]


@pytest.mark.parametrize("make, name", _BAD, ids=[name for _, name in _BAD])
def test_bad_config_values_raise_naming_the_field(make, name):
    cfg = make()
    with pytest.raises(ValueError, match=re.escape(name) + " .* is invalid"):
        cfg.validate()
    trainer, algo = (cfg, GRPO()) if isinstance(cfg, TrainerConfig) else (TrainerConfig(), cfg)
    with pytest.raises(ValueError, match=re.escape(name)):
        build_learner(tiny_policy(0), trainer, algo)


def test_default_configs_validate():
    # validate() raises on a bad value and returns None otherwise: every default must pass
    assert TrainerConfig().validate() is None
    for algo in (GRPO(), DrGRPO(), DAPO(), GSPO(), CISPO(), RLOO(), ReinforcePP(), PPO(), GRPO(kl_loss_type="k3+")):
        assert algo.validate() is None, type(algo).__name__


# ======================================================================================= 10. schedules
def _lrs(cfg: OptimConfig, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = make_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_is_linear_then_cosine_reaches_the_floor_at_total_steps():
    lr, warm, total = 0.5, 4, 20
    lrs = _lrs(OptimConfig(lr=lr, warmup_steps=warm, schedule="cosine", total_steps=total, min_lr_ratio=0.1), 30)
    assert lrs[:warm + 1] == pytest.approx([lr * (k + 1) / (warm + 1) for k in range(warm + 1)])
    steps = [b - a for a, b in zip(lrs[:warm + 1], lrs[1:warm + 1])]
    assert steps == pytest.approx([lr / (warm + 1)] * warm)  # linear, peak reached at the end of warm-up
    assert lrs[warm] == pytest.approx(lr)
    assert all(b <= a for a, b in zip(lrs[warm:total + 1], lrs[warm + 1:total + 1]))
    assert lrs[(warm + total) // 2] == pytest.approx(lr * (0.1 + 0.9 * 0.5))  # cosine midpoint
    assert lrs[total:] == pytest.approx([0.1 * lr] * (30 - total))


def test_constant_schedule_stays_at_the_peak():
    lrs = _lrs(OptimConfig(lr=0.25, warmup_steps=2), 40)
    assert lrs[:3] == pytest.approx([0.25 / 3, 0.5 / 3, 0.25]) and lrs[2:] == [0.25] * 38
    assert _lrs(OptimConfig(lr=0.25), 5) == [0.25] * 5


def test_train_step_advances_the_schedule_once_per_optimizer_step():
    policy = tiny_policy(0)
    cfg = trainer_config(mini_batch_size=1, optim=OptimConfig(lr=0.01, warmup_steps=4, weight_decay=0.0))
    state = build_learner(policy, cfg, GRPO())
    _, metrics = train_step(state, on_policy(policy, synthetic_groups(2, 2, seed=0)))
    assert state.optimizer_steps == 2 and metrics["actor/lr"] == pytest.approx(0.01 * 3 / 5)


# ===================================================== 11. memory options on the CPU: checkpointing, bf16 weights
def _count_forwards(policy) -> dict[str, int]:
    """Runs of every decoder layer's attention and MLP blocks, a recomputation in the backward pass included
    (counted by wrapping `forward`: torch's checkpoint recomputes without calling forward hooks)."""
    calls = {"self_attn": 0, "mlp": 0}

    def counting(block: str, forward):
        def run(*args, **kwargs):
            calls[block] += 1
            return forward(*args, **kwargs)
        return run

    for layer in policy.model.layers:
        for block in calls:
            module = getattr(layer, block)
            module.forward = counting(block, module.forward)
    return calls


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("scope", ["mlp", "layer"])
def test_checkpointing_recomputes_its_scope_and_leaves_loss_and_gradients_unchanged(scope, packed):
    """`--trainer.gradient-checkpointing` with `--trainer.checkpoint-scope mlp` (the default scope) or `layer`
    recomputes those blocks in the backward pass and changes nothing else: in float64 the gradient, the loss
    and the updated weights equal those of no checkpointing to round-off (GRAD_TOL)."""
    policy = tiny_policy(0).double()
    groups = _ragged_groups(policy)
    layout = dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=40, pack_sequences=packed)
    results = {}
    for checkpointing in (False, True):
        model = copy.deepcopy(policy)
        calls = _count_forwards(model)
        cfg = trainer_config(gradient_checkpointing=checkpointing, checkpoint_scope=scope, **layout)
        grads = _grads(GRPO(), groups, policy=model, **layout, gradient_checkpointing=checkpointing,
                       checkpoint_scope=scope)
        counted = dict(calls)
        state, metrics = train_step(build_learner(model, cfg, GRPO()), groups)
        results[checkpointing] = grads, metrics, weights(state.policy), counted
    (plain, plain_m, plain_w, plain_calls), (ckpt, ckpt_m, ckpt_w, ckpt_calls) = results[False], results[True]
    # the scope is what is recomputed: each block ran once more per micro-batch in the backward pass
    assert plain_calls["mlp"] == plain_calls["self_attn"] > 0
    assert ckpt_calls["mlp"] == 2 * plain_calls["mlp"]
    assert ckpt_calls["self_attn"] == (2 if scope == "layer" else 1) * plain_calls["self_attn"]
    assert max_rel_diff(plain, ckpt) <= GRAD_TOL
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert ckpt_m[name] == pytest.approx(plain_m[name], rel=GRAD_TOL, abs=GRAD_TOL), name
    assert max_rel_diff(plain_w, ckpt_w) <= GRAD_TOL


def _rel_l2(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """|got − want| / |want| over all tensors together, in float64."""
    num = sum(float((got[k].double() - want[k].double()).norm() ** 2) for k in want) ** 0.5
    den = sum(float(want[k].double().norm() ** 2) for k in want) ** 0.5
    assert den > 0, "the reference is zero: the comparison would be vacuous"
    return num / den


def _step_delta(model, groups: list[Group], lr: float) -> dict[str, torch.Tensor]:
    """The change of every weight in one train_step (float64)."""
    before = {k: v.double() for k, v in weights(model).items()}
    state, metrics = train_step(build_learner(model, trainer_config(lr=lr), GRPO()), groups)
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/skipped_updates"] == 0
    return {k: v.double() - before[k] for k, v in weights(state.policy).items()}


def _bf16_rounding_noise(start: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> float:
    """The relative L2 error that storing `start + delta` in bf16 gives `delta`: each weight w is rounded to a
    grid of spacing ulp(w) = 2^floor(log2|w|)·eps, an error uniform in ±ulp/2 (rms ulp/√12)."""
    eps = torch.finfo(torch.bfloat16).eps
    squares, size = 0.0, 0.0
    for k, d in delta.items():
        new = (start[k].double() + d).abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        squares += float(((2.0 ** torch.floor(torch.log2(new)) * eps) ** 2 / 12).sum())
        size += float((d ** 2).sum())
    return (squares / size) ** 0.5


def test_bf16_weights_give_the_exact_gradient_to_bf16_accuracy_and_a_step_along_the_fp32_one():
    """`--trainer.param-dtype bfloat16` on the CPU (what the learner gets is a bf16 model). Against the same
    weights in float64 (the bf16 values, exactly), the gradient agrees to bf16 accuracy: relative L2 distance
    ≤ close_tol(bfloat16, 1, depth=FORWARD_DEPTH) = 4·4·eps = 0.125. CPU bf16 matmuls accumulate in fp32, so
    each op rounds its output once (terms=1); measured 0.014-0.016 (seeds 0-2). A wrong gradient (a dropped
    term, a wrong normalisation, a lost micro-batch) moves it by O(1), hence a ceiling above the element-wise
    default of 1e-2. The learner's log-probs stay fp32, and a step keeps the weights bf16."""
    exact_model = tiny_policy(0).to(torch.bfloat16).double()  # bf16 values, float64 arithmetic
    groups = _ragged_groups(exact_model)
    exact = _grads(GRPO(), groups, policy=copy.deepcopy(exact_model))
    got = _grads(GRPO(), groups, policy=copy.deepcopy(exact_model).to(torch.bfloat16))
    assert all(g.dtype == torch.bfloat16 for g in got.values()) and got.keys() == exact.keys()
    assert _rel_l2(exact, got) <= close_tol(torch.bfloat16, 1.0, depth=FORWARD_DEPTH, ceiling=0.5)
    bf16 = copy.deepcopy(exact_model).to(torch.bfloat16)
    batch = collate(groups)
    logp, _ = response_logprobs(bf16, batch, torch.arange(batch.num_rows))
    assert logp.dtype == torch.float32
    # one step at the learner tests' lr (1e-3): the weights stay bf16 and move as the fp32 step from the same
    # weights, up to rounding the new weights to bf16 (measured 0.17-0.18 of the step, expected 0.19; ×2 margin)
    delta = _step_delta(bf16, groups, lr=1e-3)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    want = _step_delta(copy.deepcopy(exact_model).float(), groups, lr=1e-3)
    assert _rel_l2(want, delta) <= 2 * _bf16_rounding_noise(weights(exact_model), want)


@pytest.mark.xfail(strict=True, reason="bf16 weights lose updates smaller than half their bf16 spacing: at the "
                   "default --optim.lr 1e-6 a step moves <1% of the weights (cosine 0.07 with the fp32 step); needs "
                   "fp32 master weights, stochastic rounding or compensated (Kahan) updates in the optimizer")
def test_bf16_weights_apply_a_step_at_the_default_learning_rate():
    start = tiny_policy(0).to(torch.bfloat16)
    groups = _ragged_groups(copy.deepcopy(start).double())
    lr = OptimConfig().lr
    want = _step_delta(copy.deepcopy(start).float(), groups, lr=lr)
    assert _rel_l2(want, _step_delta(copy.deepcopy(start), groups, lr=lr)) < 0.25


@pytest.mark.slow
def test_a_short_run_with_bf16_weights_trains_and_checkpoints_bf16_weights(tmp_path):
    """`asyncrl train` with `--trainer.param-dtype bfloat16` (in this process, the local launcher: trainer, rollout
    agent, weight publication, checkpoint) on the toy task: every version trains with finite metrics and no
    skipped update, and the checkpoint holds bf16 weights."""
    run_dir = tmp_path / "bf16"
    train_here("cpu-demo", "--model.path", "random:tiny-qwen2", "--data.task", "toy", "--wandb", "off", *NO_EVAL,
               "--trainer.param-dtype", "bfloat16", "--async-training.total-versions", "3", "--checkpoint-every", "3",
               "--run-dir", str(run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert math.isfinite(row[name]) and row["actor/skipped_updates"] == 0, (name, row)
    payload = torch.load(run_dir / "checkpoints" / "step_00000003" / "learner.pt", weights_only=True)
    assert {v.dtype for v in payload["policy"].values()} == {torch.bfloat16}


# ========================================================================= 12. DAPO end to end, with the engine
def test_dapo_loop_with_the_engine_raises_the_reward():
    """Generate with an engine holding its own copy of the weights, score (fraction of even tokens),
    filter the all-equal groups, train, publish the new weights; the mean reward climbs."""
    torch.manual_seed(0)
    policy = tiny_policy(0)
    engine = Engine(copy.deepcopy(policy), EngineConfig(max_slots=48, max_len=32, attend_bucket=16))
    algo = DAPO(overlong_buffer_len=2)
    state = build_learner(policy, trainer_config(lr=1e-2, max_response_length=8, mini_batch_size=3), algo)
    gen = torch.Generator().manual_seed(0)
    mean_rewards = []
    for step in range(14):
        prompts = [torch.randint(3, VOCAB, (4,), generator=gen).tolist() for _ in range(6)]
        outs = engine.generate(prompts, SamplingParams(n=8, max_new_tokens=8, seed=1000 * step))
        groups = [Group(6 * step + k, p, o.completions, [reward_even_fraction(c.token_ids) for c in o.completions],
                        admitted_version=state.version) for k, (p, o) in enumerate(zip(prompts, outs))]
        assert all(c.versions == [step] * len(c.token_ids) for g in groups for c in g.completions)
        mean_rewards.append(sum(sum(g.rewards) for g in groups) / sum(len(g.rewards) for g in groups))
        kept, dropped = filter_groups(groups)
        assert all(min(g.rewards) == max(g.rewards) for g in dropped)
        if kept:
            state, metrics = train_step(state, kept)
            assert metrics["training/version_lag/max"] == 0 and metrics["actor/skipped_updates"] == 0
        state.version = step + 1
        engine.update_weights(full_weights(state.policy), version=state.version)
    start, end = sum(mean_rewards[:3]) / 3, sum(mean_rewards[-3:]) / 3
    assert end > start + 0.2, mean_rewards
