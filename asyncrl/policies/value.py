"""The critic of PPO: the policy's architecture with a scalar value head instead of the LM head.

V_t, the value of the state before response token t, is read at the same position as the logits that
predict token t (the last prompt token for t = 0), so values, log-probs and masks share one `[B, T]` layout.
"""

from __future__ import annotations

import copy

from torch import Tensor, nn

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
        return self.value_head(hidden).squeeze(-1).float()

    def logits(self, hidden: Tensor) -> Tensor:
        raise TypeError("ValueModel has no LM head; use values(hidden)")

    @classmethod
    def from_policy(cls, policy: CausalLM) -> "ValueModel":
        """A critic initialised with the policy's backbone weights and a zero value head (V ≡ 0 at start)."""
        critic = cls(policy.config)
        # an FSDP2-sharded policy holds DTensor shards: gather the full weights (a collective: every rank
        # of the trainer group calls this, as build_learner does)
        weights = {name: t.full_tensor() if hasattr(t, "full_tensor") else t
                   for name, t in policy.model.state_dict().items()}
        critic.model.load_state_dict(copy.deepcopy(weights))
        return critic.to(device=policy.device, dtype=policy.dtype)
