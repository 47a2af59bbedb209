"""The rollout-engine benchmark (`asyncrl bench engine`): output tokens/s of each backend on the same prompts, in
the same process.

    asyncrl bench engine                                  # GPU: Qwen2.5-0.5B shape, bf16, batch 64 and 256
    asyncrl bench engine --model smollm2 --device cpu --dtype float32 --batch-sizes 8 \
        --prompt-len 64 --new-tokens 64                   # CPU: SmolLM2-135M
    asyncrl bench engine --backends asyncrl vllm hf ...   # vLLM too, on the same prompts (its own process)
    asyncrl bench engine --model smollm2 --data gsm8k.parquet --n 8 --new-tokens 256 ...   # RL-like: real EOS

The embedded engine against `transformers` `generate` and/or vLLM (`--backends`). Every backend
gets the same prompts and sampling (temperature 1) and is timed after a warm-up run (CUDA graphs captured,
kernels loaded). Random prompts generate exactly `new_tokens` tokens per sequence (EOS ignored); a prompt
file (`--data`, `--n` samples per prompt) generates until EOS, so lengths vary and continuous batching
matters. Printed per batch size: each backend's output tok/s and mean sample length, our ratios to the
others, the time our engine and vLLM's `LLM.generate` take to prefill the prompts alone (a run with one new
token: `*_prefill_s`, and prompt tokens/s), our mean decode-step time without that prefill, the roofline and each
backend's fraction of it, the fraction our decode step alone reaches of its bandwidth bound, and the log-prob
mismatch between each engine and a training forward of the same tokens (mean |Δlogp|, and KL(engine‖train)
estimated on the sampled tokens).

The roofline is the least time the device's nominal limits allow for the whole workload: the prompts' prefill
at peak bf16 FLOP/s (`prefill_flops`) plus new_tokens − 1 decode steps, each reading every weight once and the
K/V of every row at the mean context (`step_bytes`) at full HBM bandwidth. vLLM's prefix cache is off by default
(`--vllm-prefix-caching`): its timed run repeats the warm-up's prompts, and a cache would skip their prefill.

`scripts/bench_engine.py` is a thin wrapper over this module.
"""

from __future__ import annotations

import bisect
import dataclasses
import gc
import json
import tempfile
import time
from typing import Literal

import torch

from asyncrl.config import ModelConfig, RolloutConfig, RunConfig, VLLMConfig
from asyncrl.data.files import load_prompt_file
from asyncrl.policies import Engine, EngineConfig, SamplingParams, load_model, load_tokenizer, save_pretrained
from asyncrl.policies.vllm_engine import build_vllm_engine, kv_cache_bytes, vllm_offline_generate
from asyncrl_bench.flops import body_params
from asyncrl_bench.mismatch import logprob_mismatch
from asyncrl_bench.roofline import peak_bandwidth, peak_flops
from asyncrl_bench.shared import (
    bench_dtype, device_name, hf_copy, in_own_process, indexed_device, synchronize, write_json,
)
from asyncrl_bench.tails import lognormal_budgets, quantile, tail_stats, time_finishes

__all__ = ["EngineBenchArgs", "bench_engine", "peak_bandwidth", "step_bytes", "prefill_flops", "logprob_mismatch"]

Backend = Literal["asyncrl", "vllm", "vllm-llm", "hf"]


