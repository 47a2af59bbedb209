"""--lora.* against the model, before launch (`asyncrl.launch.preflight` runs it): the target names exist on this
model, every targeted layer is wider than the rank, and what the adapters train.

The layers come from the model's config, no weights read: asyncrl's own models from their `TransformerConfig` (the
seven projections of every layer), HF-path models from the transformers model built on the meta device, whose
candidates are the ones `apply_lora` will adapt (`asyncrl.policies.lora.lora_candidates`: every decoder linear layer
less routers, the head and towers), with their real shapes, layer by layer (a hybrid's layers differ).

A layer not wider than the rank (an adapter with more parameters than the layer it adapts) is refused where the
user named it, and on asyncrl's own models as before; where all-linear picked it on an HF-path model it is a
note: Qwen3.5's in_proj_a / in_proj_b are as wide as its linear-attention heads (a few dozen), and refusing the
default for every such model over a wasteful but harmless adapter would be worse.
"""

from __future__ import annotations

import dataclasses

from asyncrl.config import RunConfig
from asyncrl.config.flags import flag, shown
from asyncrl.config.run_config import ALL_LINEAR, LORA_TARGETS
from asyncrl.launch.device_checks import known_model_config
from asyncrl.policies.implementations import model_config_dict, resolve_impl
from asyncrl.policies.lora import lora_candidates, lora_layers
from asyncrl.policies.meta_model import meta_transformers, text_config

__all__ = ["LayerShapes", "LoraCheck", "check_lora", "lora_layer_shapes"]


@dataclasses.dataclass(frozen=True)
class LayerShapes:
    """The layers an adapter may target on a model: leaf name -> (in, out) of each layer of that name."""

    shapes: dict[str, list[tuple[int, int]]]
    params: int  # the model's parameter count (tied weights once)
    model_type: str
    impl: str


@dataclasses.dataclass
class LoraCheck:
    problems: list[str] = dataclasses.field(default_factory=list)
    facts: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def lora_layer_shapes(path: str, impl: str = "auto") -> LayerShapes | None:
    """The adapter candidates of --model.path `path` under --model.impl `impl`; None where the model is not known
    before loading (a .gguf file). Raises ValueError when transformers does not build an HF-path model's config."""
    try:
        chosen = resolve_impl(path, impl)
    except (OSError, ValueError):
        return None  # the model check says why
    if chosen == "own" or path == "smollm2" or path.endswith(".gguf"):  # a GGUF loads as asyncrl's own model
        m = known_model_config(path)
        if m is None:
            return None
        q, kv, h, i = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.hidden_size, m.intermediate_size
        one = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
               "up_proj": (h, i), "down_proj": (i, h)}
        return LayerShapes({t: [one[t]] * m.num_layers for t in LORA_TARGETS}, m.num_params_estimate, m.model_type,
                           "own")
    model = meta_transformers(model_config_dict(path))
    shapes: dict[str, list[tuple[int, int]]] = {}
    for name in lora_layers(model, lora_candidates(model)):
        layer = model.get_submodule(name)
        shapes.setdefault(name.rpartition(".")[2], []).append((layer.in_features, layer.out_features))
    return LayerShapes(shapes, sum(p.numel() for p in model.parameters()), str(text_config(model).model_type), chosen)


def check_lora(cfg: RunConfig) -> LoraCheck:
    """Problems, facts and notes of --lora.* against --model.path (nothing when LoRA is off or the model is not
    known before loading)."""
    lora, path, out = cfg.lora, cfg.model.path, LoraCheck()
    if not lora.enabled:
        return out
    try:
        layers = lora_layer_shapes(path, cfg.model.impl)
    except ValueError as err:
        out.problems.append(f"{flag('model', 'path')} {path}: {err}")
        return out
    if layers is None:
        return out
    option, named = flag("lora", "target_modules"), lora.target_modules != (ALL_LINEAR,)
    if not layers.shapes:
        out.problems.append(f"{flag('lora', 'rank')} {lora.rank} is invalid for {path}: {layers.model_type} has no "
                            "nn.Linear layer in its decoder layers to adapt; use --lora.rank 0 (full fine-tuning)")
        return out
    unknown = [t for t in lora.target_modules if named and t not in layers.shapes]
    if unknown:
        out.problems.append(f"{option} {shown(lora.target_modules)} is invalid: {unknown} "
                            f"{'is' if len(unknown) == 1 else 'are'} not a linear layer of {path} "
                            f"({layers.model_type}); give names among {', '.join(layers.shapes)}, or {ALL_LINEAR}")
        return out
    targets = lora.target_modules if named else tuple(layers.shapes)
    narrow = [f"{t} ({i} -> {o})" for t in targets for i, o in dict.fromkeys(layers.shapes[t]) if lora.rank >= min(i, o)]
    if narrow and (named or layers.impl == "own"):
        out.problems.append(f"{flag('lora', 'rank')} {lora.rank} is invalid for {path}: {', '.join(narrow)} "
                            f"{'is' if len(narrow) == 1 else 'are'} not wider than the rank; use a smaller rank, or "
                            f"{flag('lora', 'rank')} 0 (full fine-tuning)")
        return out
    if narrow:
        out.notes.append(f"{option} {ALL_LINEAR} adapts {', '.join(narrow)}, not wider than --lora.rank {lora.rank}: "
                         "those adapters hold more parameters than their layers; name the layers to adapt in "
                         f"{option} to leave them out")
    trained = lora.rank * sum(i + o for t in targets for i, o in layers.shapes[t])
    out.facts.append(f"lora: rank {lora.rank}, alpha {lora.alpha:g} (scale {lora.alpha / lora.rank:g}) on "
                     f"{' '.join(targets)}: {trained:,} trained parameters ({100 * trained / layers.params:.2g}% of the "
                     f"frozen base's {layers.params:,})")
    return out
