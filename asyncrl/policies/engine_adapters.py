"""An engine's side of weight updates, shared by the embedded engine and the vLLM backend: the name and shape
check of every update, and, for an engine built for LoRA, the adapters it takes instead of full weights.

    check_named_tensors(items, shapes, lora_rank=0)       # ValueError before anything is copied
    adapters = EngineAdapters(rank=32, alpha=64, take_base=params.__getitem__)
    for name, tensor in adapters.resolve(items, version):  # what to load: W_base + s·B·A, s = alpha / rank
        params[name].copy_(tensor)

Names mean what they mean in the learner's LoRA model (`asyncrl.policies.lora`):
  `<layer>.lora_A.weight` [r, in], `<layer>.lora_B.weight` [out, r]   the adapter of a linear layer (float32);
  `<layer>.weight`                                                    that layer's *base* weight;
  any other weight (norms, embeddings, the head)                      loaded as it comes.
A publication may split a layer's two factors over several buckets (a colocated load sends one tensor per
call): a factor waits for its pair, and a version given while one still waits is refused, naming the layer,
before anything of that call is loaded. The loaded weight of an adapted layer is recomputed from a copy of its
base on every update (`AdapterMerger`), never from the previous merge, so thousands of versions leave no
drift, and a new base weight is merged with the layer's last adapter. The base copy of a layer is taken at
its first adapter (or base) update, through `take_base`, on the engine's device and in its dtype: one more copy
of the adapted layers' weights (12.9 GiB for a Qwen3-8B shape in bf16), the price of exact, drift-free merges.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable, Iterator, Mapping, Sequence

from torch import Tensor

from asyncrl.policies.lora import LORA_TARGETS, AdapterMerger, is_adapter_name

__all__ = ["EngineAdapters", "check_named_tensors", "is_lora_target", "adapted_layer"]

_TARGET_SUFFIXES = tuple(f".{target}.weight" for target in LORA_TARGETS)


def is_lora_target(name: str, targets: Sequence[str] = LORA_TARGETS) -> bool:
    """Whether `name` is the weight of a linear layer that may carry an adapter (`...q_proj.weight`): one whose
    leaf name is among `targets` (an HF-path model's: `asyncrl.policies.lora.lora_targets`)."""
    suffixes = _TARGET_SUFFIXES if targets is LORA_TARGETS else tuple(f".{t}.weight" for t in targets)
    return name.endswith(suffixes)


def adapted_layer(name: str) -> tuple[str, str]:
    """`<layer>.lora_A.weight` -> (`<layer>`, "A"); the same for B."""
    layer, _, rest = name.rpartition(".lora_")
    return layer, rest[0]


def check_named_tensors(items: Iterable[tuple[str, Tensor]], shapes: Mapping[str, tuple[int, ...]], *,
                        lora_rank: int = 0, lora_targets: Sequence[str] = LORA_TARGETS) -> None:
    """Raise ValueError naming the first tensor an engine with these weight `shapes` (HF name -> shape) cannot
    take: an unknown name, a wrong shape, an adapter factor on an engine without adapters (lora_rank=0), on a
    layer whose leaf name is not among `lora_targets`, or whose rank or shape does not fit its layer
    (A: [lora_rank, in], B: [out, lora_rank])."""
    for name, tensor in items:
        expected = shapes.get(name)
        if is_adapter_name(name):
            layer, factor = adapted_layer(name)
            if lora_rank == 0:
                raise ValueError(f"update_weights: {name!r} is a LoRA adapter, but this engine was built without "
                                 "adapters (lora_rank=0); build it with EngineConfig(lora_rank=R, lora_alpha=A) "
                                 "as the run's --lora.rank / --lora.alpha, or publish full weights")
            base = shapes.get(f"{layer}.weight")
            if base is None or len(base) != 2 or not is_lora_target(f"{layer}.weight", lora_targets):
                raise ValueError(f"update_weights: {name!r} is not the adapter of a linear layer of this model "
                                 f"(one of {', '.join(lora_targets)}); expected names such as "
                                 "'model.layers.0.self_attn.q_proj.lora_A.weight'")
            expected = (lora_rank, base[1]) if factor == "A" else (base[0], lora_rank)
        elif expected is None:
            raise ValueError(f"update_weights: unknown parameter {name!r}; names must be Hugging Face names "
                             "such as 'model.layers.0.self_attn.q_proj.weight'")
        if tuple(tensor.shape) != tuple(expected):
            hint = f" (the engine's lora_rank is {lora_rank})" if is_adapter_name(name) else ""
            raise ValueError(f"update_weights: {name} has shape {list(tensor.shape)}, expected "
                             f"{list(expected)}{hint}")


class EngineAdapters:
    """The adapters a LoRA engine has taken: each layer's last complete pair of factors, the factors still
    waiting for their pair, and the base copies they merge into (see the module docstring).

    Args:
      rank, alpha: the run's LoRA rank and alpha; the merge scale is s = alpha / rank.
      take_base: HF weight name -> the layer's base weight, called once per layer, at its first adapter or base
        update (the merger copies it): the embedded engine passes its live parameter (still the base then);
        vLLM, which keeps no readable checkpoint-format weights, the initial model's tensor, released after.
        None: the engine never merges (vLLM's own adapters load the factors themselves).
      targets: leaf names of the layers that may carry an adapter (a new base weight of one is merged with its
        last adapter); an HF-path model's come from `asyncrl.policies.lora.lora_targets`.
    """

    def __init__(self, *, rank: int, alpha: float, take_base: Callable[[str], Tensor] | None,
                 targets: Sequence[str] = LORA_TARGETS):
        if rank < 1 or not alpha > 0:
            raise ValueError(f"lora_rank={rank}, lora_alpha={alpha}: an engine that takes adapters needs lora_rank "
                             ">= 1 and lora_alpha > 0 (the run's --lora.rank and --lora.alpha); lora_rank=0: none")
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.merger = AdapterMerger({}, scale=self.scale)
        self._take_base = take_base
        self.targets = targets
        self.pairs: dict[str, dict[str, Tensor]] = {}
        """Layer -> its last complete factors {"A": [r, in], "B": [out, r]} (what the engine serves)."""
        self._waiting: dict[str, dict[str, Tensor]] = {}

    @property
    def pending(self) -> list[str]:
        """Layers of which one factor came and the other has not yet."""
        return sorted(self._waiting)

    def _pair_up(self, items: Iterable[tuple[str, Tensor]]) -> tuple[dict, dict]:
        """(layers whose pair completes with `items`, layers still waiting after them); changes nothing."""
        waiting = {layer: dict(pair) for layer, pair in self._waiting.items()}
        complete = {}
        for name, tensor in items:
            if is_adapter_name(name):
                layer, factor = adapted_layer(name)
                waiting.setdefault(layer, {})[factor] = tensor
                if len(waiting[layer]) == 2:
                    complete[layer] = waiting.pop(layer)
        return complete, waiting

    def check_pending(self, items: list[tuple[str, Tensor]], version: int | None) -> None:
        """Refuse a version given while a factor (of an earlier call or of `items`) would still wait."""
        if version is None:
            return
        _, waiting = self._pair_up(items)
        if waiting:
            names = ", ".join(f"{layer}.lora_{'B' if 'A' in pair else 'A'}.weight" for layer, pair in
                              sorted(waiting.items()))
            raise ValueError(f"update_weights: version {version} given while {names} has not come (its other "
                             "factor has): send both factors of a layer before the bucket that carries the version")

    def commit(self, items: list[tuple[str, Tensor]]) -> tuple[list[str], list[tuple[str, Tensor]]]:
        """Record this update: completed pairs, waiting factors, new base weights of adapted layers. Returns the
        weight names whose loaded value changed (load `effective(name)`) and the other plain weights, as given."""
        complete, self._waiting = self._pair_up(items)
        self.pairs.update(complete)
        changed = [f"{layer}.weight" for layer in complete]
        plain = []
        for name, tensor in items:
            if is_adapter_name(name):
                continue
            if is_lora_target(name, self.targets) and self._take_base is not None:
                self._base(name).copy_(tensor)  # the layer's new base; its last adapter is merged into it
                changed.append(name)
            else:
                plain.append((name, tensor))
        return list(dict.fromkeys(changed)), plain

    def resolve(self, items: list[tuple[str, Tensor]], version: int | None) -> Iterator[tuple[str, Tensor]]:
        """`check_pending`, then `commit`; returns what to load: the plain weights, then each changed layer's
        effective weight, computed as it is taken (one merged layer in memory at a time)."""
        self.check_pending(items, version)
        changed, plain = self.commit(items)
        return itertools.chain(plain, ((name, self.effective(name)) for name in changed))

    def effective(self, name: str) -> Tensor:
        """What the engine serves for weight `name` of a target layer: W_base + s·B·A of its last pair, or W_base."""
        base = self._base(name)
        pair = self.pairs.get(name.removesuffix(".weight"))
        if pair is None:
            return base
        layer = name.removesuffix(".weight")
        ((_, merged),) = self.merger.merge([(f"{layer}.lora_A.weight", pair["A"]),
                                            (f"{layer}.lora_B.weight", pair["B"])])
        return merged

    def _base(self, name: str) -> Tensor:
        if name not in self.merger.base:
            if self._take_base is None:
                raise RuntimeError(f"EngineAdapters: {name}: this engine keeps no base copy to merge into")
            self.merger.base[name] = self._take_base(name).detach().clone()
        return self.merger.base[name]