@dataclasses.dataclass
class EngineBenchArgs:
    """Rollout backends side by side (asyncrl's engine, vLLM, transformers' generate): output tokens/s at each
    batch size, on random prompts with a forced length or on a prompt file with n samples and real EOS. The
    engine's knobs have a run's names and defaults (`RolloutConfig`, `EngineConfig`, `ModelConfig`)."""

    model: str = "random:qwen2.5-0.5b"
    """Model: an HF dir, a .gguf, 'smollm2', or 'random:<preset>'."""
    device: str = "cuda"
    dtype: str = ModelConfig.engine_dtype
    """Weights and activations of every backend (a run's --model.engine-dtype): auto = bfloat16 on CUDA,
    float32 on CPU; or a torch dtype name."""
    backends: tuple[Backend, ...] = ("asyncrl", "hf")
    """Which backends to time, each on the same prompts and sampling: our engine, vLLM behind our `RolloutEngine`
    adapter (what a run with --rollout.backend vllm gets), vLLM's own offline `LLM.generate` (engine core in its
    own process, scheduling overlapped with the GPU: no per-step control), transformers' generate. Each vLLM side
    runs in a process of its own."""
    batch_sizes: tuple[int, ...] = (64, 256)
    """Prompts per measurement (each sampled --n times)."""
    prompt_len: int = 128
    """Random prompts: tokens per prompt (ignored with --data)."""
    new_tokens: int = RolloutConfig.max_new_tokens
    """Random prompts: exactly this many tokens per sample (EOS ignored); with --data: at most this many (a run's
    --rollout.max-new-tokens)."""
    data: str | None = None
    """A prompt file (.jsonl / .parquet, verl's format; e.g. GSM8K from `asyncrl data convert-gsm8k`): its first
    prompts, rendered through the tokenizer's chat template, generated until EOS (lengths vary, as in RL)."""
    tokenizer: str | None = ModelConfig.tokenizer
    """Tokenizer for --data (default: the model's)."""
    n: int = 1
    """Samples per prompt (the GRPO group size). 1 by default, unlike a run's --rollout.n: a batch size is then
    the number of sequences decoded together."""
    seeded: bool = False
    """Give every sample its own seed, as training does (vLLM then samples with a per-request generator)."""
    cuda_graphs: bool = RolloutConfig.cuda_graphs
    """Our engine captures its decode step in CUDA graphs (`--rollout.cuda-graphs`)."""
    decode_attention: Literal["auto", "sdpa", "triton"] = RolloutConfig.decode_attention
    """Our engine's decode attention (`--rollout.decode-attention`)."""
    decode_ahead: bool = EngineConfig.decode_ahead
    """Our engine launches each decode step before reading the previous one's tokens (`EngineConfig.decode_ahead`)."""
    vllm_prefix_caching: bool = False
    """Let vLLM's prefix cache serve the timed run the prompts the warm-up run already prefilled (our engine keeps
    no K/V between requests, so with it on vLLM skips work that ours does). Off by default, unlike a run's
    --rollout.vllm.enable-prefix-caching, so that both engines prefill the same prompts."""
    kv_dtype: Literal["auto", "fp8"] = "auto"
    """Our engine's and vLLM's K/V cache: the model's dtype, or float8 e4m3 (`--rollout.kv-dtype`)."""
    kv_layout: Literal["slot", "shared-prompt", "both"] = "slot"
    """Our engine's K/V layout (`--rollout.kv-layout`); "both" times the per-slot layout (the `ours_*` fields) and the
    shared-prompt one (`shared_prompt_*`, with `shared_prompt_ratio` over the per-slot tok/s) on the same prompts."""
    system_prompt_len: int = 0
    """Random prompts: the first this many tokens the same in every prompt (a system prompt, tool descriptions); the
    shared-prompt layout then reads them from one prompt slot (`--rollout.share-prefix` this long)."""
    lengths: Literal["fixed", "lognormal"] = "fixed"
    """Random prompts: every sample generates --new-tokens ("fixed"), or each request its own budget, drawn from a
    log-normal with median --new-tokens / --tail-ratio and 99th percentile --new-tokens ("lognormal": the heavy
    tail of RL response lengths, so a batch ends with a few long rows). Lognormal rows report each backend's tail
    (`*_tail_s`: the time after 90 % of the samples had finished) and idle fraction (`*_idle_fraction`: the
    batch's slot-time left empty by finished samples, what a synchronous trainer waits through)."""
    tail_ratio: float = 10.0
    """With --lengths lognormal: the 99th percentile of the budgets over their median."""
    seed: int = RunConfig.seed
    out: str | None = None
    """Write the results as JSON here."""

    def validate(self) -> None:
        if not self.backends or len(set(self.backends)) != len(self.backends):
            raise ValueError(f"--backends {' '.join(self.backends)}: name each of asyncrl, vllm, vllm-llm, hf at "
                             "most once")
        if self.n < 1 or min(self.batch_sizes, default=0) < 1:
            raise ValueError("--n and every --batch-sizes value must be >= 1")
        if self.system_prompt_len and not (0 < self.system_prompt_len < self.prompt_len and self.data is None):
            raise ValueError(f"--system-prompt-len {self.system_prompt_len}: the shared beginning of random prompts "
                             f"must lie in [1, --prompt-len {self.prompt_len}), without --data")
        if self.lengths == "lognormal":
            if self.data is not None:
                raise ValueError("--lengths lognormal draws budgets for random prompts; --data samples stop at their "
                                 "EOS: leave one of them out")
            if {"hf", "vllm-llm"} & set(self.backends):
                raise ValueError("--lengths lognormal gives each request its own budget, which only the asyncrl and "
                                 "vllm backends take: use --backends asyncrl vllm")
            if not self.tail_ratio >= 1.0:
                raise ValueError(f"--tail-ratio {self.tail_ratio}: the 99th percentile over the median must be >= 1")
        self.torch_dtype()

    def torch_dtype(self) -> torch.dtype:
        """--dtype as a torch dtype (`bench_dtype`)."""
        return bench_dtype(self.dtype, self.device)


