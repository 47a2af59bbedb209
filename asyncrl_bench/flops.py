"""Useful model FLOPs, the numerator of MFU and of the rooflines: a training step over rows of (prompt_len,
response_len) tokens, and the parameters it counts as the model's body. The learner, LoRA, engine and async
benchmarks count with these.

    train_flops(model.config, body_params(model), row_lengths(groups))
"""

from __future__ import annotations

__all__ = ["body_params", "row_lengths", "train_flops"]


def row_lengths(groups: list) -> list[tuple[int, int]]:
    """(prompt_len, response_len) of every row (completion) of `groups`."""
    return [(len(g.prompt_ids), len(c.token_ids)) for g in groups for c in g.completions]


def body_params(model) -> int:
    """Parameters of the decoder layers and the final norm: no embedding, no LM head."""
    body = (model.model.layers, model.model.norm)
    return sum(p.numel() for module in body for p in module.parameters())


def flops_config(model):
    """The config `train_flops` reads: the model's own, or for an HF-path model of a Llama-family type the
    `TransformerConfig` of its HF config (the same shape)."""
    if getattr(model, "impl", "own") != "hf":
        return model.config
    from asyncrl.policies.model import TransformerConfig
    return TransformerConfig.from_hf(model.config.hf_config)


def train_flops(config, n_body: int, rows: list[tuple[int, int]]) -> float:
    """Useful model FLOPs of one training step (forward + backward, 2 + 4 FLOPs per multiply-add) over `rows`
    = (prompt_len, response_len), for a `TransformerConfig`-like `config`:
      6 · n_body per token (the decoder layers' matmuls),
      6 · vocab · hidden per response token (the LM head: only response log-probs are trained),
      6 · layers · (heads · head_dim) · s² per row of s = prompt + response tokens (causal attention: QKᵀ and
      AV, 2 · 2 · s² · width forward over the half of the s × s scores a causal mask keeps, twice that back).
    Padding and recomputation (gradient checkpointing) are not useful work and are not counted."""
    tokens = sum(p + r for p, r in rows)
    response = sum(r for _, r in rows)
    squares = sum((p + r) ** 2 for p, r in rows)
    attention_width = config.num_heads * config.head_dim
    return float(6 * n_body * tokens + 6 * config.vocab_size * config.hidden_size * response
                 + 6 * config.num_layers * attention_width * squares)
