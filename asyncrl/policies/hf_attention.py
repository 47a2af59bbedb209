"""Document-causal attention for `transformers` models, registered as an attention implementation, so that any
HF decoder trains on rows packed end to end (`DocumentLayout`) with asyncrl's own kernels, and no flash-attn
dependency.

    name = register_document_attention()              # "asyncrl_documents", idempotent
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    hidden = hf.model(input_ids=ids, position_ids=positions, use_cache=False,
                      asyncrl_documents=documents).last_hidden_state

transformers passes the call's extra keyword arguments down to each attention module, which calls
`document_attention(module, q, k, v, mask, dropout=, scaling=, sliding_window=, softcap=, s_aux=, ...)` with
q [B, H, L, D] and k, v [B, Hkv, L, D]; it returns [B, L, H, D]. The registered mask builder returns None: the
function masks by itself (causal, per document, within the layer's sliding window).

* CUDA, bf16/fp16, plain softmax: one varlen flash-attention call over all documents (window and scale honoured).
* Otherwise SDPA per document (CPU), or, for what SDPA cannot express — attention logit soft-capping (Gemma 2) and
  attention sinks (gpt-oss, `s_aux`) —, the eager formula per document, as transformers' eager path computes it.
Rows without `asyncrl_documents` (right-padded rows) are one document each: right padding never reaches an
earlier token.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl.policies.attention_layouts import DocumentLayout

__all__ = ["ATTENTION", "register_document_attention", "document_attention"]

ATTENTION = "asyncrl_documents"


def register_document_attention() -> str:
    """Register `document_attention` (and a mask builder that builds nothing) with transformers under
    `ATTENTION`; returns the name. Registering again replaces the entry with the same function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    # this torch's varlen keywords, read here: a compiled layer must not call inspect
    AttentionInterface.register(ATTENTION, functools.partial(document_attention, varlen_params=_varlen_params()))
    AttentionMaskInterface.register(ATTENTION, _no_mask)
    return ATTENTION


def _no_mask(*args, **kwargs) -> None:
    return None


def _band(length: int, window: int | None, device: torch.device) -> Tensor | None:
    """Bool [L, L], True where query i sees key j: j <= i and i - j < window (None: plain causal, no window
    inside L)."""
    if window is None or window >= length:
        return None
    i = torch.arange(length, device=device)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)


def _eager(q: Tensor, k: Tensor, v: Tensor, scaling: float, window: int | None, softcap: float | None,
           sinks: Tensor | None, dropout: float) -> Tensor:
    """softmax(q·kᵀ·scaling, soft-capped, causal within the window, with a sink logit per head) · v for one
    document: q [B, H, l, D], k, v [B, Hkv, l, D] -> [B, H, l, D] (transformers' eager formula)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    length = q.shape[2]
    allowed = _band(length, window, q.device)
    if allowed is None:
        allowed = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, length, -1).to(scores.dtype)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scaling: float, window: int | None, dropout: float) -> Tensor:
    allowed = _band(q.shape[2], window, q.device)
    gqa = q.shape[1] != k.shape[1]
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scaling, dropout_p=dropout,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, dropout_p=dropout,
                                          enable_gqa=gqa)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The keyword arguments this torch's `varlen_attn` takes (none where it has no varlen attention): 2.11 takes
    `scale` and `window_size`; 2.13 also asks for `enable_gqa` (flash reads grouped K/V heads natively)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash_ok(params: frozenset[str], window: int | None) -> bool:
    return "scale" in params and ("window_size" in params or window is None)


def _flash(documents: DocumentLayout, q: Tensor, k: Tensor, v: Tensor, scaling: float, window: int | None,
           params: frozenset[str]) -> Tensor:
    """All documents in one varlen flash call: [1, H, L, D] in, [1, L, H, D] out."""
    from torch.nn.attention.varlen import varlen_attn
    kwargs = {"scale": scaling}
    if "window_size" in params:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    tokens_first = [t[0].transpose(0, 1) for t in (q, k, v)]  # [L, H, D]
    out = varlen_attn(*tokens_first, documents.cu_seqlens, documents.cu_seqlens, documents.max_len,
                      documents.max_len, **kwargs)
    return out[None]


def document_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, softcap: float | None = None, s_aux: Tensor | None = None,
                       asyncrl_documents: DocumentLayout | None = None, varlen_params: frozenset[str] = frozenset(),
                       **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function protocol: query [B, H, L, D], key/value [B, Hkv, L, D] -> ([B, L, H, D],
    None). Causal within each document of `asyncrl_documents` (B == 1), or within each row. `varlen_params`: the
    keywords of this torch's varlen flash attention (`register_document_attention` binds them)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    window = int(sliding_window) if sliding_window else None
    dropout = float(dropout) if module.training else 0.0
    plain = softcap is None and s_aux is None
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    documents = asyncrl_documents
    if (documents is not None and plain and not dropout and query.is_cuda
            and query.dtype in (torch.bfloat16, torch.float16) and _flash_ok(varlen_params, window)):
        return _flash(documents, query, key, value, scaling, window, varlen_params), None
    lengths = documents.lengths if documents is not None else (query.shape[2],)
    parts = []
    for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value))):
        if plain:
            parts.append(_sdpa(q, k, v, scaling, window, dropout))
        else:
            parts.append(_eager(q, k, v, scaling, window, softcap, s_aux, dropout))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None