def step_bytes(model, batch: int, attend_len: int, kv_elem: int | None = None) -> float:
    """Bytes a decode step must move at least: every weight once (the embedding only for B rows) + KV (`kv_elem`
    bytes an element: the model's dtype's unless given; 1 for a float8 cache)."""
    cfg = model.config
    elem = torch.finfo(model.dtype).bits // 8
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * elem
    if cfg.tie_word_embeddings:
        weights += cfg.vocab_size * cfg.hidden_size * elem
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (kv_elem or elem)
    return weights + batch * attend_len * kv_per_token


def prefill_flops(model, prompt_lens: list[int]) -> float:
    """Model FLOPs of prefilling prompts of these lengths (forward only, 2 per multiply-add): 2 · N_body per
    token, causal attention 2 · layers · (heads · head_dim) · s² per prompt of s tokens (QKᵀ and AV over the
    half of the scores a causal mask keeps), and the LM head once per prompt (its last position's logits)."""
    cfg = model.config
    n_body, width = body_params(model), cfg.num_heads * cfg.head_dim
    return float(sum(2 * n_body * s + 2 * cfg.num_layers * width * s * s + 2 * cfg.vocab_size * cfg.hidden_size
                     for s in prompt_lens))


@dataclasses.dataclass(frozen=True)
class Workload:
    """The prompts and sampling of one measurement, the same for every backend."""

    prompts: list[list[int]]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    budgets: tuple[int, ...] | None = None  # --lengths lognormal: each prompt's max_new_tokens

    @property
    def sequences(self) -> int:
        return len(self.prompts) * self.params.n

    def request_params(self) -> SamplingParams | list[SamplingParams]:
        """The sampling of each prompt (its own budget under --lengths lognormal)."""
        if self.budgets is None:
            return self.params
        return [dataclasses.replace(self.params, max_new_tokens=b) for b in self.budgets]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def prefill_only(self) -> "Workload":
        """The same prompts with one new token each: the time of this run is the prompts' prefill."""
        return dataclasses.replace(self, params=dataclasses.replace(self.params, max_new_tokens=1), budgets=None)


def _workloads(args: EngineBenchArgs, model) -> list[Workload]:
    ignore_eos = args.data is None
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=ignore_eos,
                            seed=args.seed if args.seeded else None)
    if args.data is None:
        gen = torch.Generator().manual_seed(args.seed)
        system = torch.randint(0, model.config.vocab_size, (args.system_prompt_len,), generator=gen).tolist()
        return [Workload([system + p[args.system_prompt_len:] for p in torch.randint(
            0, model.config.vocab_size, (b, args.prompt_len), generator=gen).tolist()], params, (), _budgets(args, b))
            for b in args.batch_sizes]
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    prompts, _ = load_prompt_file(args.data, tokenizer, max_prompt_length=1024)
    if len(prompts) < max(args.batch_sizes):
        raise ValueError(f"--data {args.data}: {len(prompts)} prompts, fewer than --batch-sizes "
                         f"{max(args.batch_sizes)}")
    eos = tuple(model.config.eos_token_ids)
    return [Workload([p.prompt_ids for p in prompts[:b]], params, eos) for b in args.batch_sizes]


