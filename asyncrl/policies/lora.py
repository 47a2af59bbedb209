"""Low-rank adapters (LoRA) on the decoder's linear layers: train a few MB, keep the base frozen.

    apply_lora(model, rank=32, alpha=64)                      # every linear layer of the decoder ("all-linear")
    apply_lora(model, rank=32, alpha=64, targets=("q_proj", "v_proj"))   # by leaf name, checked against the model
    with adapters_off(model): ...                             # the base model (the reference policy)
    adapters = adapter_tensors(model)                         # [(name, tensor)]: what a publication sends
    merged = dict(merged_weights(model))                      # HF names -> W + s·B·A (export)
    merger = AdapterMerger(base_weights, scale=2.0)           # an engine's side: base kept, merged on update

A targeted `nn.Linear` becomes a `LoRALinear` that keeps the very same weight and bias parameters (their HF
names do not change: `model.layers.0.self_attn.q_proj.weight`) and adds `lora_A` [r, in] and `lora_B`
[out, r] (`...q_proj.lora_A.weight`, `...q_proj.lora_B.weight`, as peft names them):

    y = x Wᵀ + b + s · dropout(x) Aᵀ Bᵀ,        s = alpha / rank,

B starts at zero (the model's function is unchanged), A as peft initialises it (Kaiming-uniform). The base
weights are frozen (`requires_grad=False`: no gradient, no optimizer state); the adapters stay in float32
whatever the base's dtype, and run under the caller's autocast.

Which layers: `lora_candidates(model)`. On asyncrl's own models the seven Llama projections (`LORA_TARGETS`); on
an HF-path model (`asyncrl.policies.hf_model`) the leaf names of every `nn.Linear` inside the text decoder's
numbered layers, as the checkpoint names them (Phi-3's fused `qkv_proj` and `gate_up_proj` are ordinary
candidates), less what an adapter should not touch: MoE routers (a linear layer beside an `experts` module, or
named `router`: their top-k choice would move with the adapter), the LM head, and vision or audio towers. MoE
experts that transformers holds as 3-D parameters are not `nn.Linear` and get no adapter (the attention and any
dense or shared-expert layers do). "all-linear" (peft's name, the default of --lora.target-modules) takes every
candidate; explicit names are checked against them.

Engines never hold LoRA modules: they take published adapters through `AdapterMerger`, which keeps a copy of
the base weights it merges into and recomputes W = W_base + s·B·A from that copy on every update — never an
update of the previous merge — so thousands of publications leave no rounding drift.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.config.run_config import ALL_LINEAR, LORA_TARGETS

__all__ = [
    "ALL_LINEAR", "LORA_TARGETS", "LoRALinear", "apply_lora", "lora_candidates", "lora_targets", "lora_layers",
    "lora_modules", "adapters_off", "adapter_tensors", "is_adapter_name", "merged_weights", "AdapterMerger",
    "merge_adapters",
]

_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_TOWERS = frozenset({"visual", "vision_tower", "vision_model", "audio_tower"})
"""Submodule names of the encoders a multimodal checkpoint carries beside its text decoder: never adapted."""


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRALinear: rank={rank} must be >= 1")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter: names, sharing and loading are unchanged
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        # outside autocast the adapters run in their own float32 (a bf16 base's activations are cast up)
        h = x if torch.is_autocast_enabled(x.device.type) else x.to(self.lora_A.weight.dtype)
        low = self.lora_B(self.lora_A(self.dropout(h))) * self.scale
        return out + low.to(out.dtype)

    def delta(self) -> Tensor:
        """s · B · A in float32: [out, in]."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scale

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha:g}"


