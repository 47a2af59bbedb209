"""Benchmarks that compare our pieces with Hugging Face in the same process (`asyncrl bench ...`).

    asyncrl bench engine                                  # GPU: Qwen2.5-0.5B shape, bf16, batch 64 and 256
    asyncrl bench engine --model smollm2 --device cpu --dtype float32 --batch-sizes 8 \
        --prompt-len 64 --new-tokens 64                   # CPU: SmolLM2-135M
    asyncrl bench engine --backends asyncrl vllm hf ...   # vLLM too, on the same prompts (its own process)
    asyncrl bench engine --model smollm2 --data gsm8k.parquet --n 8 --new-tokens 256 ...   # RL-like: real EOS
    asyncrl bench learner                                 # GPU: Qwen2.5-0.5B shape, 16 × 320 tokens
    asyncrl bench learner --workload ragged --rows 64     # GPU: RL-like lengths (prompts 64-512, responses 32-2048)
    asyncrl bench learner --workload ragged --rows 64 --no-pack-sequences --checkpoint-scope mlp   # our variants

`engine`: the embedded engine against `transformers` `generate` and/or vLLM (`--backends`). Every backend
gets the same prompts and sampling (temperature 1) and is timed after a warm-up run (CUDA graphs captured,
kernels loaded). Random prompts generate exactly `new_tokens` tokens per sequence (EOS ignored); a prompt
file (`--data`, `--n` samples per prompt) generates until EOS, so lengths vary and continuous batching
matters. Printed per batch size: each backend's output tok/s and mean sample length, our ratios to the
others, our mean decode-step time, the fraction of the memory-bandwidth ceiling that step reaches (weights
+ KV read once per step), and the log-prob mismatch between each engine and a training forward of the
same tokens (mean |Δlogp|, and KL(engine‖train) estimated on the sampled tokens).

`learner`: a GRPO `train_step` against a plain HF training step, on the same rows. Both sides: fp32 master
weights, bf16 autocast on CUDA, gradient checkpointing (ours: `--checkpoint-scope layer|mlp`; HF's: whole
layers), gradient clipping at 1.0, AdamW (fused on CUDA with `--fused-optimizer`), one optimizer step over
`rows` sequences. Workloads: `fixed`, every row `prompt_len + response_len` tokens; `ragged`, per group a
prompt length uniform in [`prompt_len_min`, `prompt_len_max`] and per response a length uniform in
[`response_len_min`, `response_len_max`], as RL batches are. Every step's rows are drawn (seeded per step)
before the clock starts. Ours is the full `train_step` (collate, group advantages, PPO clip loss over response
tokens, token-budget micro-batches packed into one sequence each, or padded with `--no-pack-sequences`;
`--compile-layers`); HF's sorts the rows by length, cuts them into micro-batches by our padded budget rule
(rows × longest row <= `max_tokens_per_micro_batch`, a longer row alone), right-pads them with an attention
mask, labels the response tokens (-100 on prompt and padding) and runs `model(...).loss` + backward per
micro-batch, then the step. Throughput counts real tokens only (prompt + response of every row, no padding),
the same count for both sides. MFU = model FLOPs / time / the GPU's peak dense bf16 FLOP/s (H100, H200: 989
TFLOP/s; A100: 312; null on CPU or an unknown GPU), with `train_flops`: 6·N_body per token (decoder layers
and final norm) + 6·V·H per response token (LM head) + 6·L·(heads·head_dim)·s² per row of s tokens (causal
attention). Both sides are credited the same useful FLOPs (padding and recomputation do not count), so
ours_mfu / hf_mfu = ours_tok_s / hf_tok_s = ratio. Prints one JSON row: workload, mean tokens and response
tokens per step, each side's tok/s, MFU and peak memory (CUDA), the ratio.

`scripts/bench_engine.py` and `scripts/bench_learner.py` are thin wrappers over this module.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import tempfile
import time
from typing import TYPE_CHECKING, Literal

import torch

from asyncrl.bench_async import AsyncBenchArgs, bench_async
from asyncrl.config import LoraConfig

if TYPE_CHECKING:
    from asyncrl.policies import SamplingParams

__all__ = ["EngineBenchArgs", "LearnerBenchArgs", "bench_engine", "bench_learner", "bench_main",
           "peak_bandwidth", "step_bytes", "logprob_mismatch", "groups_for", "row_lengths", "body_params",
           "train_flops", "peak_flops"]

PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # bytes/s, SXM parts


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def _hf_copy(model, dtype: torch.dtype, device: str):
    """The same weights as a `transformers` model (saved and re-opened through a temporary directory)."""
    import transformers

    from asyncrl.policies import save_pretrained
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).to(device)


# ------------------------------------------------------------------------------------------- engine
Backend = Literal["asyncrl", "vllm", "vllm-llm", "hf"]


@dataclasses.dataclass
class EngineBenchArgs:
    """Rollout backends side by side (asyncrl's engine, vLLM, transformers' generate): output tokens/s at each
    batch size, on random prompts with a forced length or on a prompt file with n samples and real EOS."""

    model: str = "random:qwen2.5-0.5b"
    """Model: an HF dir, a .gguf, 'smollm2', or 'random:<preset>'."""
    device: str = "cuda"
    dtype: str = "bfloat16"
    backends: tuple[Backend, ...] = ("asyncrl", "hf")
    """Which backends to time, each on the same prompts and sampling: our engine, vLLM behind our `RolloutEngine`
    adapter (what a run with --rollout.backend vllm gets), vLLM's own offline `LLM.generate` (engine core in its
    own process, scheduling overlapped with the GPU: no per-step control), transformers' generate. Each vLLM side
    runs in a process of its own."""
    batch_sizes: tuple[int, ...] = (64, 256)
    """Prompts per measurement (each sampled --n times)."""
    prompt_len: int = 128
    """Random prompts: tokens per prompt (ignored with --data)."""
    new_tokens: int = 512
    """Random prompts: exactly this many tokens per sample (EOS ignored); with --data: at most this many."""
    data: str | None = None
    """A prompt file (.jsonl / .parquet, verl's format; e.g. GSM8K from `asyncrl data convert-gsm8k`): its first
    prompts, rendered through the tokenizer's chat template, generated until EOS (lengths vary, as in RL)."""
    tokenizer: str | None = None
    """Tokenizer for --data (default: the model's)."""
    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    seeded: bool = False
    """Give every sample its own seed, as training does (vLLM then samples with a per-request generator)."""
    cuda_graphs: bool = True
    seed: int = 0
    out: str | None = None
    """Write the results as JSON here."""

    def validate(self) -> None:
        if not self.backends or len(set(self.backends)) != len(self.backends):
            raise ValueError(f"--backends {' '.join(self.backends)}: name each of asyncrl, vllm, vllm-llm, hf at "
                             "most once")
        if self.n < 1 or min(self.batch_sizes, default=0) < 1:
            raise ValueError("--n and every --batch-sizes value must be >= 1")


def peak_bandwidth() -> float | None:
    """Nominal HBM bandwidth of the current GPU (bytes/s), when it is one we know."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def step_bytes(model, batch: int, attend_len: int) -> float:
    """Bytes a decode step must move at least: every weight once (the embedding only for B rows) + KV."""
    cfg = model.config
    elem = torch.finfo(model.dtype).bits // 8
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * elem
    if cfg.tie_word_embeddings:
        weights += cfg.vocab_size * cfg.hidden_size * elem
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    return weights + batch * attend_len * kv_per_token


@dataclasses.dataclass(frozen=True)
class Workload:
    """The prompts and sampling of one measurement, the same for every backend."""

    prompts: list[list[int]]
    params: "SamplingParams"
    eos_token_ids: tuple[int, ...]

    @property
    def sequences(self) -> int:
        return len(self.prompts) * self.params.n


def _workloads(args: EngineBenchArgs, model) -> list[Workload]:
    from asyncrl.policies import SamplingParams
    ignore_eos = args.data is None
    params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=ignore_eos,
                            seed=args.seed if args.seeded else None)
    if args.data is None:
        gen = torch.Generator().manual_seed(args.seed)
        return [Workload(torch.randint(0, model.config.vocab_size, (b, args.prompt_len), generator=gen).tolist(),
                         params, ()) for b in args.batch_sizes]
    from asyncrl.data.files import load_prompt_file
    from asyncrl.policies import load_tokenizer
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    prompts, _ = load_prompt_file(args.data, tokenizer, max_prompt_length=1024)
    if len(prompts) < max(args.batch_sizes):
        raise ValueError(f"--data {args.data}: {len(prompts)} prompts, fewer than --batch-sizes "
                         f"{max(args.batch_sizes)}")
    eos = tuple(model.config.eos_token_ids)
    return [Workload([p.prompt_ids for p in prompts[:b]], params, eos) for b in args.batch_sizes]


def _generated(outs) -> tuple[int, int]:
    """(tokens generated, sequences) over the outputs of `generate`."""
    return sum(len(c.token_ids) for o in outs for c in o.completions), sum(len(o.completions) for o in outs)


def _time_engine(engine, work: Workload, device: str):
    """(outputs, output tok/s, seconds per decode step or None), after a warm-up run (graphs captured,
    kernels loaded). Any `RolloutEngine`; the decode-step time is the embedded engine's (it counts them)."""
    engine.generate(work.prompts, work.params)
    stats = getattr(engine, "stats", None)
    if stats is not None:
        stats.clear()
    _sync(device)
    start = time.perf_counter()
    outs = engine.generate(work.prompts, work.params)
    _sync(device)
    seconds = time.perf_counter() - start
    return outs, _generated(outs)[0] / seconds, None if stats is None else seconds / max(stats["decode_steps"], 1)


def _time_hf_generate(model, work: Workload, device: str) -> tuple[float, float]:
    """transformers' generate on the same prompts (left-padded, `n` return sequences): (tok/s, mean length);
    a sample's tokens are those up to and including its first EOS."""
    hf = _hf_copy(model, model.dtype, device).eval()
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
        _sync(device)
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, **kwargs)[:, width:]
        _sync(device)
    seconds = time.perf_counter() - start
    del hf
    if work.params.ignore_eos:
        lengths = [out.shape[1]] * out.shape[0]
    else:
        is_eos = torch.isin(out, torch.tensor(work.eos_token_ids, device=out.device))
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, out.shape[1])
        lengths = first.tolist()
    return sum(lengths) / seconds, sum(lengths) / len(lengths)