def _budgets(args: EngineBenchArgs, batch: int) -> tuple[int, ...] | None:
    if args.lengths == "fixed":
        return None
    return tuple(lognormal_budgets(batch, maximum=args.new_tokens, tail_ratio=args.tail_ratio, seed=args.seed))


def _tails(name: str, engine, work: Workload, device: str) -> dict:
    """`name`'s tail on `work` (--lengths lognormal): one more run through `add_request` / `step`, timing each
    sample's finish (`asyncrl_bench.tails`)."""
    _, finishes, total = time_finishes(engine, work.prompts, work.request_params(), lambda: synchronize(device))
    return {f"{name}_{k}": v for k, v in tail_stats(finishes, total).items()}


def _generated(outs) -> tuple[int, int]:
    """(tokens generated, sequences) over the outputs of `generate`."""
    return sum(len(c.token_ids) for o in outs for c in o.completions), sum(len(o.completions) for o in outs)


def _time_engine(engine, work: Workload, device: str):
    """(outputs, seconds, decode steps or None) of a run after a warm-up run (graphs captured, kernels loaded).
    Any `RolloutEngine`; the decode steps are the embedded engine's (it counts them)."""
    engine.generate(work.prompts, work.request_params())
    stats = getattr(engine, "stats", None)
    if stats is not None:
        stats.clear()
    synchronize(device)
    start = time.perf_counter()
    outs = engine.generate(work.prompts, work.request_params())
    synchronize(device)
    return outs, time.perf_counter() - start, None if stats is None else stats["decode_steps"]


def _time_prefill(engine, work: Workload, device: str) -> float:
    """Seconds of a run of `work`'s prompts with one new token each (their prefill), on an engine that has just
    run them (its kernels and shapes warm)."""
    prefill = work.prefill_only()
    synchronize(device)
    start = time.perf_counter()
    engine.generate(prefill.prompts, prefill.params)
    synchronize(device)
    return time.perf_counter() - start


def _time_hf_generate(model, work: Workload, device: str) -> tuple[float, float]:
    """transformers' generate on the same prompts (left-padded, `n` return sequences): (tok/s, mean length);
    a sample's tokens are those up to and including its first EOS."""
    hf = hf_copy(model, model.dtype, device).eval()
    width = max(map(len, work.prompts))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in work.prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work.prompts], device=device)
    new = work.params.max_new_tokens
    forced = dict(min_new_tokens=new) if work.params.ignore_eos else dict(eos_token_id=list(work.eos_token_ids))
    kwargs = dict(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad,
                  num_return_sequences=work.params.n, **forced)
    with torch.inference_mode():
        hf.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=8, do_sample=True,
                    pad_token_id=pad)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, **kwargs)[:, width:]
        synchronize(device)
    seconds = time.perf_counter() - start
    del hf
    if work.params.ignore_eos:
        lengths = [out.shape[1]] * out.shape[0]
    else:
        is_eos = torch.isin(out, torch.tensor(work.eos_token_ids, device=out.device))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, out.shape[1])
        lengths = first.tolist()
    return sum(lengths) / seconds, sum(lengths) / len(lengths)


def _vllm_worker(args: EngineBenchArgs, works: list[Workload]) -> list[tuple[list, float, dict]]:
    """vLLM behind our adapter, one engine for every workload: (outputs, output tok/s, tail fields) of each, timed
    like ours (after a warm-up run)."""
    model = _load(args)
    engine = build_vllm_engine(model, _engine_config(args, *works), agent="bench", options=_vllm_options(args))
    del model
    out = []
    for work in works:
        outs, seconds, _ = _time_engine(engine, work, args.device)
        tails = _tails("vllm", engine, work, args.device) if work.budgets is not None else {}
        out.append((outs, _generated(outs)[0] / seconds, tails))
    return out