def _decoder_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name in `model`, layer) of every linear layer of the text decoder's numbered layers that may take an
    adapter: routers, the LM head (outside the layers) and towers left out (see the module docstring). A layer
    already adapted is given as its LoRALinear (its own lora_A / lora_B are not candidates)."""
    hf = getattr(model, "hf", model)
    decoder = hf.get_decoder() if callable(getattr(hf, "get_decoder", None)) else None
    inside = None if decoder is None else {id(m) for m in decoder.modules()}
    routed = {name for name, m in model.named_modules() if isinstance(getattr(m, "experts", None), nn.Module)}
    adapted = {name for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, LoRALinear)) or (inside is not None and id(module) not in inside):
            continue
        parent, _, leaf = name.rpartition(".")
        parts = name.split(".")
        if (parent in adapted or parent in routed or leaf == "router" or _TOWERS.intersection(parts)
                or not any(p.isdigit() for p in parts[:-1])):
            continue
        yield name, module


def _names_its_layers(model: nn.Module) -> bool:
    """An HF-path model (`HFCausalLM`) or a bare transformers one: its candidates come from its own modules."""
    return getattr(model, "impl", None) == "hf" or type(model).__module__.startswith("transformers.")


def lora_candidates(model: nn.Module) -> tuple[str, ...]:
    """The leaf names an adapter may target on `model`, in the order the model holds them: `LORA_TARGETS` on
    asyncrl's own models (as always), every decoder linear layer's name on an HF-path or transformers model (the
    module docstring says which are left out)."""
    if not _names_its_layers(model):
        return LORA_TARGETS
    return tuple(dict.fromkeys(name.rpartition(".")[2] for name, _ in _decoder_linears(model)))


def lora_targets(model: nn.Module, targets: Iterable[str] = (ALL_LINEAR,)) -> tuple[str, ...]:
    """The leaf names --lora.target-modules `targets` adapts on `model`: "all-linear" gives every candidate.

    Raises:
      ValueError: no targets, a name given twice, "all-linear" beside names, a name that is not a candidate of
        this model (the message names the flag, the unknown names and the valid ones), or a model with no
        candidate at all.
    """
    targets, candidates = tuple(targets), lora_candidates(model)
    kind = getattr(getattr(model, "config", None), "model_type", None)
    of_model = f"this model{f' ({kind})' if kind else ''}"
    if not candidates:
        raise ValueError(f"apply_lora: {of_model} has no nn.Linear layer in its decoder layers to adapt (its "
                         "projections are other modules); train full weights (--lora.rank 0)")
    if targets == (ALL_LINEAR,):
        return candidates
    unknown = [t for t in targets if t not in candidates]
    if unknown or not targets or len(set(targets)) != len(targets):
        named = f"{unknown} {'is' if len(unknown) == 1 else 'are'} not a linear layer of {of_model}; " if unknown else ""
        raise ValueError(f"apply_lora: --lora.target-modules {' '.join(targets) or '(none)'}: {named}give distinct "
                         f"names among {', '.join(candidates)}, or {ALL_LINEAR}")
    return targets


def lora_layers(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Names in `model` of the layers `apply_lora(model, targets=targets)` adapts (`targets` as resolved by
    `lora_targets`): an engine's base copies are these layers' `.weight`s."""
    return [name for name, _ in _decoder_linears(model) if name.rpartition(".")[2] in targets]


def apply_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
               targets: Iterable[str] = (ALL_LINEAR,)) -> nn.Module:
    """Put a LoRALinear on every decoder linear layer of `model` whose leaf name is one of `targets` ("all-linear":
    every candidate, `lora_candidates`) and freeze every other parameter (embeddings, norms, the head, MoE experts):
    only the adapters train. Returns `model` (changed in place).

    Raises:
      ValueError: rank < 1, alpha <= 0, dropout outside [0, 1), or targets this model does not have
        (`lora_targets`).
    """
    if rank < 1 or not alpha > 0 or not 0 <= dropout < 1:
        raise ValueError(f"apply_lora: need rank >= 1, alpha > 0 and dropout in [0, 1), got rank={rank}, "
                         f"alpha={alpha}, dropout={dropout}")
    targets = lora_targets(model, targets)
    model.requires_grad_(False)
    found = set()
    for name in lora_layers(model, targets):
        parent, _, leaf = name.rpartition(".")
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            setattr(model.get_submodule(parent), leaf, LoRALinear(module, rank=rank, alpha=alpha, dropout=dropout))
            found.add(leaf)
    missing = [t for t in targets if t not in found]
    if missing:
        raise ValueError(f"apply_lora: this model has no linear layer named {', '.join(missing)}")
    return model


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Run `model` as its base (every adapter skipped) inside the block: the reference policy of a LoRA run,
    with no second model in memory."""
    modules = [m for _, m in lora_modules(model)]
    before = [m.enabled for m in modules]
    for m in modules:
        m.enabled = False
    try:
        yield model
    finally:
        for m, state in zip(modules, before):
            m.enabled = state


def is_adapter_name(name: str) -> bool:
    return name.endswith(_ADAPTER_SUFFIXES)


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # an FSDP2 shard: gathered


def adapter_tensors(model: nn.Module) -> list[tuple[str, Tensor]]:
    """(name, full tensor) of every adapter weight, in a fixed order: a publication's payload. FSDP2 shards
    are gathered (every rank of the trainer group must call this together)."""
    return [(name, _full(p).detach()) for name, p in model.named_parameters() if is_adapter_name(name)]


def merged_weights(model: nn.Module, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) of every weight of the model with each adapter merged in (W + s·B·A), adapters left
    out: a plain model's state (export). A tied lm_head is left out, as in `named_weights`."""
    deltas = {f"{name}.weight": module for name, module in lora_modules(model)}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, tensor in model.state_dict().items():
        if is_adapter_name(name) or (tied and name == "lm_head.weight"):
            continue
        full = _full(tensor).detach()
        if name in deltas:
            full = (full.float() + deltas[name].delta().to(full.device)).to(full.dtype)
        yield name, full if dtype is None else full.to(dtype)


