"""The LoRA learner (`--lora.rank R`): a frozen base, fp32 adapters trained alone, the base as the KL
reference, a PPO critic sharing the base, and rank 0 exactly today's full fine-tuning.

Every learner here is built as a run builds it (`asyncrl.rpc.assembly.build_learner_state` from a RunSpec),
on the CPU in float32 (bf16 bases: see the bf16 test), with `tiny-qwen2` (2 layers, tied embeddings, q/k/v
biases) and a larger init than the preset's so log-probs and gradients differ between tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.config import GRPO, PPO, AsyncConfig, CriticConfig, LoraConfig, RolloutConfig
from asyncrl.learner import build_learner, collate, policy_gradients, train_step
from asyncrl.learner.prepare import prepare
from asyncrl.policies import ARCH_PRESETS
from asyncrl.policies.lora import LORA_TARGETS, LoRALinear, is_adapter_name, lora_modules
from asyncrl.rpc.assembly import build_learner_state
from asyncrl.rpc.spec import ModelSpec, RunSpec
from tests.learner_helpers import completion_logprobs, max_rel_diff, on_policy, synthetic_groups, trainer_config
from tests.tolerances import forward_tol

MODEL = dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.1)
LORA = LoraConfig(rank=4, alpha=8.0)
REL_TOL = 1e-5  # packed vs padded, as tests/learner/test_packing.py


def spec(lora: LoraConfig = LORA, algorithm=None, **trainer) -> RunSpec:
    """A run's spec for the learner alone (no data, no agents are built from it here)."""
    return RunSpec(model=ModelSpec(config=MODEL, seed=0), algorithm=algorithm or GRPO(),
                   trainer=trainer_config(**trainer), rollout=RolloutConfig(), async_=AsyncConfig(),
                   source_factory=lambda: None, scorer_factory=lambda **_: None, lora=lora)


def learner(lora: LoraConfig = LORA, algorithm=None, *, trained: bool = True, **trainer):
    """A LoRA learner whose adapters look trained (B ≠ 0, so the adapters change the function)."""
    state = build_learner_state(spec(lora, algorithm, **trainer), "cpu")
    if trained and lora.enabled:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, module in lora_modules(state.policy):
                module.lora_B.weight.normal_(0, 0.05, generator=gen)
    return state


def groups_for(state, **kwargs):
    """Ragged groups whose behaviour log-probs are the policy's own (shifted a little)."""
    return on_policy(state.policy, synthetic_groups(4, 4, seed=5, **kwargs), shift=0.05)


def params(model, *, adapters: bool | None = None) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if adapters is None or is_adapter_name(n) == adapters}


def test_rank_0_takes_no_lora_path_and_trains_bit_identically_to_a_plain_learner():
    """--lora.rank 0 (the default) is today's learner: no LoRALinear, no base reference, and two steps give the
    very weights of a learner built from the same model without any LoRA code."""
    state = learner(LoraConfig(), trained=False)
    assert next(lora_modules(state.policy), None) is None and not state.reference_is_base
    plain = build_learner(ModelSpec(config=MODEL, seed=0).build("cpu"), trainer_config(), GRPO())
    groups = groups_for(plain)
    for _ in range(2):
        state, _ = train_step(state, groups)
        plain, _ = train_step(plain, groups)
    ours, theirs = params(state.policy), params(plain.policy)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_only_the_adapters_get_gradients_optimizer_state_and_updates():
    state = learner()
    base_before, adapters_before = params(state.policy, adapters=False), params(state.policy, adapters=True)
    assert len(adapters_before) == 2 * len(LORA_TARGETS) * MODEL["num_hidden_layers"]
    assert all(p.dtype == torch.float32 for p in adapters_before.values())
    groups = groups_for(state)
    grads = policy_gradients(state, groups)
    assert grads.keys() == adapters_before.keys() and max(float(g.abs().max()) for g in grads.values()) > 0
    for _ in range(2):
        state, metrics = train_step(state, groups)
    assert metrics["actor/skipped_updates"] == 0
    optimized = {id(p) for group in state.optimizer.param_groups for p in group["params"]}
    named = dict(state.policy.named_parameters())
    assert optimized == {id(named[n]) for n in adapters_before}
    assert {id(p) for p in state.optimizer.state} <= optimized
    assert all(p.grad is None for n, p in named.items() if not is_adapter_name(n))
    base_after, adapters_after = params(state.policy, adapters=False), params(state.policy, adapters=True)
    assert all(torch.equal(base_before[k], base_after[k]) for k in base_before)  # frozen, bit for bit
    assert all(not torch.equal(adapters_before[k], adapters_after[k]) for k in adapters_before)


