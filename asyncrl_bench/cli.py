"""`asyncrl bench engine|learner|async|attention|plan|launch|speculation|admission [...]`: picks the benchmark and parses its flags.
The `bench` command reaches `asyncrl`'s command line through the `asyncrl.commands` entry point this package
declares (pyproject.toml): the library never names this package.

    asyncrl bench --help                  # the benchmarks
    asyncrl bench learner --help          # one benchmark's flags
"""

from __future__ import annotations

from asyncrl_bench.admission import AdmissionBenchArgs, bench_admission
from asyncrl_bench.async_runs import AsyncBenchArgs, bench_async
from asyncrl_bench.attention import AttentionBenchArgs, bench_attention
from asyncrl_bench.engine import EngineBenchArgs, bench_engine
from asyncrl_bench.launch import LaunchBenchArgs, bench_launch
from asyncrl_bench.learner import LearnerBenchArgs, bench_learner
from asyncrl_bench.plan import PlanArgs, bench_plan
from asyncrl_bench.speculation import SpeculationBenchArgs, bench_speculation

__all__ = ["BENCHMARKS", "bench_main"]

BENCHMARKS = {
    "engine": (EngineBenchArgs, bench_engine, "rollout engine vs transformers generate (output tok/s)"),
    "learner": (LearnerBenchArgs, bench_learner, "learner train_step vs a transformers training step (tok/s, MFU)"),
    "async": (AsyncBenchArgs, bench_async, "colocated sync vs one-step-off / stream / stale+partial training runs"),
    "attention": (AttentionBenchArgs, bench_attention, "decode attention kernels on a KV cache vs the HBM roofline"),
    "plan": (PlanArgs, bench_plan, "`asyncrl plan`, measuring briefly the learner and engine rates no JSON file gives"),
    "launch": (LaunchBenchArgs, bench_launch, "a tiny job's launch to first version and exit, spawn vs forkserver"),
    "speculation": (SpeculationBenchArgs, bench_speculation,
                    "speculative vs plain decoding: acceptance, tok/s, and the verifying step's cost"),
    "admission": (AdmissionBenchArgs, bench_admission,
                  "prompts an agent keeps in flight vs the rows a decode step gets, on heavy-tailed lengths"),
}


def _usage() -> str:
    lines = ["usage: asyncrl bench BENCHMARK [--field value ...]", "", "benchmarks:"]
    lines += [f"  {name:12s} {description}" for name, (_, _, description) in BENCHMARKS.items()]
    lines += ["", "`asyncrl bench BENCHMARK --help` lists its options."]
    return "\n".join(lines)


def bench_main(args: list[str]) -> None:
    """`asyncrl bench engine|learner|async|attention|plan|launch|speculation|admission [...]`."""
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        raise SystemExit(0 if args else 2)
    if args[0] not in BENCHMARKS:
        raise SystemExit(f"asyncrl bench: unknown benchmark {args[0]!r}; choose one of {', '.join(BENCHMARKS)}"
                         f"\n\n{_usage()}")
    import tyro
    config_type, run, description = BENCHMARKS[args[0]]
    config = tyro.cli(config_type, args=args[1:], prog=f"asyncrl bench {args[0]}", description=description)
    try:
        run(config)
    except ValueError as err:
        raise SystemExit(f"asyncrl bench {args[0]}: {err}") from None
