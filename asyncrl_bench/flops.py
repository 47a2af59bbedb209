"""Useful model FLOPs, the numerator of MFU and of the rooflines: a training step over rows of (prompt_len,
response_len) tokens, and the parameters it counts as the model's body. The learner, LoRA, engine and async
benchmarks count with these.

    train_flops(model.config, body_params(model), row_lengths(groups))
"""

from __future__ import annotations

import dataclasses

from asyncrl.launch.model_checks import MOE_EXPERT_KEYS

__all__ = ["body_params", "expert_share", "row_lengths", "train_flops"]


def row_lengths(groups: list) -> list[tuple[int, int]]:
    """(prompt_len, response_len) of every row (completion) of `groups`."""
    return [(len(g.prompt_ids), len(c.token_ids)) for g in groups for c in g.completions]


def body_params(model) -> int:
    """Parameters of the decoder layers and the final norm: no embedding, no LM head. A mixture-of-experts
    model's routed experts count by the share of them a token runs (top_k / experts): its active parameters."""
    share = expert_share(getattr(model.config, "hf_config", None) or model.config)
    body = (model.model.layers, model.model.norm)
    return int(sum(p.numel() * (share if ".experts." in f".{name}." else 1.0)
                   for module in body for name, p in module.named_parameters()))


def expert_share(config) -> float:
    """top_k / routed experts of a mixture-of-experts config (1.0 for a dense one); `config` an HF config or a dict."""
    text = _field(config, "text_config") or config
    experts = next((_field(text, k) for k in MOE_EXPERT_KEYS if _field(text, k)), None)
    top_k = _field(text, "num_experts_per_tok") or _field(text, "top_k_experts")
    return top_k / experts if isinstance(experts, int) and isinstance(top_k, int) and experts > 1 else 1.0


@dataclasses.dataclass(frozen=True)
class FlopsShape:
    """What `train_flops` reads of a model's config."""

    num_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int
    num_layers: int


def flops_config(model):
    """The config `train_flops` reads: the model's own, or for an HF-path model (any type) the shape its HF
    config gives (its text config for a multimodal one)."""
    if hasattr(model.config, "num_heads"):  # asyncrl's own model's TransformerConfig
        return model.config
    text = _field(model.config.hf_config, "text_config") or model.config.hf_config
    heads, hidden = _field(text, "num_attention_heads"), _field(text, "hidden_size")
    return FlopsShape(num_heads=heads, head_dim=_field(text, "head_dim") or hidden // heads,
                      vocab_size=_field(text, "vocab_size"), hidden_size=hidden,
                      num_layers=_field(text, "num_hidden_layers"))


def _field(config, key: str):
    """A key of an HF config, as an object or a dict (None when absent)."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


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
