"""The GPU kernels of the embedded engine's decode steps, by CUDA time (prefill done before the profiler starts).

    python scripts/profile_decode_steps.py --model random:qwen3-1.7b --batch 256 --context 384

`batch` sequences of `context` random prompt tokens are admitted and prefilled, then `steps` decode steps run
under `torch.profiler` (CUDA graphs on: the kernels inside each replay are listed); prints the wall time per step
and the table of kernels. docs/benchmarks/decode-attention-h100-2026-11-26.md reads its numbers from this.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import tyro
from torch.profiler import ProfilerActivity, profile

from asyncrl.policies import Engine, EngineConfig, SamplingParams, load_model


@dataclasses.dataclass
class Args:
    model: str = "random:qwen3-1.7b"
    batch: int = 256
    context: int = 384
    """Prompt tokens per sequence (the decode steps then attend to context + a few positions)."""
    steps: int = 30
    decode_attention: str = "auto"
    rows: int = 25
    """Kernels listed."""


def main(args: Args) -> None:
    model = load_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    engine = Engine(model, EngineConfig(max_slots=args.batch, max_len=args.context + args.steps + 16,
                                        decode_attention=args.decode_attention))
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=args.steps + 8, ignore_eos=True)
    for _ in range(args.batch):
        engine.add_request(torch.randint(0, model.config.vocab_size, (args.context,), generator=gen).tolist(), params)
    for _ in range(3):  # prefill, then the first decode steps capture their graphs
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    print(f"decode attention: {engine.decode_kernel}; {seconds / args.steps * 1e3:.2f} ms per step (wall)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main(tyro.cli(Args))
