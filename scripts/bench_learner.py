"""Benchmark a learner step against a plain Hugging Face training step, in the same process.

    python scripts/bench_learner.py                      # GPU: Qwen2.5-0.5B shape, 16 × 320 tokens
    python scripts/bench_learner.py --workload ragged --rows 64   # GPU: RL-like prompt and response lengths

A thin wrapper over `asyncrl_bench.learner` (the same as `asyncrl bench learner ...`); see that module for what is
measured.
"""

from __future__ import annotations

from asyncrl_bench.learner import LearnerBenchArgs as Args, bench_learner as main, groups_for

__all__ = ["Args", "main", "groups_for"]

if __name__ == "__main__":
    import tyro
    main(tyro.cli(Args))