def _in_own_process(function, *args):
    """function(*args) in a fresh process: vLLM changes process-wide torch settings and starts children."""
    import concurrent.futures
    import multiprocessing as mp
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def _vllm_worker(args: EngineBenchArgs, work: Workload) -> tuple[list, float]:
    """vLLM behind our adapter: outputs and output tok/s, timed like ours (after a warm-up run)."""
    from asyncrl.policies.vllm_engine import build_vllm_engine
    model = _load(args)
    engine = build_vllm_engine(model, _engine_config(args, work), agent="bench")
    del model
    outs, tok_s, _ = _time_engine(engine, work, args.device)
    return outs, tok_s


def _vllm_llm_worker(args: EngineBenchArgs, work: Workload) -> tuple[float, float]:
    """vLLM's own `LLM.generate`: (output tok/s, mean sample length) of the run after the warm-up."""
    from asyncrl.policies.vllm_engine import vllm_offline_generate
    model = _load(args)
    config = _engine_config(args, work)
    tokens, seconds = vllm_offline_generate(model, work.prompts, work.params, max_len=config.max_len,
                                            eos_token_ids=work.eos_token_ids)[-1]
    return tokens / seconds, tokens / work.sequences


def _load(args: EngineBenchArgs):
    from asyncrl.policies import load_model
    return load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device, seed=args.seed)


