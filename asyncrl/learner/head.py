"""The log-prob head: log π(target) and the entropy of the LM head's distribution for a set of tokens,
without a `[tokens, vocab]` fp32 tensor in memory beyond one chunk, forward and backward.

    logp, entropy = linear_logprobs(hidden, lm_head.weight, targets, temperature=0.7)   # [n, H] -> [n], [n]

For z = (h · Wᵀ) / τ (fp32, per chunk of tokens):

    log π(y) = z_y − lse(z)          H = lse(z) − Σ_v p_v z_v,   p = softmax(z)

The backward recomputes each chunk's logits from the saved hidden states and uses the saved lse:

    ∂log π(y)/∂z = onehot(y) − p      ∂H/∂z = −p ⊙ (z − Σ_v p_v z_v)

then ∂/∂h = (∂/∂z / τ) · W and ∂/∂W = (∂/∂z / τ)ᵀ · h, so per chunk only the logits (in the matmul's dtype)
and their gradient exist. The entropy's gradient is taken only when the entropy carries one (an entropy
bonus); as a metric it is computed in the same pass over the logits as lse (fused when compiled).

Why not Liger's fused linear cross-entropy: it folds the gradient into the forward pass assuming a scalar
loss, so per-token upstream gradients (our losses weight every token differently) were silently wrong
(linkedin/Liger-Kernel#968, fixed in 2026-07), it has no entropy output and no CPU path. The per-chunk
elementwise work here is plain PyTorch (on CUDA: the forward's statistics one Triton pass over the logits,
`asyncrl.learner.head_triton`; the backward compiled into one kernel).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

__all__ = ["linear_logprobs"]


def _widened(logits: Tensor) -> Tensor:
    """Logits in fp32 (float64 stays float64, for exactness checks)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _chunk_forward(logits: Tensor, targets: Tensor, inv_temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """[c, V] logits, [c] targets -> log π(target), lse, Σ p·z ([c] each, fp32 or wider)."""
    z = _widened(logits) * inv_temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    mean_z = (torch.exp(z - lse[:, None]) * z).sum(-1)
    return logp, lse, mean_z


def _chunk_backward(logits: Tensor, targets: Tensor, lse: Tensor, mean_z: Tensor, grad_logp: Tensor,
                    grad_entropy: Tensor | None, inv_temperature: float) -> Tensor:
    """∂loss/∂logits [c, V] (in the logits' dtype) from the upstream gradients of log π and H ([c] fp32;
    None: the entropy is not differentiated)."""
    z = _widened(logits) * inv_temperature
    p = torch.exp(z - lse[:, None])
    if grad_entropy is None:
        grad_z = p * -grad_logp[:, None]
    else:
        grad_z = p * (-grad_logp[:, None] - grad_entropy[:, None] * (z - mean_z[:, None]))
    grad_z = grad_z.scatter_add(-1, targets[:, None], grad_logp[:, None])  # + onehot(y) · ∂/∂log π
    return (grad_z * inv_temperature).to(logits.dtype)


@functools.cache
def _compiled_kernels():
    """CUDA: the forward statistics in one Triton pass over the logits (`head_triton`), the backward
    compiled into one kernel."""
    from asyncrl.learner.head_triton import chunk_forward  # Triton: only where the head runs on CUDA
    return chunk_forward, torch.compile(_chunk_backward, dynamic=True)


def _kernels(compiled: bool):
    return _compiled_kernels() if compiled else (_chunk_forward, _chunk_backward)


def _matmul_dtype(hidden: Tensor) -> torch.dtype:
    """The matmul's dtype: autocast's on CUDA when it is on (as `nn.Linear` would run), else the input's."""
    if hidden.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return hidden.dtype


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False) if device.type == "cuda" else contextlib.nullcontext()


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk: int,
                compiled: bool) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # an entropy used only as a metric gets None, not zeros
        dtype = _matmul_dtype(hidden)
        forward, _ = _kernels(compiled)
        logp = lse = mean_z = hidden.new_zeros(0, dtype=torch.promote_types(dtype, torch.float32))
        with _no_autocast(hidden.device):
            h, w = hidden.to(dtype), weight.to(dtype)
            stats = [forward(h[i:i + chunk] @ w.T, targets[i:i + chunk], 1.0 / temperature)
                     for i in range(0, h.shape[0], chunk)]
        if stats:
            logp, lse, mean_z = (torch.cat(parts) for parts in zip(*stats))
        ctx.save_for_backward(hidden, weight, targets, lse, mean_z)
        ctx.dtype, ctx.temperature, ctx.chunk, ctx.compiled = dtype, temperature, chunk, compiled
        return logp, (lse - mean_z).clamp(min=0.0)  # rounding can give −1e-6 for a near one-hot row

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(lse.dtype)
        grad_entropy = None if grad_entropy is None else grad_entropy.to(lse.dtype)
        _, backward = _kernels(ctx.compiled)
        chunk, inv_t = ctx.chunk, 1.0 / ctx.temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32))
                       if ctx.needs_input_grad[1] else None)
        with _no_autocast(hidden.device):
            h, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
            for i in range(0, h.shape[0], chunk):
                s = slice(i, i + chunk)
                g_ent = None if grad_entropy is None else grad_entropy[s]
                grad_logits = backward(h[s] @ w.T, targets[s], lse[s], mean_z[s], grad_logp[s], g_ent, inv_t)
                if grad_hidden is not None:
                    grad_hidden[s] = grad_logits @ w
                if grad_weight is not None:
                    grad_weight += grad_logits.T @ h[s]
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None


def linear_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0,
                    chunk_tokens: int = 4096, compiled: bool = False) -> tuple[Tensor, Tensor]:
    """Log-probs of `targets` and entropies under softmax(hidden · weightᵀ / temperature), `chunk_tokens`
    tokens at a time.

    Args:
      hidden: [n, H] final hidden states of the positions that predict `targets`.
      weight: [V, H] the LM head (under CUDA autocast the matmul runs in autocast's dtype, as nn.Linear).
      targets: [n] int64 token ids.
      compiled: the per-chunk elementwise work as one kernel per direction (CUDA: Triton forward, compiled
        backward).

    Returns (logp [n], entropy [n]), fp32 (float64 for a float64 model). Both carry gradients to `hidden` and `weight`; an entropy that
    is only logged costs no backward work (its upstream gradient is None)."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"linear_logprobs: expected hidden [n, H], weight [V, H], targets [n]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    if not temperature > 0 or chunk_tokens < 1:
        raise ValueError(f"linear_logprobs: temperature={temperature} must be > 0 and chunk_tokens={chunk_tokens} >= 1")
    return _LinearLogprobs.apply(hidden, weight, targets, float(temperature), int(chunk_tokens), bool(compiled))
