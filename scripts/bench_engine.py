"""Benchmark the embedded engine against Hugging Face `generate` in the same process.

    python scripts/bench_engine.py                              # GPU: Qwen2.5-0.5B shape, bf16, batch 64 and 256
    python scripts/bench_engine.py --model smollm2 --device cpu --dtype float32 --batch-sizes 8 \
        --prompt-len 64 --new-tokens 64                         # CPU: SmolLM2-135M

A thin wrapper over `asyncrl_bench.engine` (the same as `asyncrl bench engine ...`); see that module for what is
measured.
"""

from __future__ import annotations

from asyncrl_bench.engine import EngineBenchArgs as Args, bench_engine as main, logprob_mismatch as mismatch
from asyncrl_bench.engine import peak_bandwidth, step_bytes

__all__ = ["Args", "main", "mismatch", "peak_bandwidth", "step_bytes"]

if __name__ == "__main__":
    import tyro
    main(tyro.cli(Args))
