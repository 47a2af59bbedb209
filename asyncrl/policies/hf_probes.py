"""Load-time probes of an HF-path model (`asyncrl.policies.hf_model.HFCausalLM`), so that nothing trains silently
wrong. Each runs a few dozen tokens through the model on its device, in its dtype, before the first step:

| probe     | compares                                                           | on failure                          |
|-----------|--------------------------------------------------------------------|-------------------------------------|
| attention | asyncrl's document attention vs the model's own, on one sequence   | the model's own attention, padded   |
|           | longer than its sliding window                                     | rows (packing off)                  |
| packing   | two documents packed in one row vs each alone                      | packed rows run as padded rows      |
| head      | `logits(hidden)` (scale, soft-cap) vs the model's own logits       | refused: the head is not known      |
| names     | checkpoint names and shapes vs the directory's safetensors headers | refused, the first mismatches named |

A feature turned off is logged in one line that says why (`HFCausalLM.features.reasons` keeps them). Known
cases: hybrid linear-attention layers (Qwen3.5, Qwen3-Next) carry state across packed documents, so packing
goes off for them; attention sinks (gpt-oss) and attention logit soft-capping (Gemma 2) are computed by the
document attention's eager formula, which the attention probe checks against the model's own.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Iterator

import torch
from torch import Tensor

from asyncrl.policies.attention_layouts import DocumentLayout
from asyncrl.policies.model_files import safetensors_shapes

__all__ = ["probe_model", "ProbeResult", "HFFeatures", "probe_tolerance", "checkpoint_names"]

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class HFFeatures:
    """What the load-time probes left on (`asyncrl.policies.hf_probes`), and why anything is off."""

    packing: bool = True  # packed rows attend per document (else: run as padded rows)
    document_attention: bool = True  # asyncrl's attention function (else: the model's own, padded rows only)
    fused_head: bool = True  # log-probs straight from hidden states and lm_head.weight (else: `logits()`)
    reasons: tuple[str, ...] = ()



_LENGTHS = (13, 11)  # two documents; the first longer than the zoo's sliding windows


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """How far apart two computations of the same values came: max |a − b| against the allowed bound."""

    name: str
    error: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.error <= self.bound

    def __str__(self) -> str:
        return f"{self.name} probe: max |Δ| {self.error:.3g} > {self.bound:.3g}"


def probe_tolerance(reference: Tensor) -> float:
    """The bound for two computations of `reference` that differ in rounding only: 1e-4 relative in float32,
    3e-2 in half precision (a leak or a wrong mask moves values by O(0.1..1) relative)."""
    relative = 1e-4 if reference.dtype == torch.float32 else 3e-2
    return relative * max(float(reference.float().abs().max()), 1.0)


def _compare(name: str, got: Tensor, want: Tensor) -> ProbeResult:
    return ProbeResult(name, float((got.float() - want.float()).abs().max()), probe_tolerance(want))


def _ids(model, length: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, length), generator=gen).to(model.device)


def _hidden(model, ids: Tensor, documents: DocumentLayout | None = None, positions: Tensor | None = None) -> Tensor:
    return model(ids, positions, documents=documents)


def attention_probe(model) -> ProbeResult:
    """Document attention vs the model's own implementation on one sequence of sum(_LENGTHS) tokens."""
    ids = _ids(model, sum(_LENGTHS), seed=1)
    ours = _hidden(model, ids)
    current = model.hf.config._attn_implementation
    model.hf.set_attn_implementation(model.native_attention)
    try:
        theirs = _hidden(model, ids)
    finally:
        model.hf.set_attn_implementation(current)
    return _compare("attention", ours, theirs)


def packing_probe(model) -> ProbeResult:
    """Two documents packed in one row (positions restarting) vs each alone."""
    docs = [_ids(model, n, seed=2 + i) for i, n in enumerate(_LENGTHS)]
    cu = torch.tensor([0, _LENGTHS[0], sum(_LENGTHS)], dtype=torch.int32, device=model.device)
    positions = torch.cat([torch.arange(n, device=model.device) for n in _LENGTHS])[None]
    packed = _hidden(model, torch.cat(docs, dim=1), DocumentLayout(_LENGTHS, cu), positions)
    alone = torch.cat([_hidden(model, d) for d in docs], dim=1)
    return _compare("packing", packed, alone)


def head_probe(model) -> ProbeResult:
    """`model.logits(hidden)` vs the logits of the HF model's own forward."""
    ids = _ids(model, _LENGTHS[0], seed=4)
    ours = model.logits(_hidden(model, ids))
    theirs = model.hf(input_ids=ids, use_cache=False).logits
    return _compare("head", ours, theirs)


def checkpoint_names(model) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every weight `model` publishes and exports (the tied lm_head left out)."""
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        for out, t in model.checkpoint_tensors(name, tensor):
            yield out, tuple(t.shape)



def names_problem(model, directory: pathlib.Path) -> str | None:
    """Why the names and shapes `model` publishes differ from its checkpoint's (None when they agree)."""
    ours = dict(checkpoint_names(model))
    theirs = safetensors_shapes(directory)
    if model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    missing = sorted(theirs.keys() - ours.keys())
    extra = sorted(ours.keys() - theirs.keys())
    shapes = sorted(n for n in ours.keys() & theirs.keys() if ours[n] != theirs[n])
    if not (missing or extra or shapes):
        return None
    parts = [f"{label} {names[:3]}{'...' if len(names) > 3 else ''}" for label, names in
             (("not published", missing), ("not in the checkpoint", extra), ("other shapes", shapes)) if names]
    return "; ".join(parts)


def probe_model(model, *, directory: pathlib.Path | None = None) -> None:
    """Run the probes on `model` (an `HFCausalLM`) and set its `features`; raise ValueError for a model that would
    train wrong with no fallback (an unknown logit transform, checkpoint names it cannot publish)."""
    features = model.features
    reasons = list(features.reasons)
    kind = model.config.model_type
    was_training = model.training
    model.eval()
    with torch.no_grad():
        head = head_probe(model)
        if not head.ok:
            raise ValueError(f"--model.path: {kind}: its logits are not lm_head(hidden) with a known scale or "
                             f"soft-cap ({head}); asyncrl cannot compute its log-probs exactly")
        attention = attention_probe(model)
        document_attention = attention.ok
        if not document_attention:
            model.use_native_attention()
            reasons.append(f"{attention}: the model's own attention ({model.native_attention}), padded rows")
            log.warning("%s: document attention off (%s); packed rows run padded", kind, attention)
        packing = document_attention
        if packing:
            model.features = dataclasses.replace(features, packing=True)
            result = packing_probe(model)
            packing = result.ok
            if not packing:
                reasons.append(f"{result}: packed rows run as padded rows")
                log.warning("%s: packing off (%s); packed rows run as padded rows", kind, result)
    model.features = HFFeatures(packing=packing, document_attention=document_attention,
                                fused_head=features.fused_head, reasons=tuple(reasons))
    model.train(was_training)
    if directory is not None:
        problem = names_problem(model, directory)
        if problem is not None:
            raise ValueError(f"--model.path {directory}: the weights asyncrl would publish do not match the "
                             f"checkpoint's names ({problem}); this architecture cannot be served by name")
