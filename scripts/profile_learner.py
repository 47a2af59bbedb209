"""Where does a learner step's GPU time go? Profiles one GRPO `train_step` (after a warm-up) and prints
the top CUDA kernels and the top operators by self time.

    python scripts/profile_learner.py --rows 64
    python scripts/profile_learner.py --rows 64 --workload ragged

The table's last lines give the step's host time (Self CPU) beside its GPU time (Self CUDA): a step whose
host time exceeds its GPU time is launch-bound.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import tyro
from torch.profiler import ProfilerActivity, profile

from asyncrl.config import GRPO, OptimConfig, TrainerConfig
from asyncrl.learner import build_learner, train_step
from asyncrl.policies import load_model
from scripts.bench_learner import Args as BenchArgs, groups_for


@dataclasses.dataclass
class Args:
    model: str = "random:qwen2.5-0.5b"
    rows: int = 64
    workload: Literal["fixed", "ragged"] = "fixed"
    """The bench's workloads (`asyncrl bench learner --help`)."""
    max_tokens_per_micro_batch: int = 16384
    rows_shown: int = 18


def main(args: Args) -> None:
    model = load_model(args.model, dtype=torch.float32, device="cuda")
    bench = BenchArgs(rows=args.rows, workload=args.workload)
    cfg = TrainerConfig(mini_batch_size=args.rows // bench.group_size, gradient_checkpointing=True,
                        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, optim=OptimConfig(lr=1e-6))
    state = build_learner(model, cfg, GRPO())
    train_step(state, groups_for(bench, model.config.vocab_size, 0))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step(state, groups_for(bench, model.config.vocab_size, 1))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows_shown))


if __name__ == "__main__":
    main(tyro.cli(Args))
