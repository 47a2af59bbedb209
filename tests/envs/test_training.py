"""Environment tokens in the learner: they are context, never a training signal. For every algorithm, the
gradient reaching the final hidden state at every position that predicts an environment token is exactly
zero (the last layer's output at a position feeds only that position's next-token log-prob), while the
positions of model tokens get a gradient; and the weight gradient ignores the environment tokens'
log-probs and versions."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from asyncrl.learner import build_learner, policy_gradients
from asyncrl.types import Completion, Group
from tests.learner_helpers import (ALGORITHM_CASES, frozen_copy, max_rel_diff, on_policy, tiny_policy,
                                   trainer_config)

PROMPT = [5, 9, 11, 13]
LAYOUT = [True, True, True, False, False, True, True, False, True, True]  # model, env, model, env, model
ENV_AT = [j for j, m in enumerate(LAYOUT) if not m]


def _groups(policy) -> list[Group]:
    """2 groups × 3 episodes, all of one layout (so every micro-batch row has the same positions)."""
    gen = torch.Generator().manual_seed(0)
    groups = []
    for k in range(2):
        comps = []
        for _ in range(3):
            ids = torch.randint(3, 200, (len(LAYOUT),), generator=gen).tolist()
            comps.append(Completion(ids, [0.0] * len(ids), [0] * len(ids), "stop", loss_mask=list(LAYOUT)))
        groups.append(Group(k, list(PROMPT), comps, [1.0, 0.0, 0.25]))  # no zero advantage
    groups = on_policy(policy, groups)  # on-policy: no clipping zeroes a row (GSPO clips at 4e-4)
    for g in groups:  # the runner's convention: environment tokens carry log-prob 0
        for c in g.completions:
            c.logprobs = [lp if m else 0.0 for lp, m in zip(c.logprobs, LAYOUT)]
    return groups


def _learner(policy, algo, trainer, packed: bool):
    reference = frozen_copy(tiny_policy(1)) if algo.needs_reference else None
    cfg = trainer_config(use_dynamic_bsz=True, max_tokens_per_micro_batch=60, pack_sequences=packed,
                         mini_batch_size=2, **trainer)
    return build_learner(copy.deepcopy(policy), cfg, algo, reference=reference)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("algo, trainer", ALGORITHM_CASES)
def test_positions_predicting_environment_tokens_get_exactly_zero_gradient(algo, trainer, packed):
    policy = tiny_policy(0)
    groups = _groups(policy)
    state = _learner(policy, algo, trainer, packed)
    hidden: list[torch.Tensor] = []

    def keep(module, args, out):
        out.retain_grad()
        hidden.append(out)

    handle = state.policy.model.norm.register_forward_hook(keep)
    policy_gradients(state, groups)
    handle.remove()
    row = len(PROMPT) + len(LAYOUT)
    seen = 0
    for h in hidden:
        if h.grad is None:  # a forward without backward (π_old, reference)
            continue
        rows = h.grad.reshape(-1, row, h.shape[-1]) if packed else h.grad[:, :row]
        norms = rows.norm(dim=-1)  # [rows, positions]
        predicts = [len(PROMPT) + j - 1 for j in range(len(LAYOUT))]  # position that predicts response token j
        env = [predicts[j] for j in ENV_AT]
        model = [predicts[j] for j, m in enumerate(LAYOUT) if m]
        assert torch.all(norms[:, env] == 0), norms[:, env]
        assert torch.all(norms[:, model] > 0), norms[:, model]
        seen += rows.shape[0]
    assert seen == 6


@pytest.mark.parametrize("algo, trainer", ALGORITHM_CASES)
def test_the_gradient_ignores_environment_tokens_log_probs_and_versions(algo, trainer):
    policy = tiny_policy(0)
    groups = _groups(policy)
    altered = []
    for g in groups:
        comps = [dataclasses.replace(c, logprobs=[lp if m else -3.0 for lp, m in zip(c.logprobs, LAYOUT)],
                                     versions=[v if m else -5 for v, m in zip(c.versions, LAYOUT)])
                 for c in g.completions]
        altered.append(dataclasses.replace(g, completions=comps))
    base = policy_gradients(_learner(policy, algo, trainer, True), groups)
    assert max_rel_diff(base, policy_gradients(_learner(policy, algo, trainer, True), altered)) <= 1e-6
    trained = [dataclasses.replace(g, completions=[dataclasses.replace(c, loss_mask=None) for c in g.completions])
               for g in altered]
    assert max_rel_diff(base, policy_gradients(_learner(policy, algo, trainer, True), trained)) > 1e-3
