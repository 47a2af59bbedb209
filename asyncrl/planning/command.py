"""`asyncrl plan`: the trainer/agent split, staleness and batch that keep both sides busy on N GPUs, from measured
throughputs, with predicted trained tok/s, idle fractions and memory per GPU (the model: `asyncrl.planning.predict`).

    asyncrl bench learner --out learner.json; asyncrl bench engine --out engine.json    # once per GPU and model
    asyncrl plan --model random:qwen2.5-0.5b --gpus 4 --learner-json learner.json --engine-json engine.json
    asyncrl bench plan --model random:qwen2.5-0.5b --gpus 2 --workload ragged    # measures both first, briefly

The command reads rates; measuring them is a benchmark's work, so `asyncrl bench plan` (the same flags) hands
`run_plan` a `RateSource` that runs the learner and engine benchmarks briefly for what no file gives.

Prints every layout with its predicted trained tok/s, idle fractions and GiB per GPU, marks the recommended one
and gives the `asyncrl train` flags that run it; `--out` writes the same as JSON. A running job logs the same
prediction from its own busy times (`plan/*` metrics beside `trainer/idle_ratio` and `rollouter/idle_ratio`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Literal, Protocol

from asyncrl.planning.predict import WORKLOADS, ModelShape, Plan, Prediction, Rates, Workload, plan
from asyncrl.policies.loading import ARCH_PRESETS, hf_config, resolve_model_dir

__all__ = ["PlanArgs", "RateSource", "plan_main", "run_plan", "write_plan", "rates_from_rows", "check_learner_row",
           "check_engine_rows", "train_flags", "format_plan", "workload_of"]


@dataclasses.dataclass
class PlanArgs:
    """Split N GPUs between trainer ranks and rollout agents: predicted trained tok/s, idle fractions and memory
    per GPU of every layout, and the `asyncrl train` flags of the best one."""

    model: str = "random:qwen2.5-0.5b"
    """The model as --model.path takes it (an HF dir, a .gguf, 'smollm2', 'random:<preset>'): its shape."""
    gpus: int = 1
    """GPUs to place the trainer ranks and the rollout agents on."""
    workload: Literal["gsm8k", "ragged"] = "gsm8k"
    """Sample lengths: gsm8k, 107-token prompts and 1024-token responses (a random model runs them to the limit);
    ragged, as `asyncrl bench learner --workload ragged` (prompts 64-512, responses 32-2048 tokens)."""
    learner_json: str | None = None
    """`asyncrl bench learner --out` file (trained tok/s on one GPU); `asyncrl bench plan` measures it without one."""
    engine_json: str | None = None
    """`asyncrl bench engine --out` file (generated tok/s per batch); `asyncrl bench plan` measures it without one."""
    learner_tok_s: float | None = None
    """Trained tok/s of one trainer GPU to assume instead of the learner's measured one (a what-if, or the rate a
    real run showed)."""
    device: str = "cuda"
    """Where `asyncrl bench plan` measures what no JSON file gives."""
    measure_steps: int = 2
    """Timed learner steps when `asyncrl bench plan` measures (after the learner bench's default --warmup-steps)."""
    prompt_len: int | None = None
    """Tokens per prompt instead of the workload's (then every prompt has this length)."""
    response_len: int | None = None
    """Tokens per response instead of the workload's (then every response has this length)."""
    n: int = 8
    """Samples per prompt (--rollout.n)."""
    slots: int = 256
    """Sequences an engine decodes together at most (--rollout.max-slots)."""
    trigger: int = 4
    """Learner steps per weight publication (--async-training.trigger-parameter-sync-step)."""
    mini_batch_size: int | None = None
    """Groups per learner step (--trainer.mini-batch-size); default: recommended per layout."""
    staleness_threshold: float | None = None
    """--async-training.staleness-threshold; default: recommended per layout."""
    trainer_dtype: Literal["float32", "bfloat16"] = "float32"
    """--trainer.param-dtype (memory of weights, grads and Adam states)."""
    lora_rank: int = 0
    """--lora.rank (memory and publication size; measure the learner with the same rank)."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """--trainer.offload (memory per trainer GPU; measure the learner with the same offload: its row records it)."""
    kv_layout: Literal["slot", "shared-prompt"] = "slot"
    """--rollout.kv-layout: the engine's K/V layout (its memory; measure the engine with the same layout: its rows
    record it)."""
    gpu_memory_gib: float = 79.0
    """Memory of one GPU (an H100 80GB holds 79.6 GiB)."""
    out: str | None = None
    """Also write the plan as JSON here."""

    def validate(self) -> None:
        """Refuse impossible values (ValueError naming the flag and the fix) before anything is read or measured."""
        if self.gpus < 1:
            raise ValueError(f"--gpus {self.gpus} must be >= 1: the GPUs to split between trainer and agents")
        for flag, value in (("--n", self.n), ("--trigger", self.trigger), ("--measure-steps", self.measure_steps),
                            ("--prompt-len", self.prompt_len), ("--response-len", self.response_len),
                            ("--mini-batch-size", self.mini_batch_size)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} {value} must be >= 1")
        if self.slots < self.n:
            raise ValueError(f"--slots {self.slots} must be >= --n {self.n} (a prompt's samples decode together)")
        if self.staleness_threshold is not None and self.staleness_threshold < 0:
            raise ValueError(f"--staleness-threshold {self.staleness_threshold} must be >= 0 (0: synchronous)")
        if self.learner_tok_s is not None and self.learner_tok_s <= 0:
            raise ValueError(f"--learner-tok-s {self.learner_tok_s} must be > 0")
        if self.lora_rank and self.trainer_dtype != "float32":
            raise ValueError(f"--trainer-dtype {self.trainer_dtype} with --lora-rank {self.lora_rank}: LoRA adapters "
                             "train in fp32 on a bf16 base (asyncrl train refuses the pair); leave --trainer-dtype out")
        if self.lora_rank and self.offload != "none":
            raise ValueError(f"--offload {self.offload} with --lora-rank {self.lora_rank}: the adapters' optimizer state is "
                             "small; leave --offload out")
        if self.lora_rank < 0 or self.gpu_memory_gib <= 0:
            raise ValueError(f"--lora-rank {self.lora_rank} must be >= 0 and --gpu-memory-gib {self.gpu_memory_gib} "
                             "> 0")


def model_shape(model: str) -> ModelShape:
    """The shape of a model spec as --model.path takes it, from its config (no weights are loaded): any causal LM
    transformers implements, not only asyncrl's own types (`ModelShape.from_hf`)."""
    if model.startswith("random:"):
        config = hf_config(model.removeprefix("random:"))
    elif model == "smollm2":
        config = ARCH_PRESETS["smollm2-135m"]
    else:
        file = (resolve_model_dir(model) if model.endswith(".gguf") else pathlib.Path(model)) / "config.json"
        if not file.is_file():
            raise ValueError(f"--model {model}: no config.json there; pass an HF directory, a .gguf, 'smollm2' or "
                             f"'random:<preset>' (presets: {', '.join(ARCH_PRESETS)})")
        config = json.loads(file.read_text())
    try:  # a type asyncrl does not implement: built by transformers on the meta device (`from_transformers`)
        return ModelShape.from_hf(config)
    except ValueError as err:
        raise ValueError(f"--model {model}: {err}") from None