def _engine_config(args: EngineBenchArgs, work: Workload):
    from asyncrl.policies import EngineConfig
    return EngineConfig(max_slots=work.sequences, max_len=max(map(len, work.prompts)) + args.new_tokens,
                        cuda_graphs=args.cuda_graphs)


@torch.inference_mode()
def logprob_mismatch(model, outs, max_rows: int = 32) -> dict[str, float]:
    """Engine behaviour log-probs vs a training forward of the same tokens (the first `max_rows` samples): the
    mean and the largest |difference| per token, the largest |logit| they come from (the scale a tolerance
    for rounding differences is relative to; tests/tolerances.py) and a k1 estimate of the KL."""
    from asyncrl.policies import token_logprobs
    diffs, kls, worst, scale = [], [], 0.0, 0.0
    samples = [(out.prompt_ids, c) for out in outs for c in out.completions if c.token_ids][:max_rows]
    for prompt_ids, c in samples:
        seq = torch.tensor([prompt_ids + c.token_ids], device=model.device)
        logits = model.logits(model(seq))[0, len(prompt_ids) - 1:-1]
        train = token_logprobs(logits, seq[0, len(prompt_ids):])
        engine = torch.tensor(c.logprobs, device=model.device)
        diffs.append((engine - train).abs().mean().item())
        kls.append((engine - train).mean().item())  # k1 estimate of KL(engine ‖ train) on engine samples
        worst, scale = max(worst, (engine - train).abs().max().item()), max(scale, logits.abs().max().item())
    return {"mean_abs_dlogp": sum(diffs) / len(diffs), "max_abs_dlogp": worst, "max_abs_logit": scale,
            "kl_engine_train": sum(kls) / len(kls)}


