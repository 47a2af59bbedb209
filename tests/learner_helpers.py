"""Shared builders for the learner tests: a tiny policy, synthetic groups with ragged prompt and response
lengths, on-policy behaviour log-probs, and gradient comparisons.

Everything is float32 on the CPU and small enough that a `train_step` takes a few milliseconds.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import Tensor, nn

from asyncrl.config import (CISPO, DAPO, GRPO, GSPO, PPO, RLOO, DrGRPO, OffPolicyConfig, OptimConfig, ReinforcePP,
                            TrainerConfig)
from asyncrl.learner import collate, response_logprobs
from asyncrl.policies import ARCH_PRESETS, CausalLM, random_model
from asyncrl.types import Completion, Group

VOCAB = ARCH_PRESETS["tiny-qwen2"]["vocab_size"]  # 256

# every algorithm config, with the trainer fields it needs: (algorithm, trainer overrides)
ALGORITHM_CASES = [
    pytest.param(GRPO(), {}, id="GRPO"),
    pytest.param(DrGRPO(), {"max_response_length": 12}, id="DrGRPO"),
    pytest.param(DAPO(overlong_buffer_len=4), {"max_response_length": 12}, id="DAPO"),
    pytest.param(GSPO(), {}, id="GSPO"),
    pytest.param(CISPO(), {}, id="CISPO"),
    pytest.param(RLOO(), {}, id="RLOO"),
    pytest.param(ReinforcePP(), {}, id="ReinforcePP"),
    pytest.param(ReinforcePP(group_baseline=True), {}, id="ReinforcePP-baseline"),
    pytest.param(PPO(), {}, id="PPO"),
]


def tiny_policy(seed: int = 0, *, initializer_range: float = 0.1) -> CausalLM:
    """`tiny-qwen2` (vocab 256, 2 layers, tied embeddings) with an init large enough that log-probs and
    gradients differ clearly between tokens (the preset's 0.02 gives a near-uniform model)."""
    return random_model(dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=initializer_range), seed=seed)


def frozen_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).eval().requires_grad_(False)


def synthetic_groups(num_groups: int = 4, n: int = 4, *, seed: int = 0, prompt_lens: tuple[int, int] = (2, 7),
                     response_lens: tuple[int, int] = (1, 9), rewards: list[list[float]] | None = None,
                     version: int = 0, first_id: int = 0) -> list[Group]:
    """Random groups: prompt and response token ids in [3, VOCAB), lengths drawn from the inclusive ranges
    (ragged), behaviour log-probs in (−6, −0.1), every token of version `version`. Rewards are random
    {0, 1} values with both present in every group unless given."""
    gen = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    groups = []
    for k in range(num_groups):
        prompt = torch.randint(3, VOCAB, (randint(*prompt_lens),), generator=gen).tolist()
        comps = []
        for _ in range(n):
            r = randint(*response_lens)
            comps.append(Completion(torch.randint(3, VOCAB, (r,), generator=gen).tolist(),
                                    (-0.1 - 5.9 * torch.rand(r, generator=gen)).tolist(), [version] * r, "stop"))
        if rewards is not None:
            rs = list(rewards[k])
        else:
            rs = torch.randint(0, 2, (n,), generator=gen).float().tolist()
            if n > 1 and min(rs) == max(rs):
                rs[0] = 1.0 - rs[0]
        groups.append(Group(first_id + k, prompt, comps, rs))
    return groups


@torch.no_grad()
def completion_logprobs(model: CausalLM, groups: list[Group]) -> list[list[float]]:
    """Per-token log-probs of every completion (row order of `collate`) under `model`."""
    batch = collate(groups)
    was_training = model.training
    model.eval()
    logp, _ = response_logprobs(model, batch, torch.arange(batch.num_rows))
    model.train(was_training)
    return [logp[i, :int(n)].tolist() for i, n in enumerate(batch.response_lens)]


def on_policy(model: CausalLM, groups: list[Group], *, shift: float = 0.0) -> list[Group]:
    """Copies of `groups` whose behaviour log-probs are `model`'s own (minus `shift`): what an engine
    running the same weights would report."""
    lps = iter(completion_logprobs(model, groups))
    out = []
    for g in groups:
        comps = [dataclasses.replace(c, logprobs=[x - shift for x in next(lps)]) for c in g.completions]
        out.append(dataclasses.replace(g, completions=comps))
    return out


def seq_mean_logprobs(model: CausalLM, groups: list[Group]) -> Tensor:
    """Mean log-prob of each completion's tokens under `model`: [N] in `collate` row order."""
    return torch.tensor([sum(lp) / len(lp) for lp in completion_logprobs(model, groups)])


def trainer_config(*, lr: float = 1e-3, off_policy: OffPolicyConfig | None = None, optim: OptimConfig | None = None,
                   **overrides) -> TrainerConfig:
    """One mini-batch per step (every group), fixed micro-batches of 4 rows, no shuffling, no weight decay
    (so a step with zero gradient leaves the weights unchanged)."""
    kw = dict(mini_batch_size=64, use_dynamic_bsz=False, micro_batch_size=4, shuffle=False,
              optim=optim or OptimConfig(lr=lr, weight_decay=0.0),
              off_policy=off_policy or OffPolicyConfig())
    kw.update(overrides)
    return TrainerConfig(**kw)


def weights(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_rel_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """max |a − b| over every tensor, relative to the largest |a| entry (the gradient's scale)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    scale = max(float(v.abs().max()) for v in a.values())
    assert scale > 0, "the reference gradient is zero: the comparison would be vacuous"
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def reward_even_fraction(tokens: list[int]) -> float:
    """A pure reward: the fraction of even token ids in the response."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)