def _vllm_options(args: EngineBenchArgs) -> VLLMConfig:
    return VLLMConfig(enable_prefix_caching=args.vllm_prefix_caching)


def _vllm_llm_worker(args: EngineBenchArgs, works: list[Workload], model_dir: str,
                     kv_bytes: int | None) -> list[tuple[float, float, float]]:
    """vLLM's own `LLM.generate` over the model saved in `model_dir`, one `LLM` for every workload: (output tok/s,
    mean sample length, seconds of the prompts' prefill alone) of each, from the runs after the warm-up."""
    batches = [(w.prompts, w.params) for w in works] + [(w.prompts, w.prefill_only().params) for w in works]
    runs = vllm_offline_generate(model_dir, batches, dtype=args.torch_dtype(), device=indexed_device(args.device),
                                 max_len=_engine_config(args, *works).max_len, kv_bytes=kv_bytes,
                                 eos_token_ids=works[0].eos_token_ids, options=_vllm_options(args),
                                 kv_dtype=args.kv_dtype)
    timed = [run[-1] for run in runs]  # (tokens, seconds) of each batch's run after its warm-up
    return [(tokens / seconds, tokens / work.sequences, prefill_s)
            for work, (tokens, seconds), (_, prefill_s) in zip(works, timed, timed[len(works):])]


def _vllm_llm_rows(args: EngineBenchArgs, model, works: list[Workload]) -> list[tuple[float, float, float]]:
    """`_vllm_llm_worker` in a process of its own, over a copy of `model` saved once (the child loads no model
    of its own, so the GPU holds one copy of the weights besides vLLM's)."""
    config = _engine_config(args, *works)
    kv_bytes = None if args.device.startswith("cuda") else kv_cache_bytes(model, config.max_slots, config.max_len)
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-vllm-") as directory:
        save_pretrained(model, directory)
        return in_own_process(_vllm_llm_worker, args, works, directory, kv_bytes)


def _load(args: EngineBenchArgs):
    return load_model(args.model, dtype=args.torch_dtype(), device=args.device, seed=args.seed)


def _engine_config(args: EngineBenchArgs, *works: Workload, layout: str = "slot") -> EngineConfig:
    """Our engine's configuration for these workloads (slots and length of the largest), in K/V `layout` (shared
    prompts: a prompt slot per prompt of the largest workload)."""
    longest = max(max(map(len, w.prompts)) for w in works)
    shared = dict(kv_layout="shared-prompt", max_prompt_len=longest, max_prompts=max(len(w.prompts) for w in works),
                  share_prefix=args.system_prompt_len) if layout == "shared-prompt" else {}
    return EngineConfig(max_slots=max(w.sequences for w in works), max_len=longest + args.new_tokens,
                        cuda_graphs=args.cuda_graphs, decode_attention=args.decode_attention,
                        decode_ahead=args.decode_ahead, kv_dtype=args.kv_dtype, **shared)


_RATIOS = {"ratio": "hf_tok_s", "ratio_vs_vllm": "vllm_tok_s", "ratio_vs_vllm_llm": "vllm_llm_tok_s"}


