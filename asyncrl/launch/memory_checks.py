"""Memory that fits, decided before launch (`asyncrl.launch.preflight` runs it): every GPU's peak predicted from the
config, against what the GPU has free now.

    check = check_memory(cfg, shape, CudaMemory(), slots_given="--rollout.max-slots" in given)
    check.problems     # a layout that cannot fit: names the flag as typed and the value that fits
    check.facts        # each GPU's predicted peak
    check.notes        # a lowered --rollout.max-slots (printed before launch)
    check.max_slots    # the slot count the run gets (lowered where the user did not choose it)

On each CUDA device of `--placement.trainer-devices` and `--placement.agent-devices` the roles placed there add up
(`asyncrl.planning.memory` counts their bytes): a trainer rank holds its shard of the weights, gradients and AdamW
moments and its activations at `--trainer.max-tokens-per-micro-batch`; an embedded engine its bf16 weights (with
LoRA, also the base copy it merges from), a KV cache of `--rollout.max-slots` sequences of prompt + new tokens,
logits and overhead; a vLLM engine `--rollout.vllm.gpu-memory-utilization` of the device's memory. Colocated runs
free the KV cache while training (`--async-training.colocated-sleep`), so it shares the activations' memory. Every
process adds its CUDA context, and MARGIN of the device is kept for the allocator's fragmentation. CPU devices are
not checked, nor torchrun jobs (each rank sees only its own node). Free memory comes from a `DeviceMemory`
source: `CudaMemory` asks the driver; tests pass their own.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from asyncrl.config import RunConfig
from asyncrl.planning.memory import (ALLOCATOR_SLACK, CUDA_CONTEXT_GIB, GIB, EngineBytes, engine_bytes,
                                     trainer_activation_bytes, trainer_state_bytes)
from asyncrl.planning.predict import ModelShape

__all__ = ["DeviceMemory", "CudaMemory", "MemoryCheck", "DeviceNeed", "MARGIN", "check_memory", "device_needs",
           "cuda_index"]

MARGIN = 0.05
"""Share of a GPU's memory kept free of predicted use: the caching allocator's fragmentation and what the
prediction misses (the activation model is within ~3 GiB of measured peaks)."""


class DeviceMemory(Protocol):
    """Where the check learns a GPU's memory."""

    def free_and_total(self, index: int) -> tuple[int, int]:
        """(free, total) bytes of cuda:`index`, as `torch.cuda.mem_get_info` gives them."""


class CudaMemory:
    """This machine's GPUs: NVML through `torch.cuda.device_memory_used` where pynvml is installed (this process
    opens no CUDA context, which would hold ~0.5 GiB of each GPU for the whole run), else
    `torch.cuda.mem_get_info`."""

    def free_and_total(self, index: int) -> tuple[int, int]:
        import torch
        try:
            total = torch.cuda.get_device_properties(index).total_memory
            return total - torch.cuda.device_memory_used(index), total
        except Exception:  # noqa: BLE001 - no pynvml, or NVML refused: the CUDA runtime answers instead
            free, total = torch.cuda.mem_get_info(index)
            return free, total


def cuda_index(device: str) -> int | None:
    """The GPU index of a device name ('cuda' is cuda:0 on one host), None for a CPU."""
    if not device.startswith("cuda"):
        return None
    return int(device.partition(":")[2] or 0)


@dataclasses.dataclass
class DeviceNeed:
    """What one GPU's roles hold at their peak (bytes)."""

    index: int
    trainer: float = 0.0  # every trainer rank here: states, activations, their processes' contexts
    activations: float = 0.0  # of those ranks (colocated sleep shares them with the KV cache)
    engine: float = 0.0  # embedded engines and vLLM shares, with their processes' contexts
    kv_cache: float = 0.0  # of the embedded engines here (with their logits rows)
    slots: int = 0  # sequences the embedded engines here hold, all together
    vllm: float = 0.0  # vLLM's share of the device
    shared: float = 0.0  # colocated sleep: bytes the KV cache and the activations take in turn

    @property
    def total(self) -> float:
        return self.trainer + self.engine - self.shared

    def describe(self, tokens: int) -> str:
        """'trainer 32.7 + engine 38.5: KV cache 9.0 GiB for 64 slots of 1,024 tokens' (GiB)."""
        parts = [f"trainer {self.trainer / GIB:.1f}"] if self.trainer else []
        if self.engine:
            what = [f"KV cache {self.kv_cache / GIB:.1f} GiB for {self.slots} slots of {tokens:,} tokens"] \
                if self.slots else []
            what += [f"vLLM {self.vllm / GIB:.1f} GiB"] if self.vllm else []
            parts.append(f"engine {self.engine / GIB:.1f}: {', '.join(what)}")
        text = " + ".join(parts)
        if self.shared:
            text += f"; colocated, the KV cache is freed while training: {self.shared / GIB:.1f} shared"
        return text


