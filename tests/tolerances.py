"""Absolute tolerances for comparing two computations of the same float values that differ only in rounding
(another reduction order, another kernel, a batch of another shape), derived from the dtype and the size of
the values instead of hard-coded.

    atol = close_tol(torch.float32, logits.abs().max(), terms=64, depth=2)
    atol = forward_tol(logits, model.config)              # logits / log-probs of a transformer forward

The model (a typical-case estimate, not a worst-case bound):

- `eps = torch.finfo(dtype).eps` is the spacing of floats at 1 (float32 1.19e-7, bfloat16 7.8e-3); one
  rounding is off by at most u = eps / 2 relative.
- A sum of k terms rounds k times. The errors are of either sign and largely independent, so they add like
  a random walk: about sqrt(k)·u relative to the size of the terms (the worst case k·u is never approached).
- A chain of `depth` such reductions, each fed by the previous one, adds their errors: depth·sqrt(k)·u.
- Two computations are compared, each with its own error: twice that, depth·sqrt(k)·eps.
- Scaled by `magnitude`, the size of the compared values (max |x|), it is an absolute tolerance; SAFETY = 4
  covers the tail, since a test takes the maximum over thousands of compared values.

So atol = SAFETY · depth · sqrt(k) · eps · magnitude. The result must stay below `ceiling` (default 1e-2):
the bugs these comparisons exist for (a dropped bias, a wrong RoPE position, a stale K/V, a misplaced
mask) move logits and log-probs by O(0.01..1); a tolerance that large would let them pass, so the helper
raises instead.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SAFETY", "FORWARD_DEPTH", "ADAM_SHARE", "close_tol", "forward_tol", "adam_weights_tol"]

SAFETY = 4.0
# A transformer forward counted stage by stage would be ~9 reductions per layer, but RMSNorm re-normalises
# the residual stream before every block, so relative errors do not compound from layer to layer. Measured
# |difference| / (eps · max|logits|): 5-8 for a 2-layer model against transformers, 6 for right padding,
# 16-32 for engine (KV cache, decode) vs training log-probs; 10 for SmolLM2 (30 layers) against
# transformers. depth 4 over hidden_size terms gives 4·4·sqrt(64) = 128 (2-layer, hidden 64) and
# 4·4·sqrt(576) = 384 (SmolLM2): 4-20x above what was measured, far below the O(0.01) of a real bug.
FORWARD_DEPTH = 4


def close_tol(dtype: torch.dtype, magnitude: float | torch.Tensor = 1.0, *, terms: int = 1, depth: int = 1,
              ceiling: float = 1e-2) -> float:
    """SAFETY · depth · sqrt(terms) · eps(dtype) · magnitude (see the module docstring for the derivation).

    dtype: the dtype the compared values were computed in. magnitude: the size of the values, or of the
    terms they were computed from when those are larger (max |x|; a tensor is reduced with .abs().max()).
    terms: the length of the longest reduction. depth: reductions chained. Raises ValueError when the
    tolerance reaches `ceiling`, where the comparison would prove nothing."""
    if isinstance(magnitude, torch.Tensor):
        magnitude = magnitude.detach().abs().max().item()
    magnitude = float(magnitude)
    tol = SAFETY * depth * math.sqrt(terms) * torch.finfo(dtype).eps * magnitude
    if not tol < ceiling:
        raise ValueError(f"close_tol: {dtype} values of magnitude {magnitude:.3g} over {terms} terms × depth "
                         f"{depth} give atol {tol:.3g} >= {ceiling:g}, too loose to catch a real bug; compare "
                         "in a wider dtype or at a smaller scale")
    return tol


def forward_tol(values: torch.Tensor, config, *, temperature: float = 1.0, dtype: torch.dtype | None = None) -> float:
    """Tolerance for logits (or log-probs, entropies) of a transformer forward with `config` (a
    `TransformerConfig`): FORWARD_DEPTH reductions of hidden_size terms, at the scale max|values| /
    temperature. `values` are the logits the compared numbers come from (log-probs are shifted logits: their
    rounding follows the logits' scale, not their own). dtype: that of the forward (default values.dtype)."""
    scale = values.detach().abs().max().item() / (temperature or 1.0)
    return close_tol(dtype or values.dtype, scale, terms=config.hidden_size, depth=FORWARD_DEPTH)


ADAM_SHARE = 0.05
"""Weights after Adam updates computed two ways (another reduction order, packed against padded, 4 ranks against
one process) differ by a share of the learning rate, not by rounding: an update is lr · m̂ / (√v̂ + ε), and at a
weight whose gradients so far nearly cancel (m̂ ≈ 0 while v̂ is not) a rounding difference in them moves the update
by a visible share of lr. Measured: 0.4 % of lr (packing, GSPO) and 1.3 % (a PPO critic over 4 ranks, step 3) on the
weights that moved most, with gradients equal to 1e-9 relative. 5 % of lr still catches what these tests exist for
(a lost or doubled micro-batch, a wrong normaliser, a missed all-reduce), which moves weights by O(lr) or more."""


def adam_weights_tol(lr: float) -> float:
    """How far weights after Adam updates at learning rate `lr` may differ between two computations of the same
    steps (ADAM_SHARE · lr; see ADAM_SHARE)."""
    if not lr > 0:
        raise ValueError(f"adam_weights_tol: lr must be > 0, got {lr}")
    return ADAM_SHARE * lr