def _roofline(args: EngineBenchArgs, model, work: Workload, device: str) -> dict:
    """The least time the device's nominal limits allow for `work` (module docstring): `roofline_s`, and the output
    tok/s it bounds (`roofline_tok_s`); `decode_roofline_tok_s` is a decode step's bound alone. Null where
    unknown: on CPU or an unknown GPU, and with --data (lengths vary)."""
    bandwidth, flops = peak_bandwidth(device), peak_flops(device)
    row = {"peak_bandwidth": bandwidth, "peak_flops": flops, "step_bytes": None, "shared_step_bytes": None,
           "prefill_flops": None,
           "roofline_s": None, "roofline_tok_s": None, "decode_roofline_tok_s": None}
    if not bandwidth or not flops or args.data is not None:
        return row
    kv_elem = 1 if args.kv_dtype == "fp8" else None
    nbytes = step_bytes(model, work.sequences, int(args.prompt_len + args.new_tokens / 2), kv_elem)
    # shared prompts: each prompt's K/V read once a step, each sample's responses (at their mean length) once
    weights = step_bytes(model, 0, 0, kv_elem)
    # (a system prompt: once, and each prompt's rest once)
    own_prompt = len(work.prompts) * (args.prompt_len - args.system_prompt_len) + args.system_prompt_len
    shared = weights + (step_bytes(model, own_prompt, 1, kv_elem) - weights) + (
        step_bytes(model, work.sequences, int(args.new_tokens / 2), kv_elem) - weights)
    prefill = prefill_flops(model, [len(p) for p in work.prompts])
    seconds = prefill / flops + (args.new_tokens - 1) * nbytes / bandwidth  # the first token: the prefill's
    tokens, decode_roofline = work.sequences * args.new_tokens, work.sequences * bandwidth / nbytes
    if work.budgets is not None:  # step s runs the samples whose budget exceeds s, at context prompt + s
        lengths = sorted(b for b in work.budgets for _ in range(work.params.n))
        alive = [len(lengths) - bisect.bisect_right(lengths, s) for s in range(1, lengths[-1])]
        moved = sum(step_bytes(model, rows, args.prompt_len + s, kv_elem) for s, rows in enumerate(alive, 1))
        seconds, tokens = prefill / flops + moved / bandwidth, sum(lengths)
        nbytes = moved / max(len(alive), 1)  # the mean decode step's: what its bandwidth fraction is read against
    return {**row, "step_bytes": nbytes, "shared_step_bytes": shared, "prefill_flops": prefill, "roofline_s": seconds,
            "roofline_tok_s": tokens / seconds, "decode_roofline_tok_s": decode_roofline}


def _roofline_fractions(row: dict) -> None:
    """Each backend's tok/s over the roofline (its prefill, decode and host work: an end-to-end fraction), and
    its prompt tokens/s in the run that prefilled them alone."""
    for name in ("ours", "vllm", "vllm_llm", "hf"):
        if row.get("roofline_tok_s") and f"{name}_tok_s" in row:
            row[f"{name}_roofline_fraction"] = row[f"{name}_tok_s"] / row["roofline_tok_s"]
        if f"{name}_prefill_s" in row:
            row[f"{name}_prefill_tok_s"] = row["prompt_tokens"] / row[f"{name}_prefill_s"]


def _ratios(row: dict) -> None:
    """Our tok/s over each other backend's that was timed."""
    for name, other in _RATIOS.items():
        if "ours_tok_s" in row and other in row:
            row[name] = row["ours_tok_s"] / row[other]


def bench_engine(args: EngineBenchArgs) -> list[dict]:
    """Run the engine benchmark; print one JSON row per batch size and return the rows. In-process backends
    run row by row (each prints a progress line); each vLLM backend runs once, in its own process, for all rows."""
    args.validate()
    model = _load(args)
    works = _workloads(args, model)
    results = [_in_process_row(args, model, batch, work) for batch, work in zip(args.batch_sizes, works)]
    if "vllm" in args.backends:
        for row, (vllm_outs, tok_s, tails) in zip(results, in_own_process(_vllm_worker, args, works)):
            row["vllm_tok_s"], row["vllm_mean_len"] = tok_s, _generated(vllm_outs)[0] / row["sequences"]
            row.update(tails)
            vllm_mismatch = logprob_mismatch(model, vllm_outs)
            row.update({f"vllm_{k}": vllm_mismatch[k] for k in ("mean_abs_dlogp", "max_abs_dlogp", "max_abs_logit")})
    if "vllm-llm" in args.backends:
        for row, (tok_s, mean_len, prefill_s) in zip(results, _vllm_llm_rows(args, model, works)):
            row["vllm_llm_tok_s"], row["vllm_llm_mean_len"], row["vllm_llm_prefill_s"] = tok_s, mean_len, prefill_s
    for row in results:
        _ratios(row)
        _roofline_fractions(row)
        print(json.dumps(row), flush=True)
    write_json(args.out, results)
    return results


