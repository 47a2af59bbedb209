"""Checks of where a run's roles go, made before anything is spawned: device names against this machine, and
vLLM's tensor-parallel shards against the model's heads, the GPUs and the cores (`asyncrl.launch.preflight` runs them
and re-exports them)."""

from __future__ import annotations

import os

import torch

from asyncrl.policies.implementations import model_config_dict
from asyncrl.policies.loading import hf_config
from asyncrl.policies.model import TransformerConfig

__all__ = ["attention_heads", "check_devices", "check_tensor_parallel", "known_model_config"]


def _device_problem(device: str, cuda_count: int, option: str) -> str | None:
    try:
        parsed = torch.device(device)
    except RuntimeError:
        return f"{option} {device}: not a device; use cpu, cuda or cuda:N"
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        return f"{option} {device}: {parsed.type} devices are not supported; use cpu, cuda or cuda:N"
    if cuda_count == 0:
        return f"{option} {device}: {device} requested but CUDA is not available on this machine; use cpu"
    if parsed.index is not None and parsed.index >= cuda_count:
        return (f"{option} {device}: this machine has {cuda_count} GPU{'s' * (cuda_count != 1)} "
                f"(cuda:0..cuda:{cuda_count - 1})")
    return None


def check_devices(devices: dict[str, tuple[str, ...]], cuda_count: int | None = None) -> list[str]:
    """Problems with device names, per flag ({'--placement.agent-devices': ('cuda:0',)})."""
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [p for option, names in devices.items() for d in names
            if (p := _device_problem(d, cuda_count, option)) is not None]


def known_model_config(path: str):
    """The model's `TransformerConfig`, from its preset or config.json: None where not known before loading, and
    for every type asyncrl does not implement itself (an HF-path model's shapes: `asyncrl.policies.meta_model`)."""
    name = "smollm2-135m" if path == "smollm2" else path.removeprefix("random:")
    try:
        return TransformerConfig.from_hf(hf_config(name))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def attention_heads(path: str) -> int | None:
    """The model's attention heads (query heads; the text decoder's of a multimodal config), None where not known
    before loading."""
    own = known_model_config(path)
    if own is not None:
        return own.num_heads
    try:
        config = model_config_dict(path)
    except (OSError, ValueError):
        return None
    heads = (config.get("text_config") or config).get("num_attention_heads")
    return int(heads) if isinstance(heads, int) and heads > 0 else None


def check_tensor_parallel(tp: int, agent_devices: tuple[str, ...], model_path: str, *, cuda_count: int | None = None,
                          cores: int | None = None) -> list[str]:
    """Problems of --rollout.vllm.tensor-parallel-size: the heads must split evenly; on GPU each agent takes its
    device and the tp − 1 after it, which must exist and not be another agent's; on CPU each agent's workers
    share its cores, at least one each."""
    option = "--rollout.vllm.tensor-parallel-size"
    if tp <= 1:
        return []
    problems = []
    heads = attention_heads(model_path)
    if heads is not None and heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        problems.append(f"{option} {tp}: the model's {heads} attention heads do not split into {tp} equal shards; "
                        f"use one of {', '.join(map(str, divisors))}")
    if cuda_count is None:
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = cores if cores is not None else len(os.sched_getaffinity(0))
    taken: dict[int, str] = {}
    for device in agent_devices:
        parsed = torch.device(device)
        if parsed.type == "cpu":
            if tp > available:
                problems.append(f"{option} {tp}: on CPU each shard needs a core of its own; this process may use "
                                f"{available}")
            continue
        first = parsed.index or 0
        shards = list(range(first, first + tp))
        if shards[-1] >= cuda_count:
            problems.append(f"{option} {tp}: the agent on {device} shards over cuda:{first}..cuda:{shards[-1]}, but "
                            f"this machine has {cuda_count} GPU{'s' * (cuda_count != 1)}; use --placement.agent-devices "
                            f"cuda:0 with at most {cuda_count} shards")
        clash = sorted({taken[i] for i in shards if i in taken})
        if clash:
            problems.append(f"{option} {tp}: the agents on {', '.join(clash)} and {device} would share GPUs; give "
                            f"each agent {tp} GPUs of its own in --placement.agent-devices (e.g. cuda:0 cuda:{tp})")
        taken.update({i: device for i in shards})
    return problems
