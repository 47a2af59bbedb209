"""Synchronous vs asynchronous training on the same devices: `asyncrl bench async`.

    asyncrl bench async --devices cuda:0 cuda:1 --model random:qwen2.5-0.5b --tokenizer smollm2 \\
        --data data/gsm8k/train.parquet --variants sync one-step-off stream stale-partial

Every variant is one real training run (the multi-process launcher, `asyncrl.launch.train.train`) with the same model,
data and hyperparameters; only the mode and the placement differ:

    sync           colocated: every device hosts a trainer rank (FSDP2) and an engine; generate, then train
                   (staleness 0, trigger 1, no partial rollout) — verl's colocated baseline; the engines free
                   their KV cache while training, as a run does by default (`sync:sleep=0` keeps it)
    one-step-off   split: generation of batch k+1 overlaps training on batch k (staleness 1, trigger 1, version
                   lag capped at 1 with lag policy "wait")
    stream         split: the trainer takes mini-batches as they stream in (staleness 0, trigger 4)
    stale-partial  split: fully async (staleness 0.5, trigger 4, partial rollout)

A variant may override knobs after a colon: `stale-partial:staleness=0.1,trigger=1,partial=0,slots=128,
prompts=16,lag=2,split=2+2` (prompts = --rollout.max-concurrent-prompts, the prompts an agent keeps in flight;
split = trainer devices + rollout devices, taken in order from --devices). Each mode trains the
same number of learner steps (`--steps`, or until `--time-budget-s`); the first version is a warm-up (model
build, CUDA-graph capture, pipeline fill) and is left out of the rates. Per variant: trained tokens/s, time
per learner step, samples/s, steps/s, trainer and rollouter idle ratios, version lag, weight-sync time
(beside a bare NCCL broadcast of the same bytes), queue utilisation, peak memory per role, GPU utilisation
(nvidia-smi) and reward against wall-clock. Writes results.json, bench_async.md and PNG plots to --out.

Each row also prints the rooflines it is measured against (`run_roofline`), in trained tokens/s: the
learner's FLOP bound (its devices at peak bf16 FLOP/s over `train_flops` per trained token, at the run's
mean prompt and response lengths) and the engine's bandwidth bound (each rollout device decoding `slots`
sequences a step, every bf16 weight and each sequence's K/V up to its mean context read once per step, at
the device's HBM bandwidth), and the bound of the mode: colocated, each device does both in turn
(1 / (1/learner + 1/engine)); split, the slower side. Null, with a note, on CPU or an unknown GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import multiprocessing
import pathlib
import shutil
import statistics
import subprocess
import threading
import time

import torch
import torch.distributed as dist

from asyncrl.config import GRPO, AsyncConfig, DataConfig, ModelConfig, OptimConfig, PlacementConfig, RolloutConfig, \
    RunConfig, TrainerConfig
from asyncrl.launch.train import train
from asyncrl.policies.loading import hf_config, load_model
from asyncrl.policies.model import CausalLM, TransformerConfig
from asyncrl.rpc.roles import free_port
from asyncrl.tracking.report import lag_by_length
from asyncrl_bench.engine import step_bytes
from asyncrl_bench.flops import body_params, train_flops
from asyncrl_bench.roofline import peak_bandwidth, peak_flops, unknown_peak_note

__all__ = ["AsyncBenchArgs", "MODES", "variant_config", "summarize", "broadcast_seconds", "bench_async"]

MODES: dict[str, dict] = {
    "sync": dict(staleness=0.0, trigger=1, partial=False, colocated=True),
    "one-step-off": dict(staleness=1.0, trigger=1, partial=False, lag=1),
    "stream": dict(staleness=0.0, trigger=4, partial=False),
    "stale-partial": dict(staleness=0.5, trigger=4, partial=True),
}
"""Mode -> knobs (verl's names: staleness_threshold, trigger_parameter_sync_step, partial_rollout; lag =
max_version_lag with lag policy "wait")."""


@dataclasses.dataclass
class AsyncBenchArgs:
    """Training runs of each mode on the same devices. Every flag that is a run's knob has that knob's default
    (`RunConfig` and its parts; the run's flag is named beside it), so a variant trains as `asyncrl train`
    would unless a flag says otherwise; the others choose the variants, the devices and the measurement."""

    variants: tuple[str, ...] = ("sync", "one-step-off", "stream", "stale-partial")
    """Modes to run, each optionally with overrides: `mode:key=value,...` (keys: staleness, trigger, partial,
    slots, prompts, lag, split, sleep)."""
    devices: tuple[str, ...] = ("cuda:0", "cuda:1")
    """The devices every variant gets (sync: all of them colocated; the others: split, default 1 trainer)."""
    model: str = "random:qwen2.5-0.5b"
    tokenizer: str | None = ModelConfig.tokenizer
    """Tokenizer for a 'random:' model reading --data (--model.tokenizer)."""
    data: str | None = DataConfig.path
    """Prompt file (verl parquet / JSONL); None = the built-in arithmetic task (--data.path)."""
    digits: int = DataConfig.digits
    """Arithmetic task (no --data): digits per operand (--data.digits)."""
    system_prompt: str | None = DataConfig.system_prompt
    """--data.system-prompt."""
    n: int = RolloutConfig.n
    """Responses per prompt (--rollout.n)."""
    mini_batch_size: int = TrainerConfig.mini_batch_size
    """Prompts per learner step (--trainer.mini-batch-size)."""
    max_new_tokens: int = RolloutConfig.max_new_tokens
    """--rollout.max-new-tokens."""
    max_prompt_length: int = RolloutConfig.max_prompt_length
    """--rollout.max-prompt-length."""
    temperature: float = RolloutConfig.temperature
    """--rollout.temperature (the learner's too)."""
    lr: float = OptimConfig.lr
    """--trainer.optim.lr."""
    slots: int = RolloutConfig.max_slots
    """Engine slots (sequences decoded together) per rollout device (--rollout.max-slots)."""
    steps: int = 12
    """Learner steps per variant (versions = steps / trigger, rounded up)."""
    time_budget_s: float | None = AsyncConfig.time_budget_s
    """Stop each variant after this many seconds instead (reward-vs-wall-clock comparisons;
    --async-training.time-budget-s)."""
    trainer_dtype: str = TrainerConfig.param_dtype
    """--trainer.param-dtype."""
    gradient_checkpointing: bool = TrainerConfig.gradient_checkpointing
    """--trainer.gradient-checkpointing."""
    max_tokens_per_micro_batch: int = TrainerConfig.max_tokens_per_micro_batch
    """--trainer.max-tokens-per-micro-batch."""
    seed: int = RunConfig.seed
    """--seed (also the model's and the data's)."""
    out: str = "runs/bench-async"
    sync_timeout_s: float = AsyncConfig.sync_timeout_s
    """Weight-sync timeout, also the trainer group's collective timeout (a hung collective is reported then;
    --async-training.sync-timeout-s)."""
    nccl_reference: bool = True
    """Time a bare broadcast of the model's bytes between the first two devices, for the weight-sync ratio."""
    threads_per_process: int = PlacementConfig.threads_per_process
    """torch intra-op threads per process (--placement.threads-per-process)."""


# ----------------------------------------------------------------------------------------- configs
def parse_variant(text: str) -> tuple[str, dict]:
    mode, _, rest = text.partition(":")
    if mode not in MODES:
        raise ValueError(f"variant {text!r}: unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    knobs = dict(MODES[mode])
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key in ("staleness",):
            knobs[key] = float(value)
        elif key in ("trigger", "slots", "lag", "prompts"):
            knobs[key] = int(value)
        elif key in ("partial", "sleep"):
            knobs[key] = value.lower() in ("1", "true", "on", "yes")
        elif key == "split":
            t, _, r = value.partition("+")
            knobs["split"] = (int(t), int(r))
        else:
            raise ValueError(f"variant {text!r}: unknown key {key!r}; use staleness, trigger, partial, slots, "
                             "prompts, lag, split (e.g. split=1+1) or sleep")
    return mode, knobs


def variant_config(args: AsyncBenchArgs, text: str) -> RunConfig:
    """The RunConfig of one variant: shared hyperparameters, the mode's knobs and placement."""
    mode, k = parse_variant(text)
    devices = list(args.devices)
    if k.get("colocated"):
        trainers = agents = devices
    else:
        t, r = k.get("split", (1, len(devices) - 1))
        if t < 1 or r < 1 or t + r > len(devices):
            raise ValueError(f"variant {text!r}: split {t}+{r} needs {t + r} of the {len(devices)} --devices "
                             "and at least one of each role")
        trainers, agents = devices[:t], devices[t:t + r]
    gpus = [d if d != "cuda" else "cuda:0" for d in trainers if d.startswith("cuda")]
    twice = next((d for d in gpus if gpus.count(d) > 1), None)
    if twice is not None:
        raise ValueError(f"variant {text!r}: --devices {' '.join(args.devices)} lists {twice} twice, and this variant "
                         f"runs a trainer rank on each of {' '.join(trainers)} (NCCL refuses two ranks on one GPU: "
                         "\"Duplicate GPU detected\"); list each GPU once in --devices")
    trigger = k["trigger"]
    name = text.replace(":", "_").replace(",", "_").replace("=", "").replace("+", "p")
    return RunConfig(
        model=ModelConfig(path=args.model, tokenizer=args.tokenizer, seed=args.seed),
        data=DataConfig(path=args.data, task="toy" if args.model.startswith("random:") and not args.tokenizer
                        else "arithmetic", digits=args.digits, system_prompt=args.system_prompt, seed=args.seed),
        algorithm=GRPO(clip_ratio_low=0.2, clip_ratio_high=0.28),
        rollout=RolloutConfig(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              max_prompt_length=args.max_prompt_length, max_slots=k.get("slots", args.slots),
                              max_concurrent_prompts=k.get("prompts")),
        trainer=TrainerConfig(mini_batch_size=args.mini_batch_size, temperature=args.temperature,
                              max_response_length=args.max_new_tokens, param_dtype=args.trainer_dtype,
                              gradient_checkpointing=args.gradient_checkpointing,
                              max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                              optim=OptimConfig(lr=args.lr)),
        async_training=AsyncConfig(staleness_threshold=k["staleness"], trigger_parameter_sync_step=trigger,
                                   partial_rollout=k["partial"], colocated=bool(k.get("colocated")),
                                   colocated_sleep=k.get("sleep", AsyncConfig.colocated_sleep),
                                   max_version_lag=k.get("lag"),
                                   lag_policy="wait" if k.get("lag") is not None else "drop",
                                   total_versions=math.ceil(args.steps / trigger) + 1,  # + the warm-up version
                                   time_budget_s=args.time_budget_s, sync_timeout_s=args.sync_timeout_s),
        placement=PlacementConfig(launcher="rpc", trainer_devices=tuple(trainers), agent_devices=tuple(agents),
                                  threads_per_process=args.threads_per_process),
        run_dir=str(pathlib.Path(args.out) / name), wandb="off", seed=args.seed,
    )


# -------------------------------------------------------------------------------------- measuring
class GpuSampler:
    """nvidia-smi in the background: (time, gpu index, utilisation %, memory MiB) twice a second."""

    def __init__(self):
        self.rows: list[tuple[float, int, float, float]] = []
        self._proc = None
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 "-lms", "500"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self._proc.stdout:
            try:
                i, util, mem = (float(x) for x in line.split(","))
                self.rows.append((time.time(), int(i), util, mem))
            except ValueError:
                continue

    def stop(self):
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(5)

    def window(self, start: float, end: float, gpus: list[int]) -> dict:
        out = {}
        for g in gpus:
            rows = [(u, m) for t, i, u, m in self.rows if i == g and start <= t <= end]
            if rows:
                out[f"gpu{g}/util_mean"] = statistics.fmean(u for u, _ in rows)
                out[f"gpu{g}/mem_max_gib"] = max(m for _, m in rows) / 1024
        return out


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def summarize(run_dir: str | pathlib.Path, *, n: int, warmup_versions: int = 1) -> dict:
    """Rates over the versions after the warm-up, from a run's metrics.jsonl (verl's metric names)."""
    rows = [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    if len(rows) <= warmup_versions:
        raise ValueError(f"{run_dir}: {len(rows)} versions logged, need more than the {warmup_versions} warm-up "
                         "version(s); raise --steps")
    warm, measured = rows[warmup_versions - 1] if warmup_versions else None, rows[warmup_versions:]
    wall = measured[-1]["wall_s"] - (warm["wall_s"] if warm else 0.0)
    steps = measured[-1]["training/global_step"] - (warm["training/global_step"] if warm else 0)
    previous = [warm["training/global_step"] if warm else 0] + [r["training/global_step"] for r in measured[:-1]]
    groups = sum(r["training/num_groups"] * (r["training/global_step"] - p) for r, p in zip(measured, previous))
    tokens = sum(r["perf/total_num_tokens"] for r in measured)
    lag = [r.get("training/version_lag/mean") for r in measured]
    util = [r["fully_async/count/staleness_samples"] / r["fully_async/static/max_required_samples"]
            for r in measured if r.get("fully_async/static/max_required_samples")]
    return {
        "versions_measured": len(measured), "steps_measured": steps, "wall_s": wall,
        "tokens_per_s": tokens / wall, "time_per_step_s": wall / max(steps, 1), "steps_per_s": steps / wall,
        "samples_per_s": groups * n / wall,
        "trainer_idle_ratio": _mean(measured, "trainer/idle_ratio"),
        "rollouter_idle_ratio": _mean(measured, "rollouter/idle_ratio"),
        "version_lag_mean": statistics.fmean(x for x in lag if x is not None) if any(x is not None for x in lag) else None,
        "version_lag_max": max((r.get("training/version_lag/max", 0) for r in measured), default=0),
        "param_sync_s": _mean(measured, "timing_s/param_sync"),
        "param_transfer_s": _mean(measured, "timing_s/param_transfer"),
        "queue_utilisation": statistics.fmean(util) if util else None,
        "trainer_max_memory_gib": max((r.get("perf/max_memory_allocated_gb", 0) for r in rows), default=0),
        "rollouter_max_memory_gib": max((r.get("rollouter/max_memory_allocated_gb", 0) for r in rows), default=0),
        "response_length_mean": _mean(measured, "response_length/mean"),
        "tokens_measured": tokens, "rows_measured": groups * n,
        "response_tokens_measured": sum(r.get("perf/response_tokens", 0) for r in measured),
        "lag_by_length": {str(bucket): [count, mean] for bucket, (count, mean) in lag_by_length(measured).items()},
        "reward_first": rows[0].get("critic/score/mean"), "reward_last": rows[-1].get("critic/score/mean"),
        "curve": [(r["wall_s"], r.get("critic/score/mean"), r["step"]) for r in rows],
        "_window": (warm["wall_s"] if warm else 0.0, measured[-1]["wall_s"]),
    }


def _broadcast_member(rank: int, port: int, devices: list[str], numel: int, repeats: int, results) -> None:
    device = torch.device(devices[rank])
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    flat = torch.randn(numel, device=device).to(torch.bfloat16)
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.broadcast(flat, src=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:  # two warm-ups: communicator setup
            times.append(time.perf_counter() - start)
    if rank == 1:
        results.put(statistics.median(times))
    dist.destroy_process_group()


def broadcast_seconds(num_bytes: int, devices: list[str], repeats: int = 10) -> float:
    """Median seconds of one bare torch.distributed broadcast of `num_bytes` (bf16) between two processes."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_broadcast_member, args=(r, port, devices, num_bytes // 2, repeats, results))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        return results.get(timeout=300)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()


def weight_bytes(model: str, dtype: str = "bfloat16") -> int:
    """Bytes a publication moves: every weight (tied lm_head once) in the engine's dtype."""
    m = load_model(model, dtype=getattr(torch, dtype), device="meta") if model.startswith("random:") else \
        load_model(model, dtype=getattr(torch, dtype))
    tied = getattr(m.config, "tie_word_embeddings", False)
    return sum(t.numel() * t.element_size() for name, t in m.state_dict().items()
               if not (tied and name == "lm_head.weight"))


def _meta_model(name: str):
    """`name`'s architecture in bf16 on the meta device (no weights read), or None when it is no preset or
    config.json (a GGUF file, a Hub name)."""
    if name.startswith("random:"):
        return load_model(name, dtype=torch.bfloat16, device="meta")
    try:
        config = TransformerConfig.from_hf(hf_config(name))
    except ValueError:
        return None
    with torch.device("meta"):
        return CausalLM(config).to(torch.bfloat16)


def run_roofline(row: dict, model, *, colocated: bool) -> dict:
    """The trained tokens/s bounds of one variant's row (module docstring): `learner_bound_tok_s`,
    `engine_bound_tok_s`, `roofline_tok_s` and the fraction of it the run reached; null with a note where
    the devices' peaks are unknown or the architecture could not be read."""
    trainers, agents = row["trainer_devices"], row["agent_devices"]
    flops, bandwidth = peak_flops(trainers[0]), peak_bandwidth(agents[0])
    rows, tokens, response = row["rows_measured"], row["tokens_measured"], row["response_tokens_measured"]
    out = {"learner_bound_tok_s": None, "engine_bound_tok_s": None, "roofline_tok_s": None, "roofline_fraction": None}
    if model is None or flops is None or bandwidth is None or not (rows and tokens and response):
        why = ("architecture unknown (no preset or config.json)" if model is None else
               "no tokens measured" if not (rows and tokens and response) else
               unknown_peak_note(trainers[0] if flops is None else agents[0], "FLOP/s or bandwidth"))
        return {**out, "roofline_note": why}
    prompt_len, response_len = (tokens - response) / rows, response / rows
    per_token = train_flops(model.config, body_params(model), [(prompt_len, response_len)]) / (prompt_len + response_len)
    learner = len(trainers) * flops / per_token
    decode_step = step_bytes(model, row["slots"], int(prompt_len + response_len / 2))
    engine = len(agents) * row["slots"] * bandwidth / decode_step * tokens / response
    bound = 1 / (1 / learner + 1 / engine) if colocated else min(learner, engine)
    return {"learner_bound_tok_s": learner, "engine_bound_tok_s": engine, "roofline_tok_s": bound,
            "roofline_fraction": row["tokens_per_s"] / bound}


# ------------------------------------------------------------------------------------------ the run
def bench_async(args: AsyncBenchArgs) -> list[dict]:
    """Run every variant (each a real training run), print and write the table, results.json and plots."""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [(v, variant_config(args, v)) for v in args.variants]  # every variant parses before any runs
    for _, cfg in configs:
        cfg.validate()
    reference = None
    if args.nccl_reference and len(args.devices) >= 2:
        num_bytes = weight_bytes(args.model)
        reference = {"bytes": num_bytes, "seconds": broadcast_seconds(num_bytes, list(args.devices[:2]))}
        print(f"[bench async] bare broadcast of {num_bytes / 2**20:.0f} MiB: {reference['seconds'] * 1e3:.1f} ms",
              flush=True)
    sampler = GpuSampler()
    results = []
    model = _meta_model(args.model)
    try:
        for text, cfg in configs:
            shutil.rmtree(cfg.run_dir, ignore_errors=True)
            print(f"[bench async] {text}: trainers {cfg.placement.trainer_devices}, rollout "
                  f"{cfg.placement.agent_devices}, {cfg.async_training.total_versions} versions", flush=True)
            start = time.time()
            try:
                summary = train(cfg)
            except Exception as err:  # noqa: BLE001 - one failed variant is reported, the others still run
                print(f"[bench async] {text} FAILED: {err!r}", flush=True)
                results.append({"variant": text, "error": repr(err)})
                _write(out, results, reference)
                continue
            row = {"variant": text, "trainer_devices": list(cfg.placement.trainer_devices),
                   "agent_devices": list(cfg.placement.agent_devices),
                   "staleness": cfg.async_training.staleness_threshold,
                   "trigger": cfg.async_training.trigger_parameter_sync_step,
                   "partial": cfg.async_training.partial_rollout, "slots": cfg.rollout.max_slots,
                   "run_wall_s": time.time() - start, "ledger": summary.ledger,
                   **summarize(cfg.run_dir, n=cfg.rollout.n)}
            lo, hi = row.pop("_window")
            gpus = sorted({int(d.split(":")[1]) for d in cfg.placement.trainer_devices + cfg.placement.agent_devices
                           if d.startswith("cuda:")})
            row.update(sampler.window(start + lo, start + hi, gpus))
            row.update(run_roofline(row, model, colocated=cfg.async_training.colocated))
            results.append(row)
            _write(out, results, reference)
            print("[bench async] " + _line(row), flush=True)
    finally:
        sampler.stop()
    _plots(out, results)
    print(_table(results, reference))
    return results


def _line(r: dict) -> str:
    bound = (f"roofline {r['roofline_tok_s']:,.0f} tok/s (learner {r['learner_bound_tok_s']:,.0f}, engine "
             f"{r['engine_bound_tok_s']:,.0f}): {r['roofline_fraction']:.1%}" if r.get("roofline_tok_s")
             else f"roofline null: {r.get('roofline_note')}")
    return (f"{r['variant']}: {r['tokens_per_s']:,.0f} tok/s, {r['time_per_step_s']:.2f} s/step, idle trainer "
            f"{r['trainer_idle_ratio'] or 0:.2f} rollout {r['rollouter_idle_ratio'] or 0:.2f}, lag "
            f"{r['version_lag_mean'] or 0:.2f}, sync {(r['param_sync_s'] or 0) * 1e3:.0f} ms; {bound}")


def _fmt(x, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def _table(results: list[dict], reference: dict | None) -> str:
    ok = [r for r in results if "error" not in r]
    base = next((r["tokens_per_s"] for r in ok if r["variant"] == "sync"), None)
    lines = ["| variant | trainer+rollout devices | tokens/s | roofline tok/s (reached) | × sync | s/step | samples/s | "
             "idle trainer | idle rollout | lag mean/max | sync ms (transfer) | queue util | mem GiB trainer/rollout | "
             "reward first→last |", "|" + "---|" * 14]
    for r in ok:
        ratio = f"{r['tokens_per_s'] / base:.2f}×" if base else "–"
        lines.append(
            f"| {r['variant']} | {len(r['trainer_devices'])}+{len(r['agent_devices'])}"
            f"{' (colocated)' if r['variant'].startswith('sync') else ''} | {r['tokens_per_s']:,.0f} | "
            f"{_fmt(r.get('roofline_tok_s'), ',.0f')} ({_fmt(r.get('roofline_fraction'), '.1%')}) | {ratio} | "
            f"{r['time_per_step_s']:.2f} | {r['samples_per_s']:.1f} | {_fmt(r['trainer_idle_ratio'], '.2f')} | "
            f"{_fmt(r['rollouter_idle_ratio'], '.2f')} | {_fmt(r['version_lag_mean'], '.2f')}/{r['version_lag_max']} | "
            f"{_fmt((r['param_sync_s'] or 0) * 1e3, '.0f')} ({_fmt((r['param_transfer_s'] or 0) * 1e3, '.0f')}) | "
            f"{_fmt(r['queue_utilisation'], '.2f')} | {r['trainer_max_memory_gib']:.1f}/{r['rollouter_max_memory_gib']:.1f} | "
            f"{_fmt(r['reward_first'], '.3f')}→{_fmt(r['reward_last'], '.3f')} |")
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | FAILED: {r['error'][:120]} |")
    lines += _lag_by_length_table(ok)
    if reference:
        lines.append(f"\nBare broadcast of the {reference['bytes'] / 2**20:.0f} MiB of weights between two devices: "
                     f"{reference['seconds'] * 1e3:.1f} ms.")
    return "\n".join(lines)


def _lag_by_length_table(results: list[dict]) -> list[str]:
    """The trained samples' mean version lag by response length (the measured versions), a row per variant: where a
    run's staleness lives (long responses span publications)."""
    buckets = sorted({int(b) for r in results for b in r.get("lag_by_length") or {}})
    if not buckets:
        return []
    lines = ["", "Mean version lag (trained samples) by response length, tokens:", "",
             "| variant | " + " | ".join(f"≤ {b}" for b in buckets) + " |", "|" + "---|" * (len(buckets) + 1)]
    for r in results:
        cells = r.get("lag_by_length") or {}
        lines.append(f"| {r['variant']} | " + " | ".join(
            f"{cells[str(b)][1]:.2f} ({cells[str(b)][0]})" if str(b) in cells else "–" for b in buckets) + " |")
    return lines


def _write(out: pathlib.Path, results: list[dict], reference: dict | None) -> None:
    (out / "results.json").write_text(json.dumps({"reference_broadcast": reference, "variants": results}, indent=1))
    (out / "bench_async.md").write_text(_table(results, reference) + "\n")


def _plots(out: pathlib.Path, results: list[dict]) -> None:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in ok:
        xs = [w for w, s, _ in r["curve"] if s is not None]
        left.plot(xs, [s for _, s, _ in r["curve"] if s is not None], marker=".", label=r["variant"])
    left.set(xlabel="wall-clock (s)", ylabel="mean reward (critic/score/mean)", title="reward vs wall-clock")
    left.legend(fontsize=8)
    right.barh([r["variant"] for r in ok], [r["tokens_per_s"] for r in ok], color="tab:blue")
    right.set(xlabel="trained tokens/s (after the warm-up version)", title="throughput")
    fig.tight_layout()
    fig.savefig(out / "bench_async.png", dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    import tyro
    bench_async(tyro.cli(AsyncBenchArgs, args=argv, prog="asyncrl bench async"))
