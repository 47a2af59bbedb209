"""Forward passes over the response tokens of a `RolloutBatch`: the policy's log-probs and entropies (only
response positions go through the LM head, in checkpointed chunks) and the critic's values."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from asyncrl.policies.model import CausalLM, token_entropy, token_logprobs
from asyncrl.policies.value import ValueModel
from asyncrl.rollout_batch import RolloutBatch

__all__ = ["chunked_logprobs", "response_logprobs", "response_values"]


def _autocast(device: torch.device, enabled: bool):
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _gather_response(hidden: Tensor, prompt_lens: Tensor, t: int) -> Tensor:
    """Hidden states at the positions that predict the response tokens: [m, S, H] -> [m, T, H]."""
    idx = (prompt_lens[:, None] - 1 + torch.arange(t, device=hidden.device)[None, :]).clamp(max=hidden.shape[1] - 1)
    return hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))


def _head_logprobs(model: CausalLM, hidden: Tensor, targets: Tensor, temperature: float, entropy_grad: bool,
                   calls: list | None = None) -> tuple[Tensor, Tensor]:
    """LM head, log-prob of the targets and entropy for a chunk of tokens: [n, H], [n] -> [n], [n].

    `calls` counts invocations under activation checkpointing: a metric-only entropy is computed on the
    first (forward) call and skipped when the backward pass re-runs the function for its gradients."""
    logits = model.logits(hidden)
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits, targets)
    if entropy_grad:
        return logp, token_entropy(logits)
    recompute = calls is not None and len(calls) > 0
    if calls is not None:
        calls.append(1)
    with torch.no_grad():
        return logp, torch.zeros_like(logp) if recompute else token_entropy(logits)


def chunked_logprobs(model: CausalLM, hidden: Tensor, targets: Tensor, *, temperature: float = 1.0,
                     chunk_tokens: int = 4096, entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of `targets` [m, T] from `hidden` [m, T, H], `chunk_tokens` tokens at a time.

    With gradients on, each chunk's LM head runs under activation checkpointing, so only one
    [chunk, V] logits tensor exists at a time (a 152k vocabulary over 8k tokens would otherwise hold
    several 5 GB fp32 tensors); the head is recomputed in the backward pass.
    """
    m, t, h = hidden.shape
    flat_h, flat_t = hidden.reshape(m * t, h), targets.reshape(m * t)
    outs_logp, outs_ent = [], []
    for start in range(0, m * t, chunk_tokens):
        hc, tc = flat_h[start:start + chunk_tokens], flat_t[start:start + chunk_tokens]
        if torch.is_grad_enabled() and hc.requires_grad:
            logp, ent = torch.utils.checkpoint.checkpoint(_head_logprobs, model, hc, tc, temperature, entropy_grad,
                                                          [], use_reentrant=False)
        else:
            logp, ent = _head_logprobs(model, hc, tc, temperature, entropy_grad)
        outs_logp.append(logp)
        outs_ent.append(ent)
    return torch.cat(outs_logp).view(m, t), torch.cat(outs_ent).view(m, t)


def response_logprobs(model: CausalLM, batch: RolloutBatch, rows: Tensor, *, temperature: float = 1.0,
                      entropy: bool = False, autocast: bool = False, entropy_grad: bool = False,
                      width: int | None = None, chunk_tokens: int = 4096) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens of `rows`: [m, T] each. Only response positions go
    through the LM head, in checkpointed chunks of `chunk_tokens`, and each micro-batch is cut to its own
    longest row.
    The entropy carries a gradient only with `entropy_grad` (an entropy bonus); otherwise it is a metric."""
    prompt_lens, mask = batch.prompt_lens[rows], batch.response_mask[rows]
    t = batch.response_mask.shape[1]
    if width is None:  # the longest row (pass it in from host-side lengths to avoid a device sync)
        width = int((prompt_lens + mask.sum(-1)).max())
    tokens = batch.tokens[rows, :width]
    targets_idx = (prompt_lens[:, None] + torch.arange(t, device=tokens.device)[None, :]).clamp(max=width - 1)
    targets = tokens.gather(1, targets_idx)
    with _autocast(tokens.device, autocast):
        hidden = _gather_response(model(tokens), prompt_lens, t)
        logp, ent = chunked_logprobs(model, hidden, targets, temperature=temperature, entropy_grad=entropy_grad,
                                     chunk_tokens=chunk_tokens)
    return logp, ent if entropy else None


def response_values(critic: ValueModel, batch: RolloutBatch, rows: Tensor, *, autocast: bool = False) -> Tensor:
    """Critic values V_t of the response positions of `rows`: [m, T]."""
    prompt_lens, mask = batch.prompt_lens[rows], batch.response_mask[rows]
    width = int((prompt_lens + mask.sum(-1)).max())
    with _autocast(batch.tokens.device, autocast):
        hidden = _gather_response(critic(batch.tokens[rows, :width]), prompt_lens, batch.response_mask.shape[1])
        return critic.values(hidden)
