"""Benchmark speculative decoding against plain decoding in the same process.

    python scripts/bench_speculation.py --model random:qwen3-1.7b --batch-sizes 8 32 256 --prompts 0   # GPU: step cost
    python scripts/bench_speculation.py --model smollm2 --device cpu --dtype float32 --data gsm8k.parquet --n 8

A thin wrapper over `asyncrl_bench.speculation` (the same as `asyncrl bench speculation ...`); see that module for
what is measured.
"""

from __future__ import annotations

from asyncrl_bench.speculation import SpeculationBenchArgs as Args, bench_speculation as main

__all__ = ["Args", "main"]

if __name__ == "__main__":
    import tyro
    main(tyro.cli(Args))
