"""The speculative-decoding benchmark (`asyncrl bench speculation`): what model-free drafts save, measured two ways
in one call, each beside plain decoding.

    asyncrl bench speculation --model smollm2 --device cpu --dtype float32 --data gsm8k.parquet --n 8   # acceptance
    asyncrl bench speculation --model random:qwen3-1.7b --batch-sizes 8 32 256                         # step cost

1. **End to end** (`end_to_end` rows): the same seeded requests through the engine without and with speculation (each
   draft length of --tokens), each timed after a warm-up run: output tok/s and the ratio, the acceptance (drafted
   tokens kept / drafted), the share of the generated tokens that were kept drafts (`accepted_share`, the measure
   that compares with vLLM's, whose counters see only the rows that drafted), the tokens a speculative step gives a
   row, the share of samples whose tokens equal plain decoding's and the first divergences per 1,000 tokens (each
   kept token is drawn from the verifying forward's distribution with the row's own uniform number, so they differ
   only where that forward's rounding, not plain decoding's, moves a CDF boundary past the uniform: with a large
   vocabulary's tail of tiny probabilities this happens now and then, also in fp32), and each side's mean
   |Δ log-prob| against a training forward of its tokens (what the learner sees). The warm-up runs other prompts, so no
   draft comes from it. With real weights on a prompt file (--data, --n samples per prompt, real EOS) the acceptance
   is what the drafts are worth; random weights accept almost nothing.
2. **The verifying step's cost** (`step_cost` rows): at each --batch-sizes, rows in steady decode, a plain decode
   step (CUDA graphs, as a run uses them) against a speculative step that checks a k-token draft on every row
   (`cost_ratio` = t_spec / t_plain; the drafts are random, so each step keeps one token a row). Speculation pays
   where the tokens a speculative step gives a row (`tokens_per_spec_row_step` of part 1) exceed that ratio.

With --vllm the end-to-end rows also carry vLLM's n-gram speculation on the same timed prompts (`vllm_*` fields:
plain and speculative tok/s, acceptance, tokens a speculative step gives a row; `asyncrl_bench.vllm_ngram`), and
`spec_vs_vllm_spec`, our speculative tok/s over vLLM's.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time

import torch

from asyncrl.config import ModelConfig, RolloutConfig, RunConfig
from asyncrl.config.speculation import SpeculationConfig
from asyncrl.data.files import load_prompt_file
from asyncrl.policies import Engine, EngineConfig, SamplingParams, load_model, load_tokenizer
from asyncrl_bench.engine import logprob_mismatch
from asyncrl_bench.shared import bench_dtype, device_name, synchronize, write_json
from asyncrl_bench.vllm_ngram import vllm_ngram_runs

__all__ = ["SpeculationBenchArgs", "bench_speculation"]


@dataclasses.dataclass
class SpeculationBenchArgs:
    """Speculative decoding against plain decoding in the same call (module docstring)."""

    model: str = "random:qwen3-1.7b"
    """Model: an HF dir, a .gguf, 'smollm2', or 'random:<preset>'."""
    device: str = "cuda"
    dtype: str = ModelConfig.engine_dtype
    """auto = bfloat16 on CUDA, float32 on CPU (a run's --model.engine-dtype); or a torch dtype name."""
    tokens: tuple[int, ...] = (2, 4, 8)
    """Draft lengths to measure (--rollout.speculation.tokens)."""
    max_rows: int = SpeculationConfig.max_rows
    """End to end: speculate while at most this many rows run (--rollout.speculation.max-rows); the step-cost rows
    speculate at every batch size."""
    data: str | None = None
    """End to end: a prompt file (.jsonl / .parquet, verl's format), generated until EOS; None: random prompts of
    --prompt-len tokens, --new-tokens each."""
    tokenizer: str | None = ModelConfig.tokenizer
    """Tokenizer for --data (default: the model's)."""
    prompts: int = 16
    """End to end: prompts (each sampled --n times; 0 skips the end-to-end rows)."""
    n: int = RolloutConfig.n
    """End to end: samples per prompt (a GRPO group: the siblings' drafts)."""
    new_tokens: int = RolloutConfig.max_new_tokens
    temperature: float = RolloutConfig.temperature
    """End to end: sampling temperature (0: greedy, as evaluation's default)."""
    """Response budget (end to end); with random prompts every sample generates exactly this many."""
    prompt_len: int = 128
    """Random prompts' length (end to end without --data, and the step-cost rows' context)."""
    batch_sizes: tuple[int, ...] = (8, 32, 256)
    """Step cost: rows decoding together (empty: skip the step-cost rows)."""
    steps: int = 32
    """Step cost: timed steps of each kind."""
    seed: int = RunConfig.seed
    vllm: bool = False
    """End to end: also vLLM's `LLM.generate` on the same timed prompts, plain and with its n-gram speculation at
    each --tokens (lookup window 1-3 tokens, as the drafts'; `asyncrl_bench.vllm_ngram`)."""
    out: str | None = None
    """Write the results as JSON here."""

    def validate(self) -> None:
        if not self.tokens or min(self.tokens) < 1:
            raise ValueError(f"--tokens {' '.join(map(str, self.tokens))}: give draft lengths >= 1")
        if self.prompts < 0 or self.n < 1 or self.new_tokens < 2 or self.steps < 1:
            raise ValueError("--prompts must be >= 0, --n and --steps >= 1, --new-tokens >= 2")
        if min(self.batch_sizes, default=1) < 1:
            raise ValueError("every --batch-sizes value must be >= 1")
        if self.vllm and not self.prompts:
            raise ValueError("--vllm compares the end-to-end rows, which --prompts 0 skips: give --prompts >= 1")

    def torch_dtype(self) -> torch.dtype:
        """--dtype as a torch dtype (`bench_dtype`)."""
        return bench_dtype(self.dtype, self.device)


class RandomDrafts:
    """A k-token draft of random tokens for every row: the verifying step's cost without its savings."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, key, prompt, completions, own, limit):
        return [self.rng.randrange(self.vocab) for _ in range(limit)]


def _engine(model, slots: int, max_len: int, tokens: int = 0, drafter=None, max_rows: int | None = None) -> Engine:
    spec = SpeculationConfig(tokens=tokens, max_rows=max_rows or slots)
    return Engine(model, EngineConfig(max_slots=slots, max_len=max_len, speculation=spec), drafter=drafter)


def _timed_generate(engine: Engine, warm_up, prompts, params, device: str):
    """Outputs and seconds of `prompts` after a run of `warm_up` (graphs captured, kernels loaded): other prompts,
    so that the drafts of the timed run cannot come from the warm-up's responses to the same prompts."""
    engine.generate(warm_up, params)
    engine.stats.clear()
    synchronize(device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    synchronize(device)
    return outs, time.perf_counter() - start


def _prompts(args: SpeculationBenchArgs, model) -> tuple[list[list[int]], list[list[int]], bool]:
    """(warm-up prompts, timed prompts, ignore_eos): the file's first 2 × --prompts, or random ones."""
    count = args.prompts
    if args.data is None:
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, model.config.vocab_size, (2 * count, args.prompt_len), generator=gen).tolist()
        return ids[:count], ids[count:], True
    prompts, _ = load_prompt_file(args.data, load_tokenizer(args.tokenizer or args.model), max_prompt_length=1024)
    if len(prompts) < 2 * count:
        raise ValueError(f"--data {args.data}: {len(prompts)} prompts, fewer than 2 × --prompts {count} (a warm-up "
                         "set and a timed set)")
    ids = [p.prompt_ids for p in prompts[:2 * count]]
    return ids[:count], ids[count:], False


def divergence(plain, spec) -> tuple[float, float]:
    """(share of samples with plain decoding's tokens, first divergences per 1,000 tokens compared): a sample's
    tokens are compared up to and including the first that differs."""
    pairs = [(a.token_ids, b.token_ids) for x, y in zip(plain, spec) for a, b in zip(x.completions, y.completions)]
    first = [next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), None) for a, b in pairs]
    compared = sum(min(len(a), len(b)) if f is None else f + 1 for (a, b), f in zip(pairs, first))
    diverged = sum(f is not None for f in first)
    return 1 - diverged / len(pairs), 1e3 * diverged / max(compared, 1)


