"""One weight publication from rank 0 to an agent process on the same GPU, over each weight-channel backend, in
one run: CUDA IPC (rank 0's staging buffer, mapped by the agent) against gloo (through host memory, what such a
channel used before).

    python scripts/bench_channel.py                                  # random Qwen2.5-0.5B, bf16, cuda:0
    python scripts/bench_channel.py --model tiny-qwen2 --device cpu --backends gloo --reps 1   # the smoke run

Each repetition publishes with every backend in turn, as `CollectivePublisher` does: the weights are flattened
into buckets (on the GPU for CUDA IPC, in host memory for gloo; `--bucket-mb` as `RunSpec.bucket_mb`), then
broadcast bucket by bucket; the agent receives each bucket into a fresh tensor (on its GPU, or in host memory
for gloo) and copies it into its own weights, as `AgentServer.receive` does, then acknowledges. Weights change
sign between publications; the agent's weights are compared with rank 0's after each (a checksum of their
bits). Not timed: gathering the weights, pausing and resuming the agent (RPC). Prints per backend the median,
min and max of the flatten and transfer times; `--out` writes them as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import pathlib
import socket
import statistics
import sys
import time

import torch
import tyro

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.learner.publication import published_weights  # noqa: E402
from asyncrl.policies.loading import random_model  # noqa: E402
from asyncrl.rpc.channels import (WeightChannel, buffers_on_gpu, flatten, layout_of, make_buckets,  # noqa: E402
                                  numel, unflatten)
from asyncrl.rpc.store import RunStore  # noqa: E402


@dataclasses.dataclass
class Args:
    model: str = "qwen2.5-0.5b"
    """Architecture preset (random weights)."""
    dtype: str = "bfloat16"
    device: str = "cuda:0"
    """The GPU both rank 0 and the agent use."""
    backends: tuple[str, ...] = ("cuda_ipc", "gloo")
    reps: int = 5
    bucket_mb: int = 256
    timeout_s: float = 120.0
    out: str | None = None
    """A JSON file for the rows."""


def checksum(tensors) -> int:
    """A checksum of the tensors' bits (the sum of their bytes, position-weighted per tensor)."""
    return sum((i + 1) * int(t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64)) for i, t in enumerate(tensors))


def agent(port: int, args: Args, layout, results) -> None:
    """The agent process: one channel per backend, its own weights, and a loop over the publications."""
    torch.set_num_threads(4)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = RunStore("127.0.0.1", port, serve=False, timeout_s=args.timeout_s)
    channels = {b: WeightChannel(store.raw, b, 1, backend=b, device=device, timeout_s=args.timeout_s)
                for b in args.backends}
    mine = {name: torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for bucket in layout for name, shape, dtype in bucket}
    for _ in range(args.reps):
        for backend, channel in channels.items():
            where = device if buffers_on_gpu(channel.backend) else torch.device("cpu")
            for bucket in layout:
                flat = torch.empty(sum(numel(shape) for _, shape, _ in bucket), dtype=getattr(torch, bucket[0][2]),
                                   device=where)
                channel.broadcast(flat)
                for name, tensor in unflatten(flat, bucket):
                    mine[name].copy_(tensor)
                del flat
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            channel.group.barrier().wait()  # loaded: rank 0 stops its clock
            results.put((backend, channel.backend, checksum(mine.values())))
    results.close()
    results.join_thread()


def publish(channel: WeightChannel, weights, args: Args) -> tuple[float, float]:
    """Rank 0's side of one publication: (flatten seconds, transfer seconds up to the agent's load)."""
    device = torch.device(args.device)
    start = time.perf_counter()
    where = device if buffers_on_gpu(channel.backend) else torch.device("cpu")
    flats = [flatten(b, where) for b in make_buckets(weights, args.bucket_mb << 20)]
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    flattened = time.perf_counter()
    for flat in flats:
        channel.broadcast(flat)
    channel.group.barrier().wait()
    return flattened - start, time.perf_counter() - flattened


def main(args: Args) -> list[dict]:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = random_model(args.model, seed=0, dtype=getattr(torch, args.dtype), device=device)
    weights = list(published_weights(model, dtype=getattr(torch, args.dtype)))
    layout = layout_of(make_buckets(weights, args.bucket_mb << 20))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = RunStore("127.0.0.1", port, serve=True, timeout_s=args.timeout_s)
    proc = ctx.Process(target=agent, args=(port, args, layout, results), daemon=True)
    proc.start()
    channels = {b: WeightChannel(store.raw, b, 0, backend=b, device=device, timeout_s=args.timeout_s)
                for b in args.backends}
    times: dict[str, list[tuple[float, float, str]]] = {b: [] for b in args.backends}
    for _ in range(args.reps):
        for backend, channel in channels.items():
            with torch.no_grad():
                for _, tensor in weights:
                    tensor.neg_()  # other weights every publication
            flatten_s, transfer_s = publish(channel, weights, args)
            _, used, agent_sum = results.get(timeout=args.timeout_s)
            if agent_sum != checksum(t for _, t in weights):
                raise RuntimeError(f"{backend}: the agent's weights differ from rank 0's after a publication")
            times[backend].append((flatten_s, transfer_s, used))
    proc.join(args.timeout_s)
    return report(times, sum(t.numel() * t.element_size() for _, t in weights), len(layout), args)


def report(times: dict, nbytes: int, buckets: int, args: Args) -> list[dict]:
    rows = []
    for backend, runs in times.items():
        flat_ms = [f * 1e3 for f, _, _ in runs]
        transfer_ms = [t * 1e3 for _, t, _ in runs]
        total_ms = [f + t for f, t in zip(flat_ms, transfer_ms)]
        rows.append({"backend": backend, "used": runs[0][2], "reps": len(runs), "bytes": nbytes, "buckets": buckets,
                     "flatten_ms": _spread(flat_ms), "transfer_ms": _spread(transfer_ms),
                     "total_ms": _spread(total_ms)})
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"{args.model} ({args.dtype}, {nbytes / 2**20:.0f} MiB in {buckets} buckets) on {args.device} ({name}), "
          f"{args.reps} publications each; ms: median (min-max)")
    print(f"{'backend':>9s} {'used':>9s} {'flatten':>22s} {'transfer':>22s} {'total':>22s}")
    for row in rows:
        print(f"{row['backend']:>9s} {row['used']:>9s} " + " ".join(
            "{:>22s}".format("{median:.1f} ({min:.1f}-{max:.1f})".format(**row[k]))
            for k in ("flatten_ms", "transfer_ms", "total_ms")))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return rows


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


if __name__ == "__main__":
    main(tyro.cli(Args))
