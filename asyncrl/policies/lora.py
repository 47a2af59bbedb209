"""Low-rank adapters (LoRA) on the decoder's linear layers: train a few MB, keep the base frozen.

    apply_lora(model, rank=32, alpha=64)                      # q/k/v/o and gate/up/down of every layer
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

Engines never hold LoRA modules: they take published adapters through `AdapterMerger`, which keeps a copy of
the base weights it merges into and recomputes W = W_base + s·B·A from that copy on every update — never an
update of the previous merge — so thousands of publications leave no rounding drift.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncrl.config.run_config import LORA_TARGETS

__all__ = [
    "LORA_TARGETS", "LoRALinear", "apply_lora", "lora_modules", "adapters_off", "adapter_tensors",
    "is_adapter_name", "merged_weights", "AdapterMerger", "merge_adapters",
]

_ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


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


def apply_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
               targets: Iterable[str] = LORA_TARGETS) -> nn.Module:
    """Put a LoRALinear on every linear layer of `model` whose name ends in one of `targets` and freeze every
    other parameter (embeddings, norms, the head): only the adapters train. Returns `model` (changed in place).

    Raises:
      ValueError: rank < 1, alpha <= 0, dropout outside [0, 1), an unknown target, or a target that names no
        linear layer of this model.
    """
    targets = tuple(targets)
    if rank < 1 or not alpha > 0 or not 0 <= dropout < 1:
        raise ValueError(f"apply_lora: need rank >= 1, alpha > 0 and dropout in [0, 1), got rank={rank}, "
                         f"alpha={alpha}, dropout={dropout}")
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets:
        raise ValueError(f"apply_lora: targets {unknown or '(none)'} are not among {', '.join(LORA_TARGETS)}")
    model.requires_grad_(False)
    found = set()
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf in targets and isinstance(module, nn.Linear):
            parent = model.get_submodule(name.rpartition(".")[0])
            setattr(parent, leaf, LoRALinear(module, rank=rank, alpha=alpha, dropout=dropout))
            found.add(leaf)
    missing = sorted(set(targets) - found)
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