_RATIOS = {"ratio": "hf_tok_s", "ratio_vs_vllm": "vllm_tok_s", "ratio_vs_vllm_llm": "vllm_llm_tok_s"}


def _ratios(row: dict) -> None:
    """Our tok/s over each other backend's that was timed."""
    for name, other in _RATIOS.items():
        if "ours_tok_s" in row and other in row:
            row[name] = row["ours_tok_s"] / row[other]


def bench_engine(args: EngineBenchArgs) -> list[dict]:
    """Run the engine benchmark; print one JSON row per batch size and return the rows."""
    from asyncrl.policies import Engine
    args.validate()
    model = _load(args)
    results, bandwidth = [], peak_bandwidth()
    for batch, work in zip(args.batch_sizes, _workloads(args, model)):
        row = {"device": _device_name(args.device), "model": args.model, "dtype": args.dtype, "batch": batch,
               "n": args.n, "workload": args.data or f"random {args.prompt_len}-token prompts",
               "prompt_len": max(map(len, work.prompts)), "new_tokens": args.new_tokens}
        if "asyncrl" in args.backends:
            engine = Engine(model, _engine_config(args, work))
            outs, row["ours_tok_s"], step_s = _time_engine(engine, work, args.device)
            if engine.fused:
                print("compiled pieces:", engine.fused, flush=True)
            row.update(ours_mean_len=_generated(outs)[0] / work.sequences, decode_step_ms=step_s * 1e3,
                       **logprob_mismatch(model, outs))
            if bandwidth and args.device.startswith("cuda") and args.data is None:
                mean_attend = args.prompt_len + args.new_tokens / 2
                row["bandwidth_fraction"] = step_bytes(model, work.sequences, int(mean_attend)) / bandwidth / step_s
            del engine, outs
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if "hf" in args.backends:
            row["hf_tok_s"], row["hf_mean_len"] = _time_hf_generate(model, work, args.device)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        if "vllm" in args.backends:
            vllm_outs, row["vllm_tok_s"] = _in_own_process(_vllm_worker, args, work)
            row["vllm_mean_len"] = _generated(vllm_outs)[0] / work.sequences
            vllm_mismatch = logprob_mismatch(model, vllm_outs)
            row.update({f"vllm_{k}": vllm_mismatch[k] for k in ("mean_abs_dlogp", "max_abs_dlogp", "max_abs_logit")})
        if "vllm-llm" in args.backends:
            row["vllm_llm_tok_s"], row["vllm_llm_mean_len"] = _in_own_process(_vllm_llm_worker, args, work)
        _ratios(row)
        results.append(row)
        print(json.dumps(row), flush=True)
    _write(args.out, results)
    return results


