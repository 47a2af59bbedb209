"""What a Hugging Face model directory's files say, read without loading a weight: its weight files, every tensor's
name and shape (the safetensors headers), the ids that end a response, the text decoder's config. The loaders of
both implementations, the load-time probes and the vLLM engine's directory read them here.
"""

from __future__ import annotations

import json
import pathlib

from safetensors import safe_open

__all__ = ["text_config", "generation_eos_ids", "safetensors_files", "safetensors_shapes"]


def text_config(config: dict) -> dict:
    """The text decoder's config of a config.json dict: its `text_config` when nested, else itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def generation_eos_ids(directory: str | pathlib.Path, config: dict) -> list[int]:
    """The ids that end a response: generation_config.json's eos_token_id when it names one (what transformers'
    generate stops at, and what the learner's `HFModelConfig` reads), else the config's (text config first)."""
    file = pathlib.Path(directory) / "generation_config.json"
    if file.is_file():
        try:
            ids = _ids(json.loads(file.read_text()).get("eos_token_id"))
        except ValueError:
            ids = []
        if ids:
            return ids
    return _ids(text_config(config).get("eos_token_id", config.get("eos_token_id")))


def safetensors_files(directory: str | pathlib.Path) -> list[pathlib.Path]:
    """The weight files of a model directory, as transformers and vLLM load them: those of
    model.safetensors.index.json when sharded, else model.safetensors, else every *.safetensors (a directory that
    also holds e.g. consolidated.safetensors has an index)."""
    path = pathlib.Path(directory)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights (asyncrl reads safetensors only; convert .bin "
                         "checkpoints with transformers' save_pretrained)")
    return files


def safetensors_shapes(directory: str | pathlib.Path) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor, read from the safetensors headers (no tensor is read)."""
    shapes = {}
    for file in safetensors_files(directory):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
