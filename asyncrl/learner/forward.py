"""Forward passes over the response tokens of a micro-batch: the policy's log-probs and entropies (only
response-predicting positions reach the LM head, through the fused head of `asyncrl.learner.head`) and the
critic's values, in the batch's `[m, T]` response layout."""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from einops import rearrange
from torch import Tensor

from asyncrl.learner.batch import RolloutBatch
from asyncrl.learner.head import linear_logprobs
from asyncrl.learner.layout import MicroBatch, RowLengths, plan_micro_batches
from asyncrl.policies.model import CausalLM, token_entropy, token_logprobs
from asyncrl.policies.value import ValueModel

__all__ = ["fused_head", "plain_head_logprobs", "micro_logprobs", "micro_values", "response_logprobs", "response_values", "row_lengths"]


def _autocast(device: torch.device, enabled: bool):
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _response_hidden(model: CausalLM, micro: MicroBatch) -> Tensor:
    """Final hidden states at the positions that predict the response tokens: [n, H]."""
    hidden = model(micro.tokens, micro.positions, documents=micro.documents)
    return rearrange(hidden, "b t h -> (b t) h").index_select(0, micro.predict_at)  # `predict_at` indexes b·t


def _to_rows(micro: MicroBatch, values: Tensor, width: int) -> Tensor:
    """[n] per-token values -> [m, T] (zero where a row has no response token)."""
    out = values.new_zeros(len(micro.row_list), width)
    return out.index_put((micro.out_rows, micro.out_cols), values)


def micro_logprobs(model: CausalLM, micro: MicroBatch, width: int, *, temperature: float = 1.0,
                   autocast: bool = False, chunk_tokens: int = 4096) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of a micro-batch's response tokens, [m, T] each (T = `width`). Both carry
    gradients; an entropy used only as a metric costs nothing in the backward pass."""
    with _autocast(micro.tokens.device, autocast):
        hidden = _response_hidden(model, micro)
        if fused_head(model):  # logits = logit_scale · h·Wᵀ: the scale folds into the temperature
            logp, entropy = linear_logprobs(hidden, model.lm_head.weight, micro.targets,
                                            temperature=temperature / getattr(model, "logit_scale", 1.0),
                                            chunk_tokens=chunk_tokens, compiled=hidden.is_cuda)
        else:
            logp, entropy = plain_head_logprobs(model, hidden, micro.targets, temperature=temperature,
                                                chunk_tokens=chunk_tokens)
    if micro.num_targets == 0 and hidden.requires_grad:  # keep the graph connected (FSDP2 needs a backward)
        logp = logp + hidden.sum() * 0
    return _to_rows(micro, logp, width), _to_rows(micro, entropy, width)


def fused_head(model) -> bool:
    """Whether `model`'s log-probs come straight from its hidden states and `lm_head.weight` (asyncrl's own models;
    HF-path models whose logits are lm_head(hidden) times a scale), else through its `logits()` (soft-capped
    logits: Gemma 2)."""
    features = getattr(model, "features", None)
    return features is None or features.fused_head


def _plain_chunk(model, hidden: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    logits = model.logits(hidden)
    return token_logprobs(logits, targets, temperature), token_entropy(logits, temperature)


def plain_head_logprobs(model, hidden: Tensor, targets: Tensor, *, temperature: float = 1.0,
                        chunk_tokens: int = 4096) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies [n] through `model.logits(hidden)` [n, V], a chunk of tokens at a time; each chunk's
    logits are recomputed in the backward (checkpointed), so one chunk's fp32 logits exist at a time."""
    parts = [torch.utils.checkpoint.checkpoint(_plain_chunk, model, h, t, temperature, use_reentrant=False)
             if h.requires_grad else _plain_chunk(model, h, t, temperature)
             for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))]
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def micro_values(critic: ValueModel, micro: MicroBatch, width: int, *, autocast: bool = False) -> Tensor:
    """Critic values V_t of a micro-batch's response positions: [m, T]."""
    with _autocast(micro.tokens.device, autocast):
        values = critic.values(_response_hidden(critic, micro))
    return _to_rows(micro, values, width)


def row_lengths(batch: RolloutBatch) -> RowLengths:
    """The batch's row lengths on the host (one read-back)."""
    return RowLengths(batch.prompt_lens.tolist(), batch.response_lens.tolist(), batch.tokens.shape[1])


def response_logprobs(model: CausalLM, batch: RolloutBatch, rows: Tensor | list[int], *, temperature: float = 1.0,
                      entropy: bool = False, autocast: bool = False, chunk_tokens: int = 4096,
                      packed: bool = True) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and entropies) of the response tokens of `rows` as one micro-batch: [m, T] each."""
    rows = rows.tolist() if isinstance(rows, Tensor) else list(rows)
    micro, = plan_micro_batches(batch.tokens, [rows], row_lengths(batch), packed=packed)
    logp, ent = micro_logprobs(model, micro, batch.response_mask.shape[1], temperature=temperature,
                               autocast=autocast, chunk_tokens=chunk_tokens)
    return logp, ent if entropy else None


def response_values(critic: ValueModel, batch: RolloutBatch, rows: Tensor | list[int], *, autocast: bool = False,
                    packed: bool = True) -> Tensor:
    """Critic values of the response positions of `rows` as one micro-batch: [m, T]."""
    rows = rows.tolist() if isinstance(rows, Tensor) else list(rows)
    micro, = plan_micro_batches(batch.tokens, [rows], row_lengths(batch), packed=packed)
    return micro_values(critic, micro, batch.response_mask.shape[1], autocast=autocast)
