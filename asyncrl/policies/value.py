"""The critic of PPO: the policy's architecture with a scalar value head instead of the LM head.

V_t, the value of the state before response token t, is read at the same position as the logits that
predict token t (the last prompt token for t = 0), so values, log-probs and masks share one `[B, T]` layout.

The critic of a LoRA policy trains adapters of its own (copied from the policy's) and a full value head in
float32, over the policy's frozen base: on the policy's device, unsharded, the critic's base *is* the
policy's (the same Parameter objects: no second copy in memory); a critic on another device, or of an
FSDP2-sharded policy (whose parameters each belong to one sharded module), gets its own copy of the base.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from asyncrl.policies.lora import apply_lora, lora_modules
from asyncrl.policies.model import CausalLM, TransformerConfig

__all__ = ["ValueModel"]


class ValueModel(CausalLM):
    """A `CausalLM` backbone with `value_head: Linear(hidden, 1)`; `forward` returns hidden states as the
    policy does, `values(hidden)` maps them to fp32 values."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__(cfg)
        del self.lm_head
        self.value_head = nn.Linear(cfg.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def values(self, hidden: Tensor) -> Tensor:
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def logits(self, hidden: Tensor) -> Tensor:
        raise TypeError("ValueModel has no LM head; use values(hidden)")

    @classmethod
    def from_policy(cls, policy: CausalLM, *, device: str | torch.device | None = None) -> "ValueModel":
        """A critic initialised with the policy's backbone weights and a zero value head (V ≡ 0 at start), on
        `device` (default: the policy's). A LoRA policy's critic shares its frozen base where it can (see the
        module docstring)."""
        if getattr(policy, "impl", "own") == "hf":
            raise ValueError(f"the PPO critic runs on asyncrl's own models only ({policy.config.model_type} trains "
                             "through transformers, --model.impl hf); use a critic-free algorithm (GRPO, DAPO, "
                             "GSPO, RLOO) or a llama/qwen2/qwen3/mistral model")
        device = torch.device(device) if device is not None else policy.device
        sharded = any(hasattr(p, "device_mesh") for p in policy.parameters())
        _, lora = next(lora_modules(policy), (None, None))  # one adapted layer: the adapters' settings
        if lora is not None and not sharded and device == policy.device:
            return cls._sharing_base(policy)
        with torch.device("meta"):
            critic = cls(policy.config)
        critic.to_empty(device=device).to(dtype=policy.dtype)
        if lora is not None:
            apply_lora(critic, rank=lora.rank, alpha=lora.alpha, dropout=_dropout(lora),
                       targets={name.rpartition(".")[2] for name, _ in lora_modules(policy)})
        # an FSDP2-sharded policy holds DTensor shards: gather the full weights (a collective: every rank
        # of the trainer group calls this, as build_learner does)
        weights = {name: t.full_tensor() if hasattr(t, "full_tensor") else t
                   for name, t in policy.model.state_dict().items()}
        critic.model.load_state_dict(weights)
        critic.model.rope_inv_freq = policy.model.rope_inv_freq.to(device)
        critic.value_head = _value_head(policy.config.hidden_size, device,
                                        torch.float32 if lora is not None else policy.dtype)
        return critic

    @classmethod
    def _sharing_base(cls, policy: CausalLM) -> "ValueModel":
        """The critic of an unsharded LoRA policy: a deep copy of its backbone in which every frozen tensor
        maps to the policy's own (the memo of `copy.deepcopy`), so only the adapters are new tensors."""
        shared = {id(p): p for p in policy.model.parameters() if not p.requires_grad}
        with torch.device("meta"):
            critic = cls(policy.config)  # a skeleton: meta tensors allocate nothing
        critic.model = copy.deepcopy(policy.model, memo=shared)
        critic.value_head = _value_head(policy.config.hidden_size, policy.device, torch.float32)
        return critic


def _dropout(module) -> float:
    return module.dropout.p if isinstance(module.dropout, nn.Dropout) else 0.0


def _value_head(hidden: int, device: torch.device, dtype: torch.dtype) -> nn.Linear:
    head = nn.Linear(hidden, 1, device=device, dtype=dtype)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head