def test_a_bf16_base_with_fp32_adapters_trains():
    """The GPU layout (bf16 base, fp32 adapters) on the CPU: the model's dtype is the base's, the adapters stay
    fp32 with fp32 gradients and moments, the fused log-prob head reads the bf16 LM head, the step is finite."""
    policy = ModelSpec(config=MODEL, seed=0).build("cpu", "bfloat16")
    from asyncrl.policies.lora import apply_lora
    apply_lora(policy, rank=4, alpha=8.0)
    state = build_learner(policy, trainer_config(), GRPO())
    assert state.policy.dtype == torch.bfloat16 and state.device.type == "cpu"
    groups = groups_for(learner())
    state, metrics = train_step(state, groups)
    assert metrics["actor/skipped_updates"] == 0 and metrics["actor/grad_norm"] > 0
    moments = [s["exp_avg"] for s in state.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)


@pytest.mark.parametrize("scope", [None, "mlp", "layer"])
def test_packed_and_padded_lora_gradients_agree(scope):
    """Packing (one document-causal sequence per micro-batch) and gradient checkpointing of either scope change
    a LoRA gradient only by round-off, as they do a full one."""
    checkpointing = dict(gradient_checkpointing=scope is not None, checkpoint_scope=scope or "mlp")
    common = dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=40, **checkpointing)
    padded = learner(pack_sequences=False, **common)
    packed = learner(pack_sequences=True, **common)
    groups = groups_for(padded, prompt_lens=(1, 9), response_lens=(1, 12))
    want, got = policy_gradients(padded, groups), policy_gradients(packed, groups)
    assert max(float(g.abs().max()) for g in want.values()) > 1e-4
    assert max_rel_diff(want, got) <= REL_TOL


def test_the_kl_reference_is_the_base_with_the_adapters_off():
    """With a KL loss, π_ref comes from the policy itself with its adapters off: the log-probs of a plain base
    model of the same weights, not the adapted policy's; no reference model is built."""
    state = learner(algorithm=GRPO(kl_loss_coef=0.1))
    assert state.reference is None and state.reference_is_base
    groups = groups_for(state)
    prep = prepare(state, collate(groups))
    base = ModelSpec(config=MODEL, seed=0).build("cpu")
    want = torch.zeros_like(prep.logp_ref)
    for row, logps in enumerate(completion_logprobs(base, groups)):
        want[row, :len(logps)] = torch.tensor(logps)
    mask = prep.batch.response_mask
    atol = forward_tol(want[mask], base.config, dtype=torch.float32)
    assert float((prep.logp_ref - want)[mask].abs().max()) < atol
    adapted = torch.tensor([x for row in completion_logprobs(state.policy, groups) for x in row])
    assert float((adapted - want[mask]).abs().max()) > 100 * atol  # the adapters do change the policy
    assert all(m.enabled for _, m in lora_modules(state.policy))  # switched back on
    state, metrics = train_step(state, groups)
    assert metrics["actor/kl_loss"] > 0


def test_the_critic_shares_the_frozen_base_and_trains_its_own_adapters_and_head():
    state = learner(algorithm=PPO(critic=CriticConfig(lr=1e-3)))
    policy, critic = dict(state.policy.named_parameters()), dict(state.critic.named_parameters())
    frozen = [n for n, p in critic.items() if not p.requires_grad]
    assert frozen and all(critic[n].data_ptr() == policy[n].data_ptr() for n in frozen)  # one base in memory
    trainable = sorted(n for n, p in critic.items() if p.requires_grad)
    assert trainable == sorted([n for n in policy if is_adapter_name(n)] + ["value_head.bias", "value_head.weight"])
    assert all(critic[n].data_ptr() != policy[n].data_ptr() for n in trainable if n in policy)
    assert isinstance(state.critic.model.layers[0].mlp.up_proj, LoRALinear)
    optimized = {id(p) for group in state.critic_optimizer.param_groups for p in group["params"]}
    assert optimized == {id(critic[n]) for n in trainable}
    before = params(state.critic)
    base_before = params(state.policy, adapters=False)
    groups = groups_for(state)
    for _ in range(2):  # the zero value head passes no gradient back in the first step
        state, metrics = train_step(state, groups)
    after = params(state.critic)
    assert metrics["critic/grad_norm"] > 0
    assert not torch.equal(before["value_head.weight"], after["value_head.weight"])
    assert any(not torch.equal(before[n], after[n]) for n in trainable if is_adapter_name(n))
    assert all(torch.equal(base_before[n], p) for n, p in params(state.policy, adapters=False).items())


def test_lora_adapters_start_the_same_in_every_process():
    """The adapters' initial A is drawn from the run's seed (every trainer rank builds the same), whatever the
    process's random state; B starts at zero, so the initial policy is the base."""
    torch.manual_seed(123)
    a = learner(trained=False)
    torch.rand(5)
    b = learner(trained=False)
    assert all(torch.equal(x, y) for x, y in zip(params(a.policy).values(), params(b.policy).values()))
    assert all(not m.lora_B.weight.detach().any() for _, m in lora_modules(a.policy))


def test_the_reference_path_needs_a_reference_model_without_lora():
    with pytest.raises(ValueError, match="reference"):
        build_learner(copy.deepcopy(ModelSpec(config=MODEL).build("cpu")), trainer_config(), GRPO(kl_loss_coef=0.1))