@dataclasses.dataclass
class MemoryCheck:
    problems: list[str] = dataclasses.field(default_factory=list)
    facts: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    max_slots: int | None = None
    """The --rollout.max-slots the run gets: lowered where the user did not give it and it did not fit."""


def _trainer_bytes(cfg: RunConfig, shape: ModelShape) -> tuple[float, float]:
    """(states of one rank, activations) of a trainer rank, in bytes."""
    t, lora = cfg.trainer, cfg.lora.rank
    states = trainer_state_bytes(shape, param_dtype=t.param_dtype, lora_rank=lora, offload=t.offload)
    states /= len(cfg.placement.trainer_devices)
    if cfg.algorithm.needs_reference and not lora:
        states += 2 * shape.params  # the bf16 reference model, whole on every rank
    rows = cfg.rollout.max_prompt_length + cfg.rollout.max_new_tokens
    budget = t.max_tokens_per_micro_batch if t.use_dynamic_bsz else t.micro_batch_size * rows
    scope = t.checkpoint_scope if t.gradient_checkpointing else "none"
    activations = trainer_activation_bytes(shape, budget=budget, checkpointing=scope,
                                           logits_chunk=t.logits_chunk_tokens,
                                           fp32_weights=t.param_dtype == "float32" and not lora)
    if cfg.algorithm.needs_critic:  # PPO's value model: its own weights, gradients and moments
        states *= 2
    return states, activations