def end_to_end(args: SpeculationBenchArgs, model) -> list[dict]:
    """Plain decoding, then each draft length, on the same seeded requests (module docstring, 1)."""
    warm_up, prompts, ignore_eos = _prompts(args, model)
    params = [SamplingParams(n=args.n, temperature=args.temperature, max_new_tokens=args.new_tokens,
                             ignore_eos=ignore_eos, seed=args.seed + i) for i in range(len(prompts))]
    slots, max_len = len(prompts) * args.n, max(map(len, warm_up + prompts)) + args.new_tokens + 2
    plain, plain_s = _timed_generate(_engine(model, slots, max_len), warm_up, prompts, params, args.device)
    generated = sum(len(c.token_ids) for o in plain for c in o.completions)
    mismatch = logprob_mismatch(model, plain)["mean_abs_dlogp"]
    rows = []
    for k in args.tokens:
        engine = _engine(model, slots, max_len, tokens=k, max_rows=args.max_rows)
        outs, seconds = _timed_generate(engine, warm_up, prompts, params, args.device)
        stats = engine.stats
        identical, per_1k = divergence(plain, outs)
        row = {"kind": "end_to_end", "draft_tokens": k, "temperature": args.temperature, "sequences": slots, "generated": generated,
               "plain_tok_s": generated / plain_s,
               "spec_tok_s": sum(len(c.token_ids) for o in outs for c in o.completions) / seconds,
               "acceptance": stats["spec_accepted_tokens"] / max(stats["spec_drafted_tokens"], 1),
               "accepted_share": stats["spec_accepted_tokens"] / max(generated, 1),
               "spec_steps": stats["spec_steps"], "decode_steps": stats["decode_steps"],
               "identical_share": identical, "divergences_per_1k_tokens": per_1k,
               "tokens_per_spec_row_step": _per_row_step(stats), "plain_mean_abs_dlogp": mismatch,
               "spec_mean_abs_dlogp": logprob_mismatch(model, outs)["mean_abs_dlogp"]}
        row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.vllm:
        _beside_vllm(args, model, rows, warm_up, prompts, params[0], max_len)
    return rows


