"""Mixture-of-experts router terms: the load-balancing auxiliary loss and the expert load it measures.

For one router over N tokens (those in `counted`), E experts, each token sending to k experts:

    f_e = (1 / (N·k)) Σ_t Σ_j 1[indices[t, j] = e]     the share of routed slots expert e received
    P_e = (1 / N) Σ_t softmax(logits[t])_e              the router's mean probability of expert e
    loss = E · Σ_e f_e · P_e                             Switch Transformer's auxiliary loss (Fedus et al., 2021;
                                                         transformers' load_balancing_loss_func per layer): 1 when
                                                         routing is uniform, up to E when one expert takes all
    load = E · max_e f_e                                 1 when balanced, E when one expert takes every slot

f is a count (no gradient); the gradient reaches the router through P. Shapes: logits [N, E] float, indices
[N, k] int64, counted bool [N].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["LoadBalance", "load_balancing"]


class LoadBalance(NamedTuple):
    loss: Tensor  # 0-d, differentiable through the logits
    load: Tensor  # 0-d: E · the busiest expert's share of the routed slots (no gradient)
    shares: Tensor  # [E]: f, each expert's share of the routed slots


def load_balancing(logits: Tensor, indices: Tensor, counted: Tensor | None = None) -> LoadBalance:
    """The auxiliary loss and the expert load of one router's choices (see the module docstring); tokens outside
    `counted` (None: all) do not count. With no counted token: loss 0 (still connected to the logits), load 0."""
    if logits.dim() != 2 or indices.dim() != 2 or indices.shape[0] != logits.shape[0]:
        raise ValueError(f"load_balancing: logits {tuple(logits.shape)} and indices {tuple(indices.shape)}; expected "
                         "[N, E] and [N, k] over the same N tokens")
    num_experts = logits.shape[1]
    if counted is None:
        counted = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    weight = counted.to(logits.device, torch.float32)
    tokens = weight.sum()
    slots = torch.zeros(num_experts, device=logits.device, dtype=torch.float32)
    slots.index_add_(0, indices.reshape(-1), weight.repeat_interleave(indices.shape[1]))
    shares = slots / (tokens * indices.shape[1]).clamp(min=1)
    probs = torch.softmax(logits.float(), dim=-1)
    mean_probs = (probs * weight[:, None]).sum(0) / tokens.clamp(min=1)
    return LoadBalance(num_experts * (shares * mean_probs).sum(), num_experts * shares.max(), shares)
