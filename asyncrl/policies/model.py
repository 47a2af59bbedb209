"""A compact causal LM for the Llama family: Llama, Qwen2/Qwen2.5, Qwen3 (q/k norm), Mistral, SmolLM2.

One implementation serves both sides of RL, so the engine's behaviour log-probs and the learner's
log-probs come from the same arithmetic:
* training: `forward(input_ids, positions)` over right-padded rows (causal SDPA) or over rows packed
  into one sequence (`documents=DocumentLayout(...)`: document-causal attention, no padding compute),
  then `token_logprobs` / `token_entropy` (the learner's fused head: `asyncrl.learner.head`);
* generation: the same `forward` with a `KVCache` — prefill writes K/V of whole prompts into cache slots,
  decode (one token per row, row i in slot i) appends one K/V and attends over the slot.

Module and parameter names mirror Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), so an HF
state dict loads as is, `update_weights` copies tensors by HF name, and a saved directory opens with
`transformers.AutoModelForCausalLM`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from asyncrl.policies.attention_layouts import CacheExtension, DocumentLayout
from asyncrl.policies.kv_cache import KVCache

__all__ = [
    "TransformerConfig", "CausalLM", "RMSNorm", "use_fused_kernels", "token_logprobs", "token_entropy",
    "SUPPORTED_MODEL_TYPES", "rope_inv_freq",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Architecture of a Llama-family model, read from a Hugging Face `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2: always)
    qk_norm: bool  # RMSNorm on each head of q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    initializer_range: float
    sliding_window: int | None  # attention window (Mistral); not implemented: sequences must fit inside it
    hf_config: dict  # the original config.json, written back on save

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "TransformerConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type={model_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={cfg['hidden_act']!r} is not supported; only 'silu'")
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = rope or cfg.get("rope_scaling") or None
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise ValueError(f"config.json: rope type {kind!r} is not supported; supported: default, linear, llama3")
            scaling = None if kind == "default" else dict(scaling, rope_type=kind)
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            sliding_window=_sliding_window(cfg),
            hf_config=dict(cfg),
        )

    @property
    def num_params_estimate(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x²) + eps) · w, computed in fp32 and cast back before the weight (as HF's Llama)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + residual, rms_norm(x + residual)): the residual stream and the next sub-layer's input."""
    total = x + residual
    return total, _rms_norm(total, weight, eps)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary embedding (half-split convention, as HF): x·cos + rotate_half(x)·sin."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor,
               sin: Tensor) -> tuple[Tensor, Tensor]:
    """Qwen3's per-head RMS norms of q [B, S, H, D] and k [B, S, Hkv, D], then RoPE (cos, sin [B, S, D]):
    q and k as [B, H, S, D], read and written once each when compiled."""
    q = rearrange(_rms_norm(q, q_weight, eps), "b s h d -> b h s d")
    k = rearrange(_rms_norm(k, k_weight, eps), "b s h d -> b h s d")
    return _apply_rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


class _Kernels:
    """The elementwise pieces of a layer (eager). `use_fused_kernels(True, model=m)` gives the layers of one
    model torch.compile'd versions instead (one fused kernel each, as nano-vllm does) — worth it on GPU, where
    a decode step is launch-bound. Layers read their pieces from `self.kernels` (this class unless set)."""

    rms_norm = staticmethod(_rms_norm)
    add_rms_norm = staticmethod(_add_rms_norm)
    apply_rope = staticmethod(_apply_rope)
    norm_rope = staticmethod(_norm_rope)
    silu_mul = staticmethod(_silu_mul)


class _UsesKernels:
    kernels = _Kernels  # per instance after use_fused_kernels(..., model=...)


_ROUNDS_BETWEEN = frozenset({"norm_rope"})
"""Pieces that fuse what eager rounds in between (the norms' bf16 output, then RoPE): compiled, they keep that
rounding (Inductor would skip it, and RoPE's differences can then cancel into errors the probe refuses)."""


def _probe_inputs(name: str, device: torch.device, dtype: torch.dtype) -> list[tuple]:
    """Decode- and prefill-shaped arguments for each piece, to compile and check it before use."""
    out = []
    for b, s in ((3, 1), (5, 7)):
        x = torch.randn(b, s, 64, device=device, dtype=dtype)
        w = torch.randn(64, device=device, dtype=dtype)
        q, k = torch.randn(b, 4, s, 16, device=device, dtype=dtype), torch.randn(b, 2, s, 16, device=device, dtype=dtype)
        cs = torch.randn(b, 1, s, 16, device=device, dtype=dtype)
        w16 = torch.randn(16, device=device, dtype=dtype)
        heads = (q.transpose(1, 2), k.transpose(1, 2), w16, w16, 1e-6, cs[:, 0], cs[:, 0])  # [B, S, H, D] in
        out.append({"rms_norm": (x, w, 1e-6), "add_rms_norm": (x, x, w, 1e-6), "apply_rope": (q, k, cs, cs),
                    "norm_rope": heads, "silu_mul": (x, x)}[name])
    return out