def _beside_vllm(args: SpeculationBenchArgs, model, rows: list[dict], warm_up, prompts, params: SamplingParams,
                 max_len: int) -> None:
    """vLLM's plain and n-gram runs of the same prompts, added to each draft length's row."""
    spec = SpeculationConfig()
    plain, *runs = vllm_ngram_runs(model, warm_up, prompts, params, tokens=args.tokens, min_match=spec.min_match,
                                   max_match=spec.max_match, max_len=max_len, dtype=args.torch_dtype(),
                                   device=args.device)
    for row, run in zip(rows, runs):
        row.update(vllm_plain_tok_s=plain.tok_s, vllm_spec_tok_s=run.tok_s, vllm_speedup=run.tok_s / plain.tok_s,
                   vllm_generated=run.generated, vllm_acceptance=run.acceptance,
                   vllm_accepted_share=run.accepted_share,
                   vllm_tokens_per_spec_row_step=run.tokens_per_spec_row_step,
                   spec_vs_vllm_spec=row["spec_tok_s"] / run.tok_s)
        print(json.dumps({k: v for k, v in row.items() if k.startswith("vllm_") or k == "draft_tokens"}), flush=True)


def _per_row_step(stats) -> float | None:
    """Tokens a speculative step gave a row on average (1 + the kept draft tokens per row-step)."""
    rows = stats["spec_rows"]
    return None if not rows else 1 + stats["spec_accepted_tokens"] / rows


def _steady_steps(engine: Engine, rows: int, context: int, steps: int, vocab: int, device: str, seed: int) -> float:
    """Seconds a step of `rows` rows in steady decode takes (mean of `steps`, after every row's prefill and four
    decode steps)."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(rows):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=8 * steps + 16, ignore_eos=True, seed=seed + i))
    while engine.num_waiting:  # every row admitted and prefilled (a step prefills --max-prefill-tokens at most)
        engine.step()
    for _ in range(4):
        engine.step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(device)
    return (time.perf_counter() - start) / steps


def step_cost(args: SpeculationBenchArgs, model) -> list[dict]:
    """A plain decode step against a speculative step checking k random tokens a row (module docstring, 2)."""
    rows = []
    vocab = model.config.vocab_size
    for batch in args.batch_sizes:
        max_len = args.prompt_len + 8 * args.steps + 32 + max(args.tokens)
        plain = _steady_steps(_engine(model, batch, max_len), batch, args.prompt_len, args.steps, vocab,
                              args.device, args.seed)
        for k in args.tokens:
            engine = _engine(model, batch, max_len, tokens=k, drafter=RandomDrafts(vocab, args.seed))
            spec = _steady_steps(engine, batch, args.prompt_len, args.steps, vocab, args.device, args.seed)
            row = {"kind": "step_cost", "batch": batch, "draft_tokens": k, "context": args.prompt_len,
                   "plain_step_ms": 1e3 * plain, "spec_step_ms": 1e3 * spec, "cost_ratio": spec / plain}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def bench_speculation(args: SpeculationBenchArgs) -> list[dict]:
    """Run both parts; print and return one JSON row per measurement (and write them to --out)."""
    args.validate()
    model = load_model(args.model, dtype=args.torch_dtype(), device=args.device, seed=args.seed)
    meta = {"model": args.model, "device": device_name(args.device), "dtype": str(args.torch_dtype()).split(".")[-1]}
    rows = [dict(meta, **r) for r in (end_to_end(args, model) if args.prompts else [])]
    rows += [dict(meta, **r) for r in step_cost(args, model)]
    if args.out:
        write_json(args.out, rows)
    return rows