def workload_of(a: PlanArgs) -> Workload:
    """The workload's lengths, with --prompt-len / --response-len as fixed lengths where given."""
    work = WORKLOADS[a.workload]
    if a.prompt_len is not None:
        work = dataclasses.replace(work, prompt_len=a.prompt_len, max_prompt_len=a.prompt_len)
    if a.response_len is not None:
        work = dataclasses.replace(work, response_len=a.response_len, max_response_len=a.response_len)
    return work


class RateSource(Protocol):
    """Measures what no JSON file gives (`asyncrl bench plan` runs the learner and engine benchmarks briefly)."""

    def learner(self, a: PlanArgs, work: Workload) -> dict:
        """A `bench learner` row: our trained tok/s on one GPU at the workload's lengths."""

    def engine(self, a: PlanArgs, work: Workload) -> list[dict]:
        """`bench engine` rows: our generated tok/s at a few batch sizes."""


def _read(path: str, flag: str, bench: str):
    """A bench's --out file, or a ValueError naming the flag and how to make one."""
    fix = f"write it with `asyncrl {bench} --out {path}`, or run `asyncrl bench plan` to measure briefly"
    try:
        return json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file; {fix}") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{flag} {path}: not a JSON file ({err}); {fix}") from None


def check_learner_row(row, flag: str = "--learner-json") -> dict:
    """A `bench learner` row with what the planner reads, or a ValueError naming the flag and what it lacks."""
    need = ("ours_tok_s", "tokens_per_step", "max_tokens_per_micro_batch")
    if not isinstance(row, dict) or any(not isinstance(row.get(k), (int, float)) or row[k] <= 0 for k in need):
        raise ValueError(f"{flag}: needs {', '.join(need)} (each > 0); give the --out file of `asyncrl bench learner`")
    return row


def check_engine_rows(rows, flag: str = "--engine-json") -> tuple[tuple[float, float], ...]:
    """(sequences, our engine's tok/s) of `bench engine` rows, or a ValueError naming the flag."""
    rows = rows if isinstance(rows, list) else [rows]
    points = tuple((float(r["batch"] * r.get("n", 1)), float(r["ours_tok_s"])) for r in rows if isinstance(r, dict)
                   and isinstance(r.get("batch"), int) and isinstance(r.get("ours_tok_s"), (int, float)))
    if not points or min(min(p) for p in points) <= 0:
        raise ValueError(f"{flag}: no row with batch and ours_tok_s (each > 0); give the --out file of `asyncrl bench "
                         "engine` run with the asyncrl backend")
    return points


