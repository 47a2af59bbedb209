"""The drift metrics and the off-policy sequence mask in a learner step (asyncrl/learner/update.py with
asyncrl/algos/drift.py): on-policy samples report no drift and an ESS of 1; with μ above π_θ by 0.1 nats a token
(ratios 0.905, inside the clip range, so every sequence has a gradient), `--trainer.off-policy.opsm-threshold 0.05`
removes exactly the negative-advantage sequences (the logged fraction is their share of the tokens) and changes the
step, while a threshold no drift reaches leaves it as without masking."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from asyncrl.config import GRPO, OffPolicyConfig
from asyncrl.learner import build_learner, collate, train_step
from asyncrl.learner.prepare import prepare
from tests.learner_helpers import max_rel_diff, on_policy, synthetic_groups, tiny_policy, trainer_config, weights


def _step(policy, groups, **off_policy):
    state = build_learner(copy.deepcopy(policy), trainer_config(lr=1e-2, off_policy=OffPolicyConfig(**off_policy)),
                          GRPO())
    state, metrics = train_step(state, groups)
    return weights(state.policy), metrics, state


def test_on_policy_samples_show_no_drift():
    policy = tiny_policy()
    groups = on_policy(policy, synthetic_groups(3, 4, seed=5))
    _, metrics, _ = _step(policy, groups)
    assert abs(metrics["actor/behaviour_k1"]) < 1e-5 and metrics["actor/behaviour_ess"] == pytest.approx(1.0, abs=1e-5)
    assert "actor/opsm_masked_fraction" not in metrics


def test_opsm_removes_the_negative_sequences_the_policy_has_moved_away_from():
    policy = tiny_policy()
    groups = on_policy(policy, synthetic_groups(3, 4, seed=6), shift=-0.1)  # log μ = log π + 0.1
    plain, plain_metrics, state = _step(policy, groups)
    assert plain_metrics["actor/behaviour_k1"] == pytest.approx(0.1, abs=0.02)  # drift read off the loss's ratio
    assert plain_metrics["actor/behaviour_ess"] == pytest.approx(1.0, abs=1e-4)  # a uniform shift: no spread in r
    masked, metrics, _ = _step(policy, groups, opsm_threshold=0.05)
    prep = prepare(build_learner(copy.deepcopy(policy), trainer_config(), GRPO()), collate(groups))
    negative = (prep.advantages * prep.mask).sum(-1) < 0
    share = float(prep.mask[negative].sum()) / float(prep.mask.sum())
    assert 0 < share < 1 and metrics["actor/opsm_masked_fraction"] == pytest.approx(share, rel=1e-5)
    assert max_rel_diff(masked, plain) > 1e-4  # the masked sequences no longer push the step
    unreached, metrics, _ = _step(policy, groups, opsm_threshold=10.0)
    assert metrics["actor/opsm_masked_fraction"] == 0.0
    assert all(torch.equal(unreached[k], plain[k]) for k in plain)


def test_a_negative_threshold_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="opsm-threshold"):
        trainer_config(off_policy=OffPolicyConfig(opsm_threshold=-0.1)).validate()


def test_an_ess_scaled_step_is_the_plain_step_times_the_ess():
    """AdamW's first step is linear in the learning rate (weight decay 0): with ratios π_θ/μ spread by a per-token
    shift, `--trainer.off-policy.ess-scaled-lr` moves every weight by ESS × the plain step's move, the ESS it logs;
    on-policy it is the plain step."""
    policy = tiny_policy()
    gen = torch.Generator().manual_seed(3)
    groups = on_policy(policy, synthetic_groups(3, 4, seed=7))
    groups = [dataclasses.replace(g, completions=[dataclasses.replace(c, logprobs=[x + float(torch.randn(
        (), generator=gen)) * 0.7 for x in c.logprobs]) for c in g.completions]) for g in groups]
    start = weights(policy)
    plain, _, _ = _step(policy, groups)
    scaled, metrics, _ = _step(policy, groups, ess_scaled_lr=True)
    ess = metrics["actor/lr_scale"]
    assert ess == pytest.approx(metrics["actor/behaviour_ess"], rel=1e-5) and 0.2 < ess < 0.95
    for name in start:
        moved, want = scaled[name] - start[name], ess * (plain[name] - start[name])
        assert torch.allclose(moved, want, rtol=1e-4, atol=1e-7), name
    on = on_policy(policy, synthetic_groups(3, 4, seed=7))
    same, metrics, _ = _step(policy, on, ess_scaled_lr=True)
    assert metrics["actor/lr_scale"] == pytest.approx(1.0, abs=1e-5)
    assert max_rel_diff(same, _step(policy, on)[0]) < 1e-4
