"""`asyncrl bench plan`: `asyncrl plan` (`asyncrl.planning.command`) with the rates no JSON file gives measured
first, briefly, by the learner and engine benchmarks on --device.

    asyncrl bench plan --model random:qwen2.5-0.5b --gpus 2 --workload ragged
"""

from __future__ import annotations

import math

from asyncrl.config import LoraConfig
from asyncrl.planning.command import PlanArgs, run_plan, write_plan
from asyncrl.planning.predict import Workload
from asyncrl_bench.engine import EngineBenchArgs, bench_engine
from asyncrl_bench.learner import LearnerBenchArgs, bench_learner

__all__ = ["BenchRates", "bench_plan"]


class BenchRates:
    """The `RateSource` of `asyncrl bench plan`: brief runs of our learner step and our engine."""

    def learner(self, a: PlanArgs, work: Workload) -> dict:
        """A brief `asyncrl bench learner` on --device (our step only) at the workload's lengths."""
        fixed = a.workload == "gsm8k" or a.prompt_len is not None or a.response_len is not None
        print(f"[asyncrl] measuring the learner on {a.device} ({a.measure_steps} steps after the warm-up steps)",
              flush=True)
        return bench_learner(LearnerBenchArgs(
            model=a.model, device=a.device, rows=a.n * math.ceil(64 / a.n), group_size=a.n,
            workload="fixed" if fixed else "ragged", prompt_len=round(work.prompt_len),
            response_len=round(work.response_len), steps=a.measure_steps, baseline=False,
            param_dtype=a.trainer_dtype, offload=a.offload, lora=LoraConfig(rank=a.lora_rank)))

    def engine(self, a: PlanArgs, work: Workload) -> list[dict]:
        """A brief `asyncrl bench engine` on --device (our engine only) at 64 sequences and at --slots (with
        --kv-layout shared-prompt: in groups of --n)."""
        print(f"[asyncrl] measuring the engine on {a.device}", flush=True)
        n = a.n if a.kv_layout == "shared-prompt" else 1  # shared prompts: groups of n that share one
        return bench_engine(EngineBenchArgs(
            model=a.model, device=a.device, backends=("asyncrl",),
            batch_sizes=tuple(sorted({max(min(64, a.slots) // n, 1), max(a.slots // n, 1)})),
            prompt_len=round(work.prompt_len), new_tokens=round(work.response_len), n=n, kv_layout=a.kv_layout))


def bench_plan(a: PlanArgs) -> None:
    """Plan from the given JSON files, measuring what they leave out; --out as `asyncrl plan` writes it."""
    write_plan(a, run_plan(a, measure=BenchRates()))