def rates_from_rows(learner: dict, engine: list[dict]) -> Rates:
    """`Rates` from a `bench learner` row and `bench engine` rows (our engine's columns)."""
    learner, points = check_learner_row(learner), check_engine_rows(engine)
    compiled = bool(learner.get("compile_layers")) and learner.get("device", "cpu") != "cpu"
    return Rates(float(learner["ours_tok_s"]), float(learner["tokens_per_step"]),
                 int(learner["max_tokens_per_micro_batch"]), points, learner.get("ours_peak_gib"), compiled)


def train_flags(p: Prediction, *, trainer_dtype: str = "float32", lora_rank: int = 0, offload: str = "none",
                kv_layout: str = "slot") -> list[str]:
    """The `asyncrl train` flags that run prediction `p` on GPUs cuda:0, cuda:1, ..."""
    lay, k = p.layout, p.knobs
    gpus = [f"cuda:{i}" for i in range(lay.trainer_gpus + (lay.agent_gpus if lay.kind == "split" else 0))]
    trainers = gpus[:lay.trainer_gpus]
    agents = {"split": gpus[lay.trainer_gpus:], "shared": trainers, "colocated": trainers}[lay.kind]
    flags = ["--placement.trainer-devices", *trainers, "--placement.agent-devices", *agents]
    if lay.kind == "colocated":
        flags += ["--async-training.colocated", "--async-training.no-partial-rollout"]
    flags += ["--async-training.staleness-threshold", f"{k.staleness:g}", "--async-training.trigger-parameter-sync-step",
              str(k.trigger), "--trainer.mini-batch-size", str(k.mini_batch_size), "--rollout.n", str(k.n),
              "--rollout.max-slots", str(k.slots), "--trainer.max-tokens-per-micro-batch", str(p.budget)]
    if trainer_dtype != "float32":
        flags += ["--trainer.param-dtype", trainer_dtype]
    if offload != "none":
        flags += ["--trainer.offload", offload]
    if kv_layout != "slot":
        flags += ["--rollout.kv-layout", kv_layout]
    return flags + (["--lora.rank", str(lora_rank)] if lora_rank else [])


def format_plan(result: Plan, head: list[str], flags: list[str] | None) -> str:
    """The printed plan: `head` lines, one row per layout (* the recommended), then how to run it."""
    cols = f"  {'placement':24s}{'trained tok/s':>14s}  {'idle T / R':>11s}  {'sync s':>7s}  {'GiB/GPU T / R':>14s}" \
           f"  {'mini-batch':>10s}  {'staleness':>9s}  {'trigger':>7s}"
    lines = head + ["", cols]
    for p in result.predictions:
        gib = f"{p.trainer_gib:.1f} / {p.agent_gib:.1f}" if p.layout.kind == "split" else f"{p.trainer_gib:.1f}"
        mark = "*" if p is result.best else " "
        lines.append(f"{mark} {p.layout.name:24s}{p.trained_tok_s:>14,.0f}  {p.trainer_idle:>4.2f} / {p.rollout_idle:4.2f}"
                     f"  {p.sync_s:>7.2f}  {gib:>14s}  {p.knobs.mini_batch_size:>10d}  {p.knobs.staleness:>9g}"
                     f"  {p.knobs.trigger:>7d}" + ("" if p.fits else "  (does not fit)"))
    if result.best is None:
        lines += ["", "no layout fits in --gpu-memory-gib: lower --slots, use --lora-rank, --trainer-dtype bfloat16 "
                      "or --offload optimizer, or more GPUs"]
        return "\n".join(lines)
    best = result.best
    lines += ["", f"recommended (*): {best.layout.name}, {best.trained_tok_s:,.0f} trained tok/s predicted "
                  f"(trainer idle {best.trainer_idle:.2f}, rollout idle {best.rollout_idle:.2f}); run it with",
              "  asyncrl train PRESET " + " ".join(flags or [])]
    return "\n".join(lines)


def _describe(a: PlanArgs, shape: ModelShape, work: Workload, rates: Rates, measured: tuple[dict, list]) -> list[str]:
    """The plan's first lines: the model, the lengths and the rates it starts from (and where they came from)."""
    engine = ", ".join(f"{e:,.0f} tok/s at {b:g}" for b, e in sorted(rates.engine))
    lines = [f"asyncrl plan: {a.model} ({shape.params / 1e6:,.0f}M parameters) on {a.gpus} GPU{'s' * (a.gpus > 1)}; "
             f"samples of {work.prompt_len:g} prompt + {work.response_len:g} response tokens, n {a.n}",
             f"learner {rates.learner_tok_s:,.0f} tok/s on one GPU ({a.learner_json or 'measured on ' + a.device}); "
             f"engine {engine} sequences ({a.engine_json or 'measured on ' + a.device})"]
    for flag, rows in (("--learner-json", [measured[0]]), ("--engine-json", measured[1])):
        other = {r.get("model") for r in rows if isinstance(r, dict)} - {a.model, None}
        if other:
            lines.append(f"note: {flag} measured {', '.join(sorted(other))}, not --model {a.model}")
    return lines


