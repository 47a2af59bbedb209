"""Timing optimizer steps for the learner benchmarks: warm-up steps first (compiling, autotuning, the caching
allocator filling), their first step reported on its own, then the timed steps; and how many frames
torch.compile compiled in each phase, so a reader sees whether the timed steps were steady state.

    times = time_steps("cuda", step, step_groups, warmup=2)   # step(groups) per entry of step_groups
    times.timed_s, times.first_s, times.compiles_timed["frames"]
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable

from asyncrl_bench.shared import synchronize

__all__ = ["StepTimes", "compile_counts", "cuda_time_us", "time_steps"]


def cuda_time_us(fn: Callable[[], object], iters: int) -> float:
    """Microseconds a call of `fn` takes on the current CUDA stream: CUDA events over `iters` calls after one."""
    import torch
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def compile_counts() -> dict[str, int]:
    """torch.compile's running totals in this process: `frames` Dynamo compiled (a recompilation of a frame
    counts again), `graphs` it produced, `graph_breaks`, and `recompile_limit_hits` (frames left to run
    eagerly because they recompiled too often)."""
    from torch._dynamo.utils import counters
    return {"frames": int(counters["frames"]["ok"]), "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompile_limit_hits": int(sum(v for k, v in counters["unimplemented"].items()
                                            if "recompile" in str(k).lower() and "limit" in str(k).lower()))}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Seconds of a benchmark's steps: the first (compilation happens here), all warm-up steps together,
    the timed ones (`step_s` each); and the compile counts (`compile_counts`) of the warm-up and timed phases."""

    first_s: float
    warmup_s: float
    timed_s: float
    step_s: tuple[float, ...]
    compiles_warmup: dict[str, int]
    compiles_timed: dict[str, int]

    def row(self, prefix: str) -> dict:
        """The JSON row's fields, each name prefixed (`ours_`, `hf_`)."""
        return {f"{prefix}first_step_s": self.first_s, f"{prefix}warmup_s": self.warmup_s,
                f"{prefix}step_s": list(self.step_s), f"{prefix}compiles_warmup": self.compiles_warmup,
                f"{prefix}compiles_timed": self.compiles_timed}


def time_steps(device: str, step: Callable[[list], None], step_groups: list[list], warmup: int) -> StepTimes:
    """`step(groups)` over every entry of `step_groups`: the first `warmup` untimed, the rest timed (each
    step synchronized, so a step's seconds are its own). Each step's seconds go to stderr as it ends (a run
    stopped by a time limit still says how far it got)."""
    if not 0 <= warmup < len(step_groups):
        raise ValueError(f"time_steps: warmup={warmup} must leave at least one of the {len(step_groups)} steps "
                         "to time")
    seconds = []
    counts = [compile_counts()]
    for i, groups in enumerate(step_groups):
        if i == warmup:
            counts.append(compile_counts())
        begin = time.perf_counter()
        step(groups)
        synchronize(device)
        seconds.append(time.perf_counter() - begin)
        phase = "warm-up" if i < warmup else "timed"
        print(f"step {i + 1}/{len(step_groups)} ({phase}): {seconds[-1]:.2f} s", file=sys.stderr, flush=True)
    counts.append(compile_counts())
    return StepTimes(first_s=seconds[0], warmup_s=sum(seconds[:warmup]), timed_s=sum(seconds[warmup:]),
                     step_s=tuple(seconds[warmup:]), compiles_warmup=_delta(counts[1], counts[0]),
                     compiles_timed=_delta(counts[2], counts[1]))
