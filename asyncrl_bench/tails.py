"""Heavy-tailed response lengths for random-weight engine benchmarks, and what a batch's tail costs.

Random weights never stop early, so a fixed `--new-tokens` budget makes every sample equally long and hides what
RL rollouts suffer: most responses end early and a few run to the limit, so a synchronous batch spends its last
steps with a handful of rows. `lognormal_budgets` gives each request its own budget with that shape (median
maximum / tail_ratio, 99th percentile at the maximum); `tail_stats` reads the cost off each sample's finish time.

    budgets = lognormal_budgets(256, maximum=4096, tail_ratio=10, seed=0)
    stats = tail_stats(finish_s, total_s)   # {"tail_s", "idle_fraction", ...}
"""

from __future__ import annotations

import math
import statistics
import time

import torch

__all__ = ["Z99", "lognormal_budgets", "quantile", "tail_stats", "time_finishes"]

Z99 = 2.3263478740408408
"""The standard normal's 99th percentile: a log-normal whose p99 is `ratio` × its median has σ = ln(ratio) / Z99."""


def lognormal_budgets(count: int, *, maximum: int, tail_ratio: float, seed: int) -> list[int]:
    """`count` new-token budgets drawn from a log-normal with median maximum / tail_ratio and 99th percentile
    `maximum` (σ = ln(tail_ratio) / Z99), rounded and clipped to [1, maximum]; seeded, the same on every backend."""
    if count < 1 or maximum < 1:
        raise ValueError(f"lognormal_budgets: count {count} and maximum {maximum} must be >= 1")
    if not tail_ratio >= 1.0:
        raise ValueError(f"--tail-ratio {tail_ratio}: the 99th percentile over the median must be >= 1")
    sigma = math.log(tail_ratio) / Z99
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randn(count, generator=gen, dtype=torch.float64) * sigma + math.log(maximum / tail_ratio)
    return torch.exp(draws).round().clamp(1, maximum).long().tolist()


def tail_stats(finish_s: list[float], total_s: float, *, tail_share: float = 0.9) -> dict[str, float]:
    """What a batch's tail costs, from each sample's finish time (seconds after the batch started; every sample
    started with it, as in synchronous rollout) and the batch's whole time:
      tail_s          the time after `tail_share` of the samples had finished (the last few rows running alone);
      idle_fraction   the share of the batch's slot-time left empty by samples that had finished: 1 − mean(finish) /
                      total, which a synchronous trainer waits through;
      finish_p50_s, finish_p99_s   the samples' finish times."""
    if not finish_s or total_s <= 0:
        raise ValueError("tail_stats: needs finish times and a positive total")
    ordered = sorted(finish_s)
    cut = quantile(ordered, tail_share)
    return {"tail_s": total_s - cut, "idle_fraction": 1.0 - statistics.fmean(ordered) / total_s,
            "finish_p50_s": quantile(ordered, 0.5), "finish_p99_s": quantile(ordered, 0.99)}


def quantile(ordered: list, q: float):
    """The q-quantile of sorted values (the smallest value at or above a share q of them; q in (0, 1])."""
    return ordered[min(max(math.ceil(q * len(ordered)) - 1, 0), len(ordered) - 1)]


def time_finishes(engine, prompts: list[list[int]], params: list, synchronize) -> tuple[list, list[float], float]:
    """Queue every prompt with its own sampling params on any `RolloutEngine` and step it to the end: (outputs in
    prompt order, each sample's finish time in seconds after the start, the whole time). `synchronize()` waits for
    the device before each clock read that ends a measurement."""
    synchronize()
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, finishes = {}, []
    while len(done) < len(ids):
        for out in engine.step():
            done[out.request_id] = out
            finishes.extend([time.perf_counter() - start] * len(out.completions))
    synchronize()
    return [done[i] for i in ids], finishes, time.perf_counter() - start