class AdapterMerger:
    """An engine's side of adapter publications: a copy of the base weights of the adapted layers, and the
    merged weights W_base + s·B·A (float32 arithmetic, cast to the base's dtype), recomputed from that copy on
    every update. A publication may come in several buckets that split a layer's two factors: a factor waits
    for its pair (`pending`).

    Args:
      base: HF weight name -> the engine's tensor of every layer that may carry an adapter (copied now).
      scale: s = alpha / rank.
    """

    def __init__(self, base: Mapping[str, Tensor], *, scale: float):
        self.base = {name: tensor.detach().clone() for name, tensor in base.items()}
        self.scale = scale
        self._waiting: dict[str, dict[str, Tensor]] = {}

    @property
    def pending(self) -> list[str]:
        """Layers of which one factor came and the other has not yet."""
        return sorted(self._waiting)

    def merge(self, adapters: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
        """The merged weight of every layer whose two factors have now both come ([(HF weight name, tensor)]).

        Raises:
          ValueError: a name that is not `<layer>.lora_A.weight` / `.lora_B.weight` of a known layer, or
            factors whose shapes do not multiply to the layer's.
        """
        for name, tensor in adapters:
            layer, _, rest = name.rpartition(".lora_")
            if rest not in ("A.weight", "B.weight") or f"{layer}.weight" not in self.base:
                raise ValueError(f"AdapterMerger: {name!r} is not the lora_A/lora_B weight of an adapted layer")
            self._waiting.setdefault(layer, {})[rest[0]] = tensor
        merged = []
        for layer in [layer for layer, pair in self._waiting.items() if len(pair) == 2]:
            pair = self._waiting.pop(layer)
            base = self.base[f"{layer}.weight"]
            a, b = pair["A"].to(base.device, torch.float32), pair["B"].to(base.device, torch.float32)
            if b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(base.shape):
                raise ValueError(f"AdapterMerger: {layer}: B {list(b.shape)} · A {list(a.shape)} does not give "
                                 f"the layer's shape {list(base.shape)}")
            merged.append((f"{layer}.weight", (base.float() + (b @ a) * self.scale).to(base.dtype)))
        return merged


def merge_adapters(weights: dict[str, Tensor], lora: dict) -> dict[str, Tensor]:
    """`weights` (HF names, adapters included) with every adapted layer merged to W + (alpha / rank)·B·A in
    float32 and the adapters left out: a plain model's state."""
    adapters = {name: t for name, t in weights.items() if is_adapter_name(name)}
    layers = {name.rpartition(".lora_")[0] + ".weight" for name in adapters}
    merger = AdapterMerger({name: weights[name].float() for name in layers}, scale=lora["alpha"] / lora["rank"])
    merged = dict(merger.merge(adapters.items()))
    if merger.pending or merged.keys() != layers:
        raise ValueError(f"merge_adapters: layers with one factor only: {', '.join(merger.pending)}")
    return {name: merged.get(name, t) for name, t in weights.items() if not is_adapter_name(name)}