# ------------------------------------------------------------------------------------------ learner
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s, SXM parts

LearnerWorkload = Literal["fixed", "ragged"]


@dataclasses.dataclass
class LearnerBenchArgs:
    """Learner train_step vs a plain `transformers` training step: trained tokens/s and MFU."""

    model: str = "random:qwen2.5-0.5b"
    """Model: an HF dir, a .gguf, 'smollm2', or 'random:<preset>'."""
    device: str = "cuda"
    rows: int = 16
    """Sequences per optimizer step (a multiple of --group-size)."""
    workload: LearnerWorkload = "fixed"
    """fixed: every row --prompt-len + --response-len tokens; ragged: per group a prompt length uniform in
    [--prompt-len-min, --prompt-len-max], per response a length uniform in [--response-len-min,
    --response-len-max] (RL-like batches)."""
    prompt_len: int = 64
    """fixed: tokens per prompt."""
    response_len: int = 256
    """fixed: tokens per response."""
    prompt_len_min: int = 64
    """ragged: shortest prompt."""
    prompt_len_max: int = 512
    """ragged: longest prompt."""
    response_len_min: int = 32
    """ragged: shortest response."""
    response_len_max: int = 2048
    """ragged: longest response."""
    group_size: int = 8
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one forward/backward, ours and HF's (padded: rows × longest row)."""
    pack_sequences: bool = True
    """Ours: a micro-batch's rows packed into one sequence (no padding compute); off: right-padded rows."""
    gradient_checkpointing: bool = True
    """Both sides (HF's recomputes whole layers)."""
    checkpoint_scope: Literal["layer", "mlp"] = "mlp"
    """Ours, with gradient checkpointing: recompute only each decoder layer's MLP, or the whole layer."""
    compile_layers: bool = True
    """Ours: torch.compile each decoder layer (CUDA only)."""
    fused_optimizer: bool = True
    """Fused AdamW on CUDA, ours and HF's."""
    steps: int = 5
    """Timed optimizer steps (after one warm-up step)."""
    baseline: bool = True
    """Also time a transformers training step (with --lora.rank: transformers + peft's LoRA)."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """--lora.rank R > 0: both sides train rank-R adapters on a frozen base (bf16 on CUDA): `asyncrl.bench_lora`."""
    out: str | None = None
    """Write the result as JSON here."""

    def validate(self) -> None:
        """Refuse impossible shapes (ValueError naming the CLI flag) before anything is loaded."""
        self.lora.validate()
        if self.group_size < 1 or self.rows < self.group_size or self.rows % self.group_size:
            raise ValueError(f"--rows {self.rows} must be a positive multiple of --group-size {self.group_size}")
        for flag, value in (("--steps", self.steps), ("--max-tokens-per-micro-batch", self.max_tokens_per_micro_batch)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be >= 1")
        if self.workload == "fixed":
            _check_lengths(("--prompt-len", self.prompt_len), ("--response-len", self.response_len))
        else:
            _check_range("--prompt-len", self.prompt_len_min, self.prompt_len_max)
            _check_range("--response-len", self.response_len_min, self.response_len_max)


def _check_lengths(*flags: tuple[str, int]) -> None:
    """Every (flag, length) at least one token."""
    for flag, value in flags:
        if value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")


def _check_range(flag: str, low: int, high: int) -> None:
    """`{flag}-min` and `{flag}-max`: both at least one token, min <= max."""
    _check_lengths((f"{flag}-min", low), (f"{flag}-max", high))
    if low > high:
        raise ValueError(f"{flag}-min {low} must be <= {flag}-max {high}")


def _draw_length(args: LearnerBenchArgs, gen: torch.Generator, fixed: int, low: int, high: int) -> int:
    """`fixed` for the fixed workload (nothing drawn); uniform in [low, high] for the ragged one."""
    if args.workload == "fixed":
        return fixed
    return int(torch.randint(low, high + 1, (), generator=gen))


def _random_completion(gen: torch.Generator, vocab: int, length: int):
    """A finished ("length") completion of `length` random tokens with random behaviour log-probs."""
    from asyncrl.types import Completion
    return Completion(torch.randint(0, vocab, (length,), generator=gen).tolist(),
                      (-torch.rand(length, generator=gen) * 4).tolist(), [0] * length, "length")


def groups_for(args: LearnerBenchArgs, vocab: int, seed: int) -> list:
    """`rows // group_size` groups of random prompts, responses and rewards, the same for the same seed.
    Lengths: fixed, `prompt_len` / `response_len`; ragged, per group a prompt length uniform in
    [prompt_len_min, prompt_len_max] and per response one in [response_len_min, response_len_max]."""
    from asyncrl.types import Group
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(args.rows // args.group_size):
        prompt_len = _draw_length(args, gen, args.prompt_len, args.prompt_len_min, args.prompt_len_max)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        comps = [_random_completion(gen, vocab, _draw_length(args, gen, args.response_len, args.response_len_min,
                                                             args.response_len_max))
                 for _ in range(args.group_size)]
        out.append(Group(g, prompt, comps, torch.rand(args.group_size, generator=gen).tolist()))
    return out


def row_lengths(groups: list) -> list[tuple[int, int]]:
    """(prompt_len, response_len) of every row (completion) of `groups`."""
    return [(len(g.prompt_ids), len(c.token_ids)) for g in groups for c in g.completions]


def body_params(model) -> int:
    """Parameters of the decoder layers and the final norm: no embedding, no LM head."""
    body = (model.model.layers, model.model.norm)
    return sum(p.numel() for module in body for p in module.parameters())


def train_flops(config, n_body: int, rows: list[tuple[int, int]]) -> float:
    """Useful model FLOPs of one training step (forward + backward, 2 + 4 FLOPs per multiply-add) over `rows`
    = (prompt_len, response_len), for a `TransformerConfig`-like `config`:
      6 · n_body per token (the decoder layers' matmuls),
      6 · vocab · hidden per response token (the LM head: only response log-probs are trained),
      6 · layers · (heads · head_dim) · s² per row of s = prompt + response tokens (causal attention: QKᵀ and
      AV, 2 · 2 · s² · width forward over the half of the s × s scores a causal mask keeps, twice that back).
    Padding and recomputation (gradient checkpointing) are not useful work and are not counted."""
    tokens = sum(p + r for p, r in rows)
    response = sum(r for _, r in rows)
    squares = sum((p + r) ** 2 for p, r in rows)
    attention_width = config.num_heads * config.head_dim
    return float(6 * n_body * tokens + 6 * config.vocab_size * config.hidden_size * response
                 + 6 * config.num_layers * attention_width * squares)


def peak_flops(device: str) -> float | None:
    """Nominal dense bf16 FLOP/s of `device` when it is a GPU we know; None on CPU or an unknown GPU."""
    if not device.startswith("cuda"):
        return None
    name = _device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def _mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the device's peak (None without a peak)."""
    return None if peak is None else flops / seconds / peak


def _timed(device: str, step, step_groups: list[list]) -> float:
    """Seconds of `step(groups)` over `step_groups[1:]`, after a warm-up `step(step_groups[0])`."""
    step(step_groups[0])
    _sync(device)
    start = time.perf_counter()
    for groups in step_groups[1:]:
        step(groups)
    _sync(device)
    return time.perf_counter() - start


def _time_train_step(args: LearnerBenchArgs, model, step_groups: list[list], *, lr: float = 1e-6) -> float:
    """Seconds of our GRPO `train_step` over the timed steps' groups (after a warm-up step)."""
    from asyncrl.config import GRPO, OptimConfig, TrainerConfig
    from asyncrl.learner import build_learner, train_step
    cfg = TrainerConfig(mini_batch_size=max(args.rows // args.group_size, 1),
                        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                        pack_sequences=args.pack_sequences, gradient_checkpointing=args.gradient_checkpointing,
                        checkpoint_scope=args.checkpoint_scope, compile_layers=args.compile_layers,
                        fused_optimizer=args.fused_optimizer, optim=OptimConfig(lr=lr))
    state = build_learner(model, cfg, GRPO())
    return _timed(args.device, lambda groups: train_step(state, groups), step_groups)


def _padded_batch(sequences: list[tuple[list[int], list[int]]], device: str) -> dict[str, torch.Tensor]:
    """HF inputs for (prompt_ids, response_ids) rows: right-padded `input_ids`, `attention_mask`, and `labels`
    = the response's token ids (-100 on prompt and padding: HF shifts them, so the loss is the response's)."""
    width = max(len(p) + len(r) for p, r in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (prompt, response) in enumerate(sequences):
        end = len(prompt) + len(response)
        ids[i, :end] = torch.tensor(prompt + response)
        mask[i, :end] = 1
        labels[i, len(prompt):end] = torch.tensor(response)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def _hf_micro_batches(groups: list, budget: int, device: str) -> list[dict[str, torch.Tensor]]:
    """The rows of `groups` as padded HF micro-batches, cut by our padded budget rule (rows × longest row
    <= budget, longest first; a longer row alone)."""
    from asyncrl.config import TrainerConfig
    from asyncrl.learner import split_rows
    sequences = [(g.prompt_ids, c.token_ids) for g in groups for c in g.completions]
    lengths = [len(p) + len(r) for p, r in sequences]
    padded = TrainerConfig(max_tokens_per_micro_batch=budget, pack_sequences=False)
    return [_padded_batch([sequences[r] for r in rows], device) for rows in split_rows(list(range(len(lengths))),
                                                                                       lengths, padded)]


def _time_hf_train(args: LearnerBenchArgs, model, step_groups: list[list]) -> float:
    """Seconds of a plain transformers training step over the same groups (after a warm-up step): padded
    micro-batches, `model(...).loss` under bf16 autocast on CUDA, backward per micro-batch, gradient clipping
    at 1.0, AdamW (fused on CUDA with --fused-optimizer, as ours)."""
    hf = _hf_copy(model, torch.float32, args.device)
    if args.gradient_checkpointing:
        hf.gradient_checkpointing_enable()
    hf.train()
    on_cuda = args.device.startswith("cuda")
    optim = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=on_cuda and args.fused_optimizer)

    def step(groups: list) -> None:
        for batch in _hf_micro_batches(groups, args.max_tokens_per_micro_batch, args.device):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
                loss = hf(**batch).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)

    return _timed(args.device, step, step_groups)


def _learner_row(args: LearnerBenchArgs, timed_rows: list[list[tuple[int, int]]]) -> dict:
    """The JSON row's description of the run: device, model, workload and knobs, mean tokens per step."""
    tokens = sum(p + r for rows in timed_rows for p, r in rows)
    response = sum(r for rows in timed_rows for _, r in rows)
    return {"device": _device_name(args.device), "model": args.model, "workload": args.workload,
            "rows": args.rows, "tokens_per_row": tokens / (args.rows * args.steps),
            "tokens_per_step": tokens / args.steps, "response_tokens_per_step": response / args.steps,
            "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch, "pack_sequences": args.pack_sequences,
            "gradient_checkpointing": args.gradient_checkpointing, "checkpoint_scope": args.checkpoint_scope,
            "compile_layers": args.compile_layers, "fused_optimizer": args.fused_optimizer}


def bench_learner(args: LearnerBenchArgs) -> dict:
    """Run the learner benchmark; print one JSON row and return it. Both sides train on the same rows (drawn
    before the clock starts); tok/s counts their real tokens, MFU their `train_flops` over the device's peak."""
    from asyncrl.policies import load_model
    args.validate()
    on_cuda = args.device.startswith("cuda")
    lora = args.lora.rank > 0
    model = load_model(args.model, dtype=torch.bfloat16 if lora and on_cuda else torch.float32, device=args.device)
    step_groups = [groups_for(args, model.config.vocab_size, seed) for seed in range(args.steps + 1)]
    timed_rows = [row_lengths(groups) for groups in step_groups[1:]]
    if lora:
        from asyncrl.bench_lora import bench_learner_lora
        row = bench_learner_lora(args, model, step_groups, _learner_row(args, timed_rows))
        print(json.dumps(row), flush=True)
        _write(args.out, row)
        return row
    n_body = body_params(model)
    flops = sum(train_flops(model.config, n_body, rows) for rows in timed_rows)
    peak = peak_flops(args.device)
    row = _learner_row(args, timed_rows)
    tokens = row["tokens_per_step"] * args.steps
    reference = copy.deepcopy(model) if args.baseline else None
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = _time_train_step(args, model, step_groups)
    row.update(ours_tok_s=tokens / seconds, ours_mfu=_mfu(flops, seconds, peak))
    if on_cuda:
        row["ours_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.baseline:
        del model
        if on_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        hf_seconds = _time_hf_train(args, reference, step_groups)
        row.update(hf_tok_s=tokens / hf_seconds, hf_mfu=_mfu(flops, hf_seconds, peak))
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
        if on_cuda:
            row["hf_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(row), flush=True)
    _write(args.out, row)
    return row


def _write(path: str | None, results) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


# ---------------------------------------------------------------------------------------------- CLI
BENCHMARKS = {
    "engine": (EngineBenchArgs, bench_engine, "rollout engine vs transformers generate (output tok/s)"),
    "learner": (LearnerBenchArgs, bench_learner, "learner train_step vs a transformers training step (tok/s, MFU)"),
    "async": (AsyncBenchArgs, bench_async, "colocated sync vs one-step-off / stream / stale+partial training runs"),
}


def _usage() -> str:
    lines = ["usage: asyncrl bench BENCHMARK [--field value ...]", "", "benchmarks:"]
    lines += [f"  {name:10s} {description}" for name, (_, _, description) in BENCHMARKS.items()]
    lines += ["", "`asyncrl bench BENCHMARK --help` lists its options."]
    return "\n".join(lines)


def bench_main(args: list[str]) -> None:
    """`asyncrl bench engine|learner|async [...]`."""
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        raise SystemExit(0 if args else 2)
    if args[0] not in BENCHMARKS:
        raise SystemExit(f"asyncrl bench: unknown benchmark {args[0]!r}; choose one of {', '.join(BENCHMARKS)}"
                         f"\n\n{_usage()}")
    import tyro
    config_type, run, description = BENCHMARKS[args[0]]
    config = tyro.cli(config_type, args=args[1:], prog=f"asyncrl bench {args[0]}", description=description)
    try:
        run(config)
    except ValueError as err:
        raise SystemExit(f"asyncrl bench {args[0]}: {err}") from None
