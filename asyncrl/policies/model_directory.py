"""A Hugging Face model directory as a rollout engine loads it, described without reading a weight: what vLLM
needs to serve an HF-path model (`--model.impl hf`) from the directory itself instead of a re-saved copy.

    directory = ModelDirectory("path/to/gemma-3-1b", torch.bfloat16, "cuda:0")
    directory.vocab_size, directory.eos_token_ids          # config.json (its text config), generation_config.json
    directory.weight_shapes()                               # checkpoint name -> shape, from the safetensors headers
    directory.kv_cache_bytes(max_slots=64, max_len=1024)    # the CPU KV budget, from the config
    base = DirectoryWeights(directory)                      # one tensor by name, read when asked (LoRA merge bases)

Names are the checkpoint's: what `save_pretrained` writes and vLLM's loader reads (per-expert MoE weights, Phi-3's
fused qkv_proj, a tied head left out). The learner publishes these names, so an update is checked against them.
A config nested for a multimodal checkpoint (`text_config`) is read through its text decoder's config.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import pathlib
import shutil
import tempfile

import torch
from safetensors import safe_open
from torch import Tensor

from asyncrl.policies.hf_model import random_transformers
from asyncrl.policies.model_files import generation_eos_ids, safetensors_files, safetensors_shapes, text_config

__all__ = ["ModelDirectory", "DirectoryWeights", "has_recurrent_layers", "kv_bytes_per_sequence", "random_hf_directory"]

KV_BLOCK = 128
"""Tokens per sequence added to the KV budget for vLLM's rounding to whole blocks (the CPU backend's block)."""
MIN_KV_BYTES = 64 << 20
_FULL_ATTENTION = ("full_attention", "attention")
_WINDOWED_ATTENTION = ("sliding_attention", "chunked_attention")


def has_recurrent_layers(config: dict) -> bool:
    """Whether a config.json dict's model has layers that carry a state along the sequence instead of a K/V cache
    (the Gated DeltaNet or state-space layers of a hybrid: Qwen3.5, Qwen3-Next; `layer_types`)."""
    kinds = text_config(config).get("layer_types") or []
    return any(kind not in _FULL_ATTENTION and kind not in _WINDOWED_ATTENTION for kind in kinds)


def kv_bytes_per_sequence(config: dict, dtype: torch.dtype, max_len: int) -> int:
    """K and V of one sequence of `max_len` tokens (plus a block for rounding) over the attention layers of a
    config.json dict: a full-attention layer holds every token, a sliding (or chunked) one at most its window;
    layers of other types (the linear-attention or state-space layers of a hybrid, `layer_types`) keep a state
    whose size does not grow with the sequence and are not counted. Multi-head latent attention (`kv_lora_rank`)
    caches one latent of kv_lora_rank + qk_rope_head_dim per token and layer instead of K and V."""
    text = text_config(config)
    layers = int(text["num_hidden_layers"])
    kinds = text.get("layer_types") or ["full_attention"] * layers
    if text.get("kv_lora_rank"):
        per_token = (int(text["kv_lora_rank"]) + int(text.get("qk_rope_head_dim") or 0)) * dtype.itemsize
    else:
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        per_token = 2 * kv_heads * head_dim * dtype.itemsize
    window = text.get("sliding_window") or text.get("attention_chunk_size") or max_len
    tokens = 0
    for kind in kinds:
        if kind in _FULL_ATTENTION:
            tokens += max_len + KV_BLOCK
        elif kind in _WINDOWED_ATTENTION:
            tokens += min(int(window), max_len) + KV_BLOCK
    return per_token * tokens


@dataclasses.dataclass(frozen=True)
class ModelDirectory:
    """An HF model directory (config.json + safetensors) and the precision and device an engine serves it in.
    Picklable: it travels in a `RunSpec` to the agent that loads it. Facts are read from the files when asked."""

    path: str
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    @functools.cached_property
    def config(self) -> dict:
        file = pathlib.Path(self.path) / "config.json"
        if not file.is_file():
            raise ValueError(f"{self.path}: no config.json; an engine serves an HF model directory")
        return json.loads(file.read_text())

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.config)["vocab_size"])

    @property
    def eos_token_ids(self) -> list[int]:
        return generation_eos_ids(self.path, self.config)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape (`safetensors_shapes`): the names and shapes an update may carry."""
        return safetensors_shapes(self.path)

    def kv_cache_bytes(self, max_slots: int, max_len: int) -> int:
        """What `max_slots` sequences of `max_len` tokens need in the engine's dtype (`kv_bytes_per_sequence`),
        at least 64 MiB."""
        return max(max_slots * kv_bytes_per_sequence(self.config, self.dtype, max_len), MIN_KV_BYTES)


class DirectoryWeights:
    """The directory's tensors by checkpoint name, each read when taken (on the directory's device and in its
    dtype): the base weights a LoRA engine in "merge" mode copies once per adapted layer, without holding the
    whole model. `name in weights`, `weights.pop(name)` as a dict of the initial weights would answer."""

    def __init__(self, directory: ModelDirectory):
        self.directory = directory
        self._files: dict[str, pathlib.Path] | None = None

    def _where(self) -> dict[str, pathlib.Path]:
        if self._files is None:
            self._files = {}
            for file in safetensors_files(self.directory.path):
                with safe_open(str(file), "pt") as handle:
                    self._files.update(dict.fromkeys(handle.keys(), file))
        return self._files

    def __contains__(self, name: str) -> bool:
        return name in self._where()

    def pop(self, name: str) -> Tensor:
        with safe_open(str(self._where()[name]), "pt") as handle:
            tensor = handle.get_tensor(name)
        return tensor.to(device=self.directory.device, dtype=self.directory.dtype)


@functools.cache
def _random_directory(config_json: str, seed: int) -> pathlib.Path:
    out = pathlib.Path(tempfile.mkdtemp(prefix="asyncrl-random-hf-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    random_transformers(json.loads(config_json), seed=seed).save_pretrained(str(out))
    return out


def random_hf_directory(config: dict, *, seed: int = 0) -> pathlib.Path:
    """A Hugging Face directory of `config` (a config.json dict) with random weights, written once per process
    (a temporary directory, removed at exit). The weights are `asyncrl.policies.hf_model.random_transformers`'
    (torch.manual_seed(seed), then `AutoModelForCausalLM.from_config` in float32): the learner's
    `random_model(config, impl="hf", seed=seed)` builds the same ones, so a vLLM agent starts from its weights."""
    return _random_directory(json.dumps(config, sort_keys=True), seed)