def _own_code(fn: types.FunctionType) -> types.FunctionType:
    """A copy of fn with a new code object (same body, globals and defaults)."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
    return copy


def use_fused_kernels(enabled: bool = True, device: torch.device | str | None = None,
                      dtype: torch.dtype = torch.bfloat16, *, model: nn.Module | None = None) -> dict[str, bool]:
    """Compile (True) or restore (False) the elementwise pieces of `model`'s layers (None: every model in
    this process without pieces of its own).

    Each compiled piece is first run on `device` with decode- and prefill-shaped inputs and compared with
    the eager version; a piece that fails to compile or disagrees stays eager. Returns {piece: compiled}.
    Per model, because a process may hold two: a colocated trainer's forward/backward (other shapes, dtypes
    and grad modes) must not spend the engine's recompile budget — past it, a fullgraph compile fails. So
    each model compiles copies of the pieces with code objects of their own: torch.compile keeps guards and
    that budget per code object, and engines of several dtypes in one process would otherwise share it.
    """
    pieces = {"rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm, "apply_rope": _apply_rope,
              "norm_rope": _norm_rope, "silu_mul": _silu_mul}
    own = None if model is None else next((m.kernels for m in model.modules() if isinstance(m, _UsesKernels)), None)
    if enabled and isinstance(own, types.SimpleNamespace) and any(getattr(own, n) is not f for n, f in pieces.items()):
        return {n: getattr(own, n) is not f for n, f in pieces.items()}  # compiled for this model before: reuse
    status, table = {}, {}
    for name, fn in pieces.items():
        chosen = fn
        if enabled:
            compiled = torch.compile(fn if model is None else _own_code(fn), dynamic=True, fullgraph=True,
                                     options={"emulate_precision_casts": name in _ROUNDS_BETWEEN})
            try:
                for args in _probe_inputs(name, torch.device(device or "cpu"), dtype):
                    want, got = fn(*args), compiled(*args)
                    for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
                        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
                chosen = compiled
            except Exception as err:  # an Inductor bug must not take the model down: stay eager
                warnings.warn(f"use_fused_kernels: {name} stays eager ({type(err).__name__}: {str(err)[:200]})")
        status[name] = chosen is not fn
        table[name] = chosen
    if model is None:
        for name, fn in table.items():
            setattr(_Kernels, name, staticmethod(fn))
    else:
        kernels = types.SimpleNamespace(**table)
        for module in model.modules():
            if isinstance(module, _UsesKernels):
                module.kernels = kernels
    return status


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or (cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window")):
        return None
    return int(window)


class RMSNorm(_UsesKernels, nn.Module):
    """x / sqrt(mean(x²) + eps) · w, computed in fp32 and cast back (as Hugging Face's Llama)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: TransformerConfig) -> Tensor:
    """Inverse frequencies of the rotary embedding, with linear or llama3 scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq.float()
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).float()
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_mid, mid, scaled).float()


class Attention(_UsesKernels, nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.qkv = None  # one product for q/k/v in forwards with a cache (`asyncrl.policies.fused_projections`)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | None, cache: KVCache | None,
                cache_slots: Tensor | None, positions: Tensor, decode: bool,
                documents: DocumentLayout | None = None, extension: CacheExtension | None = None) -> Tensor:
        s = x.shape[1]
        if cache is not None and self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        d = self.head_dim
        if self.qk_norm:  # the norms per head, [B, S, H, D] in; [B, H, S, D] out
            q, k = self.kernels.norm_rope(rearrange(q, "b s (h d) -> b s h d", d=d),
                                          rearrange(k, "b s (h d) -> b s h d", d=d),
                                          self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
        else:
            q, k = self.kernels.apply_rope(rearrange(q, "b s (h d) -> b h s d", d=d),
                                           rearrange(k, "b s (h d) -> b h s d", d=d), cos.unsqueeze(1),
                                           sin.unsqueeze(1))
        v = rearrange(v, "b s (h d) -> b h s d", d=d)
        if decode:
            out = cache.attend_decode(self.layer_idx, q, k, v, positions[:, 0])  # one query per row
        elif documents is not None:
            out = documents.attend(q, k, v)
        elif extension is not None and extension.in_order and cache.verify is not None:  # a speculative step
            out = cache.attend_in_order(self.layer_idx, q, k, v, positions, extension.span)
        elif extension is not None:  # rows continue their slots: attend over the cached positions and their own
            keys, values = cache.write_extend(self.layer_idx, cache_slots, positions, k, v, extension.span,
                                              in_order=extension.in_order)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            if cache is not None:
                cache.write_prefill(self.layer_idx, cache_slots, k, v)
            gqa = self.num_heads != self.num_kv_heads
            if attn_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))


class MLP(_UsesKernels, nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = None  # one product for gate/up when `fused` (`asyncrl.policies.fused_projections`)

    def forward(self, x: Tensor, fused: bool = False) -> Tensor:
        if fused and self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.kernels.silu_mul(gate, up))


class DecoderLayer(_UsesKernels, nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_mask: Tensor | None, cache: KVCache | None,
                cache_slots: Tensor | None, positions: Tensor, decode: bool,
                documents: DocumentLayout | None = None, recompute_mlp: bool = False,
                extension: CacheExtension | None = None) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, cache, cache_slots, positions, decode,
                              documents, extension)
        norm = self.post_attention_layernorm
        x, h = self.kernels.add_rms_norm(x, attn, norm.weight, norm.eps)
        if recompute_mlp:  # selective checkpointing: keep the attention block's activations, recompute the MLP
            return x + torch.utils.checkpoint.checkpoint(self.mlp, h, use_reentrant=False)
        return x + self.mlp(h, fused=cache is not None)


class Backbone(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("rope_inv_freq", rope_inv_freq(cfg), persistent=False)


class CausalLM(nn.Module):
    """Llama-family decoder. `forward` returns final hidden states; `logits` maps them to fp32 logits."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        self.checkpoint_scope = "layer"  # with gradient_checkpointing: recompute each "layer", or only its "mlp"

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.model.rope_inv_freq  # [B, S, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: Tensor, positions: Tensor | None = None, *, attn_mask: Tensor | None = None,
                cache: KVCache | None = None, cache_slots: Tensor | None = None, decode: bool = False,
                documents: DocumentLayout | None = None, extension: CacheExtension | None = None) -> Tensor:
        """Final hidden states [B, S, H].

        Args:
          input_ids: [B, S] token ids (right-padded rows, or one packed row with `documents` or `attn_mask`).
          positions: [B, S] RoPE positions (default 0..S-1 per row; restarting at 0 per packed document).
          attn_mask: optional bool [B or 1, 1, S, S] (True = attend), e.g. `packed_attention_mask`.
          documents: B == 1 holding sequences end to end: document-causal attention without a mask.
          cache, cache_slots: prefill — write each row's K/V into `cache_slots[b]` from position 0.
          extension: extend — row b continues the sequence cached in slot `cache_slots[b]` (`CacheExtension`:
            new turns of conversations whose earlier turns are cached), one forward for all rows.
          decode: S == 1; row b appends to cache slot b at `positions[b, 0]` and attends over the slot.
        """
        b, s = input_ids.shape
        if extension is not None:
            if cache is None or cache_slots is None or decode:
                raise ValueError("forward: an extension continues cached slots: it needs cache and cache_slots, "
                                 f"and no decode (cache={'set' if cache is not None else 'None'}, decode={decode})")
            if positions is None:
                positions = extension.starts[:, None] + torch.arange(s, device=input_ids.device)
            seen = torch.arange(extension.span, device=input_ids.device)
            attn_mask = (seen[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, S, span]
        if positions is None:
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        whole_layer = checkpointing and self.checkpoint_scope == "layer"
        for layer in self.model.layers:
            args = (x, cos, sin, attn_mask, cache, cache_slots, positions, decode, documents,
                    checkpointing and not whole_layer, extension)
            if whole_layer:
                x = torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False)
            else:
                x = layer(*args)
        return self.model.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """fp32 logits [..., V] (the matmul runs in the model's dtype)."""
        return self.lm_head(hidden).float()

    def blocks(self) -> list[nn.Module]:
        """The decoder layers: the units FSDP2 shards and the learner compiles."""
        return list(self.model.layers)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[target]: [..., V], [...] -> [...], in fp32.

    Dividing by the sampling temperature makes these the log-probs of the distribution the engine
    sampled from (verl does the same in its actor).
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature): logsumexp(z) − Σ softmax(z)·z, [..., V] -> [...]."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    entropy = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return entropy.clamp(min=0.0)  # cancellation can give −1e-5 for a near one-hot row