def _as_json(a: PlanArgs, shape: ModelShape, work: Workload, rates: Rates, result: Plan) -> dict:
    rows = [{"placement": p.layout.name, **dataclasses.asdict(p), "recommended": p is result.best,
             "train_flags": train_flags(p, trainer_dtype=a.trainer_dtype, lora_rank=a.lora_rank, offload=a.offload)}
            for p in result.predictions]
    return {"args": dataclasses.asdict(a), "shape": dataclasses.asdict(shape), "workload": dataclasses.asdict(work),
            "rates": dataclasses.asdict(rates), "placements": rows,
            "recommended": result.best.layout.name if result.best else None}


def _missing(a: PlanArgs) -> list[str]:
    return [flag for flag, value in (("--learner-json", a.learner_json), ("--engine-json", a.engine_json)) if not value]


def run_plan(a: PlanArgs, measure: RateSource | None = None) -> dict:
    """Read the rates (or have `measure` measure what no file gives), plan, print; returns what --out writes."""
    a.validate()
    shape, work = model_shape(a.model), workload_of(a)
    # a bad file is refused before anything is measured
    learner = check_learner_row(_read(a.learner_json, "--learner-json", "bench learner"),
                                f"--learner-json {a.learner_json}") if a.learner_json else None
    engine = _read(a.engine_json, "--engine-json", "bench engine") if a.engine_json else None
    if engine is not None:
        check_engine_rows(engine, f"--engine-json {a.engine_json}")
    if learner is not None and learner.get("offload", "none") != a.offload:
        raise ValueError(f"--learner-json {a.learner_json} was measured with --offload {learner.get('offload', 'none')} "
                         f"and this plan is for --offload {a.offload}: pass --offload {learner.get('offload', 'none')}, or "
                         f"measure with `asyncrl bench learner --offload {a.offload} --no-baseline --out FILE`")
    layouts = {row.get("kv_layout", "slot") for row in engine or []}
    if layouts - {a.kv_layout}:
        raise ValueError(f"--engine-json {a.engine_json} was measured with --kv-layout {' '.join(sorted(layouts))} and "
                         f"this plan is for --kv-layout {a.kv_layout}: pass that, or measure with `asyncrl bench engine "
                         f"--kv-layout {a.kv_layout} --out FILE`")
    if measure is None and _missing(a):
        raise ValueError(f"{' and '.join(_missing(a))} missing: `asyncrl plan` plans from measured rates. Write them "
                         "with `asyncrl bench learner --out learner.json` and `asyncrl bench engine --out engine.json`, "
                         "or run `asyncrl bench plan` with the same flags, which measures them briefly first")
    learner = learner if learner is not None else measure.learner(a, work)
    engine = engine if engine is not None else measure.engine(a, work)
    if a.learner_tok_s is not None:
        learner = {**learner, "ours_tok_s": a.learner_tok_s}
    rates = rates_from_rows(learner, engine)
    result = plan(shape, work, rates, a.gpus, n=a.n, slots=a.slots, trigger=a.trigger,
                  mini_batch_size=a.mini_batch_size, staleness=a.staleness_threshold, trainer_dtype=a.trainer_dtype,
                  lora_rank=a.lora_rank, offload=a.offload, gpu_gib=a.gpu_memory_gib, kv_layout=a.kv_layout)
    flags = (train_flags(result.best, trainer_dtype=a.trainer_dtype, lora_rank=a.lora_rank, offload=a.offload,
                         kv_layout=a.kv_layout) if result.best else None)
    print(format_plan(result, _describe(a, shape, work, rates, (learner, engine)), flags), flush=True)
    return _as_json(a, shape, work, rates, result)


def plan_main(args: list[str]) -> None:
    """`asyncrl plan [...]`."""
    import tyro
    a = tyro.cli(PlanArgs, args=args, prog="asyncrl plan")
    try:
        out = run_plan(a)
    except ValueError as err:
        raise SystemExit(f"asyncrl plan: {err}") from None
    write_plan(a, out)


def write_plan(a: PlanArgs, out: dict) -> None:
    """--out's JSON; exits 1 when no layout fits."""
    if a.out:
        path = pathlib.Path(a.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
    if out["recommended"] is None:
        raise SystemExit(1)