def _dtype_name(args: EngineBenchArgs) -> str:
    return str(args.torch_dtype()).removeprefix("torch.")


def _in_process_row(args: EngineBenchArgs, model, batch: int, work: Workload) -> dict:
    """One row's workload, roofline, and the backends that run in this process (ours, transformers')."""
    row = {"device": device_name(args.device), "model": args.model, "dtype": _dtype_name(args),
           "kv_dtype": args.kv_dtype, "batch": batch,
           "n": args.n, "sequences": work.sequences, "workload": args.data or f"random {args.prompt_len}-token prompts",
           "prompt_len": max(map(len, work.prompts)), "prompt_tokens": work.prompt_tokens,
           "new_tokens": args.new_tokens, **_budget_fields(work), **_roofline(args, model, work, args.device)}
    layouts = ("slot", "shared-prompt") if args.kv_layout == "both" else (args.kv_layout,)
    if "asyncrl" in args.backends:
        for layout in layouts:
            shared = layout == "shared-prompt"
            fields = _ours(args, model, work, row["shared_step_bytes" if shared else "step_bytes"],
                           row["peak_bandwidth"], layout)
            if shared and len(layouts) > 1:
                fields = {f"shared_prompt_{k.removeprefix('ours_')}": v for k, v in fields.items()}
                fields["shared_prompt_ratio"] = fields["shared_prompt_tok_s"] / row["ours_tok_s"]
            row.update(fields)
            print(f"asyncrl {layout}, batch {batch}: " + ", ".join(f"{k} {v:.4g}" for k, v in fields.items()
                                                                   if k.endswith(("tok_s", "_ms", "kv_gb"))), flush=True)
            gc.collect()  # the engine's KV cache and graph pool, before the next run or a vLLM child allocates
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    if "hf" in args.backends:
        row["hf_tok_s"], row["hf_mean_len"] = _time_hf_generate(model, work, args.device)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def _budget_fields(work: Workload) -> dict:
    """--lengths lognormal: the budgets' median, 99th percentile and mean."""
    if work.budgets is None:
        return {}
    ordered = sorted(work.budgets)
    return {"budget_p50": quantile(ordered, 0.5), "budget_p99": quantile(ordered, 0.99),
            "budget_mean": sum(ordered) / len(ordered)}


def _ours(args: EngineBenchArgs, model, work: Workload, nbytes: float | None, bandwidth: float | None,
          layout: str = "slot") -> dict:
    """Our engine on `work` in K/V `layout`: tok/s, the prompts' prefill alone, the mean decode step without it (the
    run's time less that prefill, over its decode steps) and, where the roofline is known, the fraction of a decode
    step's bandwidth bound it reaches; the K/V cache's size; the behaviour log-probs' mismatch with a training
    forward."""
    engine = Engine(model, _engine_config(args, work, layout=layout))
    outs, seconds, steps = _time_engine(engine, work, args.device)
    prefill_s = _time_prefill(engine, work, args.device)
    if engine.fused:
        print("compiled pieces:", engine.fused, flush=True)
    step_s = max(seconds - prefill_s, 0.0) / steps if steps else None
    fields = {"ours_tok_s": _generated(outs)[0] / seconds, "ours_mean_len": _generated(outs)[0] / work.sequences,
              "ours_prefill_s": prefill_s, "decode_steps": steps, "decode_step_ms": step_s and step_s * 1e3,
              "ours_kv_gb": engine.cache.nbytes / 1e9, "kv_layout": layout,
              "shared_prefix_tokens": engine.stats["shared_prefix_tokens"],
              "decode_attention": engine.decode_kernel, "sampler": engine.sampler, **logprob_mismatch(model, outs)}
    if nbytes and bandwidth and step_s:
        fields["bandwidth_fraction"] = nbytes / bandwidth / step_s
    if work.budgets is not None:
        fields.update(_tails("ours", engine, work, args.device))
    return fields
