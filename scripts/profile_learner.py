"""Where does a learner step's time go: the GPU's work or the host's launching it? Profiles one steady-state
GRPO `train_step` of the learner benchmark's workload (after warm-up steps) and prints one JSON line:

    python scripts/profile_learner.py --rows 64 --workload ragged                 # Qwen2.5-0.5B shape
    python scripts/profile_learner.py --rows 64 --workload ragged --cuda-graphs   # the layers as CUDA graphs

- `step_s` (unprofiled) and `profiled_step_s`; `gpu_busy_s`: the union of the kernels' intervals (a GPU
  that is busy for the whole step bounds it; one idle for much of it waits on the host);
- `fwd_host_s`: host seconds inside the body's forwards (`fwd_calls` of them), `launches`: kernel launches
  a step, `command_buffer_full`: launches that waited for the GPU's queue to drain (the host ran ahead);
- `layer_call_host_ms`: host milliseconds of one decoder layer's forward at `--layer-tokens` packed tokens,
  compiled (as the learner calls it) and eager, over 20 calls queued without a sync;
- the top operators by self host time and by GPU time (`--top` rows each), to stderr.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch
import tyro
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile, record_function

import asyncrl.learner.forward as learner_forward
from asyncrl.config import GRPO, TrainerConfig
from asyncrl.learner import build_learner, train_step
from asyncrl.policies import load_model
from asyncrl.policies.attention_layouts import DocumentLayout
from asyncrl_bench.learner import LearnerBenchArgs, groups_for


@dataclasses.dataclass
class ProfileArgs:
    """The learner benchmark's workload and the learner's knobs, with their defaults (`TrainerConfig`)."""

    model: str = "random:qwen2.5-0.5b"
    rows: int = 64
    workload: str = "ragged"
    """The learner benchmark's workloads (`asyncrl bench learner --help`): fixed or ragged."""
    max_tokens_per_micro_batch: int = TrainerConfig.max_tokens_per_micro_batch
    """--trainer.max-tokens-per-micro-batch."""
    gradient_checkpointing: bool = TrainerConfig.gradient_checkpointing
    """--trainer.gradient-checkpointing (with the learner's --trainer.checkpoint-scope)."""
    cuda_graphs: bool = TrainerConfig.cuda_graphs
    """--trainer.cuda-graphs."""
    compile_scope: str = TrainerConfig.compile_scope
    """layer or model (`--trainer.compile-scope`)."""
    warmup_steps: int = 3
    layer_tokens: int = 8192
    top: int = 25


def _busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (µs in, seconds out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6


def _kernel_intervals(prof) -> list[tuple[float, float]]:
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation:
            out.append((e.time_range.start, e.time_range.end))
    return out


def _launch_counts(prof) -> dict[str, int]:
    """Kernel launches, CUDA graph launches and launches that waited for a full queue in a profile."""
    names = [e.name for e in prof.events()]
    launch = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    return {"launches": sum(n in launch for n in names), "graph_launches": sum(n == "cudaGraphLaunch" for n in names),
            "command_buffer_full": sum(n == "Command Buffer Full" for n in names)}


def _layer_call_ms(model, tokens: int, compiled: bool) -> float:
    """Host ms of one decoder layer's training forward at `tokens` packed tokens (four documents)."""
    layer = model.model.layers[0]
    docs = (tokens // 4,) * 3 + (tokens - 3 * (tokens // 4),)
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    documents = DocumentLayout(docs, cu)
    positions = torch.cat([torch.arange(n, device="cuda") for n in docs])[None]
    x = torch.randn(1, tokens, model.config.hidden_size, device="cuda", requires_grad=True)
    cos, sin = model.rope(positions, x.dtype)
    call = layer if compiled else layer.forward
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):
            call(x, cos, sin, None, None, None, positions, False, documents, True).float().sum().backward()
        torch.cuda.synchronize()
        begin = time.perf_counter()
        outs = [call(x, cos, sin, None, None, None, positions, False, documents, True) for _ in range(20)]
        host = (time.perf_counter() - begin) / 20
    del outs
    torch.cuda.synchronize()
    return host * 1e3


def main(args: ProfileArgs) -> None:
    model = load_model(args.model, dtype=torch.float32, device="cuda")
    bench = LearnerBenchArgs(model=args.model, rows=args.rows, workload=args.workload,
                             max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                             gradient_checkpointing=args.gradient_checkpointing, cuda_graphs=args.cuda_graphs,
                             compile_scope=args.compile_scope)
    state = build_learner(model, bench.trainer_config(), GRPO())
    vocab = model.config.vocab_size
    for seed in range(args.warmup_steps):
        train_step(state, groups_for(bench, vocab, seed))
    torch.cuda.synchronize()
    groups = groups_for(bench, vocab, 100)
    begin = time.perf_counter()
    train_step(state, groups)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - begin
    hidden = learner_forward._response_hidden
    fwd = {"calls": 0, "host_s": 0.0}

    def timed_hidden(model, micro):
        start = time.perf_counter()
        with record_function("body_fwd"):
            out = hidden(model, micro)
        fwd["calls"] += 1
        fwd["host_s"] += time.perf_counter() - start
        return out

    learner_forward._response_hidden = timed_hidden
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        begin = time.perf_counter()
        train_step(state, groups_for(bench, vocab, 101))
        torch.cuda.synchronize()
        profiled_s = time.perf_counter() - begin
    learner_forward._response_hidden = hidden
    row = {"model": args.model, "cuda_graphs": args.cuda_graphs, "compile_scope": args.compile_scope,
           "budget": args.max_tokens_per_micro_batch, "gradient_checkpointing": args.gradient_checkpointing,
           "step_s": step_s, "profiled_step_s": profiled_s, "gpu_busy_s": _busy_seconds(_kernel_intervals(prof)),
           "fwd_calls": fwd["calls"], "fwd_host_s": fwd["host_s"], **_launch_counts(prof),
           "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]), "frames": int(counters["frames"]["ok"]),
           "layer_call_host_ms": None}
    if not args.cuda_graphs and args.compile_scope == "layer":  # (graphs replay only inside a step)
        row["layer_call_host_ms"] = {"compiled": _layer_call_ms(model, args.layer_tokens, True),
                                     "eager": _layer_call_ms(model, args.layer_tokens, False)}
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=70), file=sys.stderr)
    print(table.table(sort_by="self_cuda_time_total", row_limit=args.top, max_name_column_width=70), file=sys.stderr)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(tyro.cli(ProfileArgs))
