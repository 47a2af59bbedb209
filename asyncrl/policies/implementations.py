"""Which implementation trains a model and which engine generates with it, decided from its config alone (no
weights read), before any process starts.

    impl = resolve_impl("path/to/gemma-3-1b", "auto")        # "own" for llama/qwen2/qwen3/mistral, else "hf"
    backend = resolve_backend(impl, "auto")                  # "asyncrl" (embedded engine) for own, else "vllm"

* own: asyncrl's Llama-family `CausalLM` (`asyncrl.policies.model`), the fast path, served by the embedded engine
  or vLLM.
* hf: the `transformers` model of the checkpoint's architecture (`asyncrl.policies.hf_model`), for every other
  causal LM transformers implements itself; vLLM generates for it. Repository code (`trust_remote_code`) is never
  run: a config that needs it is refused.
"""

from __future__ import annotations

import json
import pathlib
from typing import Literal

from asyncrl.policies.model import SUPPORTED_MODEL_TYPES

__all__ = ["Impl", "model_config_dict", "resolve_impl", "resolve_backend", "transformers_knows"]

Impl = Literal["own", "hf"]


def model_config_dict(path: str) -> dict:
    """The config.json of a --model.path as a dict, read without weights: 'random:<preset or config.json>', a
    .gguf file or 'smollm2' (Llama-family GGUF conversions), an HF directory, or a Hub name in the local cache."""
    from asyncrl.policies.model_configs import ARCH_PRESETS, hf_config
    if path.startswith("random:"):
        return hf_config(path.removeprefix("random:"))
    if path == "smollm2" or path.endswith(".gguf"):
        return dict(ARCH_PRESETS["smollm2-135m"]) if path == "smollm2" else {"model_type": "llama"}
    from asyncrl.tools.hub import local_model_path
    directory = pathlib.Path(local_model_path(path, "model path"))
    config = directory / "config.json"
    if not config.is_file():
        raise ValueError(f"--model.path {path}: no config.json there; pass an HF model directory, a Hub name "
                         "ORG/NAME, a .gguf file, 'smollm2' or 'random:<preset>'")
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config}:{err.lineno}: not valid JSON ({err.msg})") from None


def transformers_knows(model_type: str) -> bool:
    """Whether the installed `transformers` implements `model_type` itself (no repository code)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return model_type in CONFIG_MAPPING_NAMES


def resolve_impl(path: str, impl: str = "auto", *, config: dict | None = None) -> Impl:
    """The implementation --model.impl `impl` gives the model at --model.path `path` (its config: `config`, read
    from `path` when None). Raises ValueError naming the flag to change when the model cannot train here."""
    cfg = model_config_dict(path) if config is None else config
    model_type = str(cfg.get("model_type", ""))
    own = model_type in SUPPORTED_MODEL_TYPES
    if impl == "own":
        if not own:
            raise ValueError(f"--model.impl own: model_type {model_type!r} ({path}) is not one of asyncrl's own "
                             f"models ({', '.join(SUPPORTED_MODEL_TYPES)}); use --model.impl auto or hf")
        return "own"
    if impl not in ("auto", "hf"):
        raise ValueError(f"--model.impl {impl}: choose auto, own or hf")
    if impl == "auto" and own:
        return "own"
    if not model_type or not transformers_knows(model_type):
        remote = " and needs its repository's code (auto_map), which asyncrl never runs" if cfg.get("auto_map") else ""
        raise ValueError(f"--model.path {path}: model_type {model_type or '(none)'!r} is not implemented by the "
                         f"installed transformers{remote}; pick a model transformers implements (a newer "
                         "transformers may add it)")
    return "hf"


def resolve_backend(impl: Impl, backend: str = "auto") -> Literal["asyncrl", "vllm"]:
    """The engine --rollout.backend `backend` gives a model of implementation `impl`: auto takes the embedded
    engine for asyncrl's own models and vLLM otherwise. Raises ValueError for the embedded engine on a model it
    does not implement."""
    if backend == "vllm" or (backend == "auto" and impl == "hf"):
        return "vllm"
    if impl == "hf":
        raise ValueError(f"--rollout.backend asyncrl: the embedded engine implements asyncrl's own models "
                         f"({', '.join(SUPPORTED_MODEL_TYPES)}) only; this model trains through transformers "
                         "(--model.impl hf): use --rollout.backend vllm (or auto)")
    return "asyncrl"
