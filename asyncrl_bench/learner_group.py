"""The learner benchmark over a trainer group (`asyncrl bench learner --ranks N`): our GRPO step on N processes
joined in one process group, the policy sharded by FSDP2 as a run's trainer group shards it
(`asyncrl.learner.sharding_options`: bf16 layer gathers under autocast on GPUs, the reshard setting,
`--compile-layers` each layer between its gathers), one device per rank (cuda:0..N-1; gloo processes on CPU).

    asyncrl bench learner --workload ragged --rows 128 --ranks 2 --no-baseline   # 64 rows per GPU

Each step's `rows` are the group's batch: every rank receives all of them and trains every N-th group, as
`train_step` does in a run, so the group's tok/s counts every row and the per-GPU figure is that over N,
to hold beside a one-process row of `rows / N` rows (the same work per GPU). Peak memory is each rank's.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh

from asyncrl.config import GRPO
from asyncrl.learner import build_learner, shard_model, sharding_options, train_step
from asyncrl.policies import load_model
from asyncrl.rpc.roles import free_port
from asyncrl_bench.learner_args import LearnerBenchArgs
from asyncrl_bench.roofline import peak_flops
from asyncrl_bench.timing import time_steps

__all__ = ["bench_learner_group", "group_row"]


def _rank_device(args: LearnerBenchArgs, rank: int) -> str:
    return f"cuda:{rank}" if args.device.startswith("cuda") else "cpu"


def _rank_main(rank: int, args: LearnerBenchArgs, port: int, out_dir: str, step_groups: list[list]) -> None:
    """One rank: join the group, build and shard the model, time the steps, write its figures as JSON."""
    device = _rank_device(args, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=args.ranks, timeout=datetime.timedelta(minutes=10))
    try:
        offload = args.offload == "params"
        dtype = torch.bfloat16 if args.param_dtype == "bfloat16" else torch.float32
        model = load_model(args.model, dtype=dtype, device="cpu" if offload else device, impl=args.impl)
        config = args.trainer_config()
        device_type = torch.device(device).type
        shard_model(model, DeviceMesh.from_group(dist.group.WORLD, device_type), offload=offload,
                    **sharding_options(config, device_type))
        state = build_learner(model, config, GRPO(), group=dist.group.WORLD)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = time_steps(device, lambda groups: train_step(state, groups), step_groups, args.warmup_steps)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"timed_s": times.timed_s, "first_s": times.first_s, "step_s": list(times.step_s),
                       "compiles_timed": times.compiles_timed, "peak_gib": peak}, f)
    finally:
        dist.destroy_process_group()


def group_row(args: LearnerBenchArgs, ranks: list[dict], tokens: float, flops: float) -> dict:
    """The row's group fields from every rank's figures: a step ends when its slowest rank does, so the group's
    time is the largest rank's; tok/s for the group and per GPU, MFU per GPU, each rank's peak GiB."""
    timed_s = max(r["timed_s"] for r in ranks)
    peak = peak_flops(args.device)
    return {"ranks": args.ranks, "ours_tok_s": tokens / timed_s, "ours_tok_s_per_gpu": tokens / timed_s / args.ranks,
            "ours_mfu": flops / timed_s / (peak * args.ranks) if peak else None,
            "ours_first_step_s": max(r["first_s"] for r in ranks),
            "ours_step_s": [max(s) for s in zip(*(r["step_s"] for r in ranks))],
            "ours_compiles_timed": ranks[0]["compiles_timed"],
            "ours_peak_gib_per_rank": [r["peak_gib"] for r in ranks]}


def bench_learner_group(args: LearnerBenchArgs, step_groups: list[list], row: dict, flops: float) -> dict:
    """Time our step on `args.ranks` processes over `step_groups` (every rank the same groups, each training its
    share); `row` holds the run's description, `flops` the timed steps' model FLOPs. Returns the row with the
    group's fields."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(args, free_port(), out_dir, step_groups), nprocs=args.ranks, join=True)
        ranks = []
        for r in range(args.ranks):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    row.update(group_row(args, ranks, row["tokens_per_step"] * args.steps, flops))
    return row
