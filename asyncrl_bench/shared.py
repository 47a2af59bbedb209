"""What the engine and learner benchmarks share: the device's clock and name, the --dtype, a Hugging Face copy of
our model, a call in a process of its own (vLLM's), the `--out` JSON file."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import multiprocessing
import tempfile

import torch

from asyncrl.policies import save_pretrained

__all__ = ["synchronize", "device_name", "indexed_device", "hf_copy", "in_own_process", "write_json", "bench_dtype"]


def bench_dtype(dtype: str, device: str) -> torch.dtype:
    """A benchmark's --dtype as a torch dtype (auto: bfloat16 on CUDA, float32 elsewhere, as a run's engine)."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"--dtype {dtype}: choose auto or a torch dtype (bfloat16, float16, float32)")
    return found


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work (nothing to wait for on CPU), so a timer reads finished work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def indexed_device(device: str) -> str:
    """`device` with its index ("cuda" is the current CUDA device): vLLM sets its device by index."""
    if torch.device(device) == torch.device("cuda"):
        return f"cuda:{torch.cuda.current_device()}"
    return device


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def hf_copy(model, dtype: torch.dtype, device: str):
    """The same weights as a `transformers` model (saved and re-opened through a temporary directory)."""
    import transformers
    if getattr(model, "impl", "own") == "hf":  # already a transformers model: a copy, with its own attention
        hf = copy.deepcopy(model.hf)
        hf.set_attn_implementation(model.native_attention)
        return hf.to(device=device, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device)


def in_own_process(function, *args):
    """function(*args) in a fresh process: vLLM changes process-wide torch settings and starts children."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def write_json(path: str | None, results) -> None:
    """`results` as indented JSON at `path` (`--out`); nothing without a path."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)