def _engine(cfg: RunConfig, shape: ModelShape, slots: int) -> EngineBytes:
    r = cfg.rollout
    if r.kv_layout == "shared-prompt":  # slots hold responses; a prompt slot per prompt in flight holds its prompt
        prompts = r.max_prompts or r.max_concurrent_prompts or max(slots // r.n, 1)
        e = engine_bytes(shape, slots=slots, tokens=r.max_new_tokens, lora=cfg.lora.enabled)
        e = dataclasses.replace(e, kv_cache=e.kv_cache + prompts * shape.kv_bytes(r.max_prompt_length))
    else:
        e = engine_bytes(shape, slots=slots, tokens=r.max_prompt_length + r.max_new_tokens, lora=cfg.lora.enabled)
    if cfg.model.engine_dtype == "float32":
        e = dataclasses.replace(e, weights=2 * e.weights, kv_cache=2 * e.kv_cache)
    if cfg.rollout.kv_dtype == "fp8":  # one byte a K/V element instead of the engine dtype's 2 or 4
        e = dataclasses.replace(e, kv_cache=e.kv_cache / (4 if cfg.model.engine_dtype == "float32" else 2))
    return e


def device_needs(cfg: RunConfig, shape: ModelShape, slots: int, totals: dict[int, int], *,
                 vllm: bool = False) -> dict[int, DeviceNeed]:
    """Each GPU's predicted peak with `slots` engine slots; `totals` (bytes by GPU index) sizes vLLM's share."""
    placement, context = cfg.placement, CUDA_CONTEXT_GIB * GIB
    local, colocated = placement.launcher == "local", cfg.async_training.colocated
    needs: dict[int, DeviceNeed] = {}
    opened: set[tuple[str, int]] = set()  # (process, GPU) pairs with a CUDA context

    def on(index: int, process: str) -> tuple[DeviceNeed, float]:
        need = needs.setdefault(index, DeviceNeed(index))
        key = ("launcher" if local else process, index)
        fresh = key not in opened
        opened.add(key)
        return need, context if fresh else 0.0

    states, activations = _trainer_bytes(cfg, shape)
    for rank, device in enumerate(placement.trainer_devices):
        if (index := cuda_index(device)) is not None:
            need, ctx = on(index, f"trainer{rank}")
            need.trainer += states + activations + ctx
            need.activations += activations
    tp = cfg.rollout.vllm.tensor_parallel_size if vllm else 1
    for i, device in enumerate(placement.agent_devices):
        if (index := cuda_index(device)) is None:
            continue
        process = f"trainer{i}" if colocated and not local else f"agent{i}"
        if vllm:
            for shard in range(index, index + tp):
                need, ctx = on(shard, process if shard == index else f"agent{i}-shard{shard}")
                share = cfg.rollout.vllm.gpu_memory_utilization * totals.get(shard, 0)
                need.vllm += share
                need.engine += share + ctx
            continue
        need, ctx = on(index, process)
        e = _engine(cfg, shape, slots)
        need.engine += e.total + ctx
        need.kv_cache += e.kv_cache + e.logits
        need.slots += slots
    if colocated and cfg.async_training.colocated_sleep:
        for need in needs.values():
            need.shared = min(need.activations, need.kv_cache)
    for index, need in needs.items():  # a trainer's allocator slack is lost to another process on its GPU
        if need.trainer and sum(1 for _, i in opened if i == index) > 1:
            need.trainer += ALLOCATOR_SLACK * (need.trainer - CUDA_CONTEXT_GIB * GIB)
    return needs


def _short(need: DeviceNeed, free: int, usable: float, tokens: int) -> str:
    return (f"cuda:{need.index} needs {need.total / GIB:.1f} GiB ({need.describe(tokens)}) but has {free / GIB:.1f} "
            f"GiB free, {usable / GIB:.1f} after a {MARGIN:.0%} margin")


def _helps(cfg: RunConfig, need: DeviceNeed) -> list[str]:
    """Other flags that lower this GPU's need."""
    t, helps = cfg.trainer, []
    if need.trainer and not cfg.lora.enabled and t.offload == "none" and len(cfg.placement.trainer_devices) == 1:
        helps.append("--trainer.offload optimizer")
    if need.trainer and not (t.gradient_checkpointing and t.checkpoint_scope == "layer"):
        helps.append("--trainer.gradient-checkpointing --trainer.checkpoint-scope layer")
    if need.trainer and need.engine and not cfg.async_training.colocated:
        helps.append("--async-training.colocated")
    if need.trainer and need.engine:
        helps.append("--placement.agent-devices on another GPU")
    return helps


def check_memory(cfg: RunConfig, shape: ModelShape, memory: DeviceMemory, *, slots_given: bool = True,
                 vllm: bool = False) -> MemoryCheck:
    """Each GPU's predicted peak against its free memory. A layout that does not fit is a problem naming the flag
    and the value that fits; where `slots_given` is False, --rollout.max-slots is lowered to the largest multiple
    of --rollout.n that fits instead (a note says so)."""
    result = MemoryCheck()
    if cfg.placement.launcher == "torchrun":
        return result
    indices = {i for d in (*cfg.placement.trainer_devices, *cfg.placement.agent_devices)
               if (i := cuda_index(d)) is not None}
    if not indices:
        return result
    if vllm:  # vLLM's shards run past the agent's own GPU
        tp = cfg.rollout.vllm.tensor_parallel_size
        indices |= {i + k for d in cfg.placement.agent_devices if (i := cuda_index(d)) is not None for k in range(tp)}
    measured = {i: memory.free_and_total(i) for i in sorted(indices)}
    totals = {i: total for i, (_, total) in measured.items()}
    usable = {i: free - MARGIN * total for i, (free, total) in measured.items()}
    tokens, n = cfg.rollout.max_prompt_length + cfg.rollout.max_new_tokens, cfg.rollout.n

    def over(slots: int) -> list[DeviceNeed]:
        return [need for i, need in sorted(device_needs(cfg, shape, slots, totals, vllm=vllm).items())
                if need.total > usable[i]]

    current = cfg.rollout.max_slots
    needs = device_needs(cfg, shape, current, totals, vllm=vllm)
    short = [need for i, need in sorted(needs.items()) if need.total > usable[i]]
    if not short:
        result.facts += [f"memory: cuda:{i} {need.total / GIB:.1f} of {measured[i][0] / GIB:.1f} GiB free "
                         f"({need.describe(tokens)})" for i, need in sorted(needs.items())]
        return result
    if vllm and any(need.vllm for need in short):
        result.problems += [_vllm_problem(cfg, shape, need, measured[need.index][0], usable[need.index], tokens)
                            for need in short if need.vllm]
        return result
    fits = next((s for s in range(current - current % n, n - 1, -n) if not over(s)), None)
    worst = short[0]
    free, room = measured[worst.index][0], usable[worst.index]
    if fits is not None and not slots_given:
        result.max_slots = fits
        lowered = device_needs(cfg, shape, fits, totals)[worst.index]
        result.notes.append(f"memory: --rollout.max-slots lowered from {current} to {fits}, the most (a multiple of "
                            f"--rollout.n {n}) that cuda:{worst.index} fits: {lowered.total / GIB:.1f} of "
                            f"{free / GIB:.1f} GiB free ({lowered.describe(tokens)}); give --rollout.max-slots "
                            "to choose")
        return result
    helps = ", ".join(_helps(cfg, worst))
    if fits is not None:
        result.problems.append(f"--rollout.max-slots {current}: {_short(worst, free, room, tokens)}; "
                               f"--rollout.max-slots {fits} fits" + (f" (or {helps})" if helps else ""))
        return result
    budget = _budget_that_fits(cfg, shape, totals, usable, n, vllm)
    flag = "--trainer.max-tokens-per-micro-batch"
    fix = [f"{flag} {budget} fits" + (f" at --rollout.max-slots {n}" if worst.engine else "")] if budget else []
    head = (f"{flag} {cfg.trainer.max_tokens_per_micro_batch}" if not worst.engine
            else f"--rollout.max-slots {current}")
    lowest = "" if not worst.engine else f", even at --rollout.max-slots {n} (--rollout.n)"
    result.problems.append(f"{head}: {_short(worst, free, room, tokens)}{lowest}; "
                           + "; ".join(fix + ([f"or {helps}" if fix else helps] if helps else []) or ["use more GPUs"]))
    return result


def _budget_that_fits(cfg: RunConfig, shape: ModelShape, totals: dict[int, int], usable: dict[int, float],
                      slots: int, vllm: bool = False) -> int | None:
    """The largest --trainer.max-tokens-per-micro-batch (a multiple of 1,024 that holds one whole row) below the
    current one with which every GPU fits at `slots`; None where none does or the budget is not by tokens."""
    t = cfg.trainer
    row = cfg.rollout.max_prompt_length + cfg.rollout.max_new_tokens
    if not t.use_dynamic_bsz:
        return None
    for budget in range((t.max_tokens_per_micro_batch - 1) // 1024 * 1024, row - 1, -1024):
        trial = dataclasses.replace(cfg, trainer=dataclasses.replace(t, max_tokens_per_micro_batch=budget))
        if all(need.total <= usable[i] for i, need in device_needs(trial, shape, slots, totals, vllm=vllm).items()):
            return budget
    return None


def _vllm_problem(cfg: RunConfig, shape: ModelShape, need: DeviceNeed, free: int, room: float, tokens: int) -> str:
    """vLLM takes its fraction of the device's total memory: the fraction that leaves room for the rest, if that
    still holds the bf16 weights."""
    flag, share = "--rollout.vllm.gpu-memory-utilization", cfg.rollout.vllm.gpu_memory_utilization
    total = need.vllm / share
    fraction = int(100 * (room - (need.total - need.vllm)) / total) / 100
    fix = (f"{flag} {fraction:.2f} fits" if fraction * total > 2 * shape.params
           else "no fraction fits beside the rest (it must hold the bf16 weights); "
                + ", ".join(_helps(cfg, need) or ["use more GPUs"]))
    return f"{flag} {share:g}: {_short(need, free, room, tokens)}; {fix}"
