"""Does async reach a held-out target sooner than sync in wall-clock? Races on the same devices, equal budgets.

    python -m scripts.wallclock_race --model smollm2 --devices cuda:0 cuda:1 --seeds 0 1 2 3 4 --budget-s 600 \
      --data-path data/gsm8k-calc/train.parquet --eval-data-path data/gsm8k-calc/test.parquet --target 0.5 \
      --out runs/race                                                                            # repo root
    python -m scripts.wallclock_race --model random:tiny-smollm2 --tokenizer smollm2 --devices cpu cpu \
      --seeds 0 --budget-s 20 --warmup-s 0 --target 0.1 --out runs/race-cpu                                  # a smoke race

Two modes, each run once per seed, one after the other, on the same `--devices`:

    sync    colocated: a trainer rank and its engine on every device (FSDP2 over them), staleness 0, trigger 1
    async   stale + partial: the first device trains, the others generate (staleness 0.5, trigger 1, partial
            rollout, the default correction)

Before the first measured run, each mode trains once for `--warmup-s` seconds, unrecorded, so that no measured run
compiles its kernels. Every run trains for `--budget-s` seconds (`--async-training.time-budget-s`) and evaluates its weights every
`--eval-every` versions on the held-out prompts (`--eval.*`, beside training). Its curve is the held-out accuracy
at the time each evaluated version was published, from the first version (`asyncrl_bench.wallclock`): process
start-up is left out, and so is the evaluation's own time. The race: each run's time to `--target`, and the
ratio of the modes' medians (async / sync) with a 95 % bootstrap interval. Writes each run's directory, race.json,
race.md and race.png (accuracy against wall-clock and against samples) to --out; a run whose directory holds a
summary.json is not run again.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

from asyncrl.config import (
    GRPO, AsyncConfig, DataConfig, EvalConfig, ModelConfig, OptimConfig, PlacementConfig, RolloutConfig, RunConfig,
    TrainerConfig,
)
from asyncrl.launch.train import train
from asyncrl.tracking import read_metrics
from asyncrl_bench.wallclock import held_out_curve, race_summary, time_to_target
from asyncrl_bench.plots import pyplot_or_none

__all__ = ["RaceArgs", "MODES", "race_config", "warmup_configs", "run_race"]

MODES = ("sync", "async")


@dataclasses.dataclass
class RaceArgs:
    """The races. A flag that is a run's knob keeps that knob's default unless the race sets it, which it says."""

    model: str = ModelConfig.path
    """--model.path."""
    tokenizer: str | None = ModelConfig.tokenizer
    """--model.tokenizer (for a 'random:' model)."""
    devices: tuple[str, ...] = ("cpu", "cpu")
    """The devices both modes use: sync a trainer rank and an engine on each, async the first trains, the rest
    generate."""
    seeds: tuple[int, ...] = (0,)
    modes: tuple[str, ...] = MODES
    budget_s: float = 600.0
    """Seconds of training each run gets (--async-training.time-budget-s): equal wall-clock."""
    target: float = 0.5
    """The held-out accuracy a run races to."""
    data_path: str | None = None
    """Training prompts (--data.path); None: the built-in two-digit sums."""
    eval_data_path: str | None = None
    """Held-out prompts (--eval.data); required with --data-path (the built-in sums draw their own)."""
    system_prompt: str = "Reply with the result only."
    """--data.system-prompt, the race's own (the answer alone)."""
    lr: float = 1e-5
    """--trainer.optim.lr, the race's own."""
    n: int = RolloutConfig.n
    mini_batch_size: int = TrainerConfig.mini_batch_size
    max_new_tokens: int = 32
    """The race's own: an answer fits (--rollout.max-new-tokens)."""
    max_prompt_length: int = 96
    slots: int = 128
    """--rollout.max-slots, the race's own."""
    eval_every: int = 4
    """--eval.every-versions, the race's own (with --eval-every-s, 0 turns it off)."""
    eval_every_s: float = 0.0
    """--eval.every-seconds (0: off): evaluations as often in wall-clock in both modes, where every K versions
    evaluates the mode with more versions a second more often."""
    eval_prompts: int = 256
    """--eval.max-prompts, the race's own."""
    eval_n: int = 4
    """--eval.n, the race's own (at the training temperature)."""
    warmup_s: float = 30.0
    """Seconds of an unrecorded run of each mode before the first measured run (0: none), so that no measured run
    pays for compiling its kernels: the compilation caches stay on disk between runs. A race without it ran its
    first run's first step in 40 s against 12.5-15 s for the runs after it (2 x H200, 2026-11-29). A warm-up run
trains at least one version, however short its budget."""
    max_versions: int = 100_000
    """--async-training.total-versions: high, so that the budget ends every run."""
    out: str = "runs/race"


def _run_dir(args: RaceArgs, mode: str, seed: int) -> pathlib.Path:
    return pathlib.Path(args.out) / mode / f"seed{seed}"


def race_config(args: RaceArgs, mode: str, seed: int) -> RunConfig:
    """The RunConfig of one (mode, seed)."""
    if mode not in MODES:
        raise ValueError(f"--modes {mode}: choose from {', '.join(MODES)}")
    if len(args.devices) < 2:
        raise ValueError(f"--devices {' '.join(args.devices)}: give at least 2 (async trains on the first and "
                         "generates on the others)")
    if (args.data_path is None) != (args.eval_data_path is None):
        missing = "--eval-data-path" if args.eval_data_path is None else "--data-path"
        raise ValueError(f"{missing} is needed with the other: a prompt-file race evaluates on a held-out file")
    sync = mode == "sync"
    data = (DataConfig(path=args.data_path, system_prompt=args.system_prompt, seed=seed) if args.data_path else
            DataConfig(task="arithmetic", digits=2, operators="+", system_prompt=args.system_prompt, seed=seed))
    return RunConfig(
        model=ModelConfig(path=args.model, tokenizer=args.tokenizer, seed=seed),
        data=data,
        algorithm=GRPO(clip_ratio_low=0.2, clip_ratio_high=0.28),
        rollout=RolloutConfig(n=args.n, max_new_tokens=args.max_new_tokens, max_prompt_length=args.max_prompt_length,
                              max_slots=args.slots),
        trainer=TrainerConfig(mini_batch_size=args.mini_batch_size, max_response_length=args.max_new_tokens,
                              optim=OptimConfig(lr=args.lr)),
        async_training=AsyncConfig(staleness_threshold=0.0 if sync else 0.5, trigger_parameter_sync_step=1,
                                   partial_rollout=not sync, colocated=sync, total_versions=args.max_versions,
                                   time_budget_s=args.budget_s),
        eval=EvalConfig(data=(args.eval_data_path,) if args.eval_data_path else (), every_versions=args.eval_every,
                        every_seconds=args.eval_every_s, at_end=True, n=args.eval_n, temperature=1.0,
                        max_prompts=args.eval_prompts),
        placement=PlacementConfig(launcher="rpc", trainer_devices=tuple(args.devices) if sync else args.devices[:1],
                                  agent_devices=tuple(args.devices) if sync else tuple(args.devices[1:])),
        run_dir=str(_run_dir(args, mode, seed)), wandb="off", seed=seed, checkpoint_every=0,
    )


def warmup_configs(args: RaceArgs) -> dict[str, RunConfig]:
    """Each mode's unrecorded warm-up run (`--warmup-s` of training, in <out>/warmup/<mode>); none when 0."""
    if args.warmup_s <= 0:
        return {}
    short = dataclasses.replace(args, budget_s=args.warmup_s)
    return {mode: dataclasses.replace(race_config(short, mode, args.seeds[0]),
                                      run_dir=str(pathlib.Path(args.out) / "warmup" / mode)) for mode in args.modes}


def _samples_per_version(cfg: RunConfig) -> int:
    return cfg.trainer.mini_batch_size * cfg.async_training.require_batches * cfg.rollout.n


def run_race(args: RaceArgs) -> dict:
    """Every (mode, seed) not yet run, one at a time; then the race's summary (race.json, race.md, race.png)."""
    out = pathlib.Path(args.out)
    configs = {(mode, seed): race_config(args, mode, seed) for seed in args.seeds for mode in args.modes}
    warmups = warmup_configs(args)
    for cfg in [*configs.values(), *warmups.values()]:
        cfg.validate()  # every run checks before any starts
    to_run = {key: cfg for key, cfg in configs.items() if not (pathlib.Path(cfg.run_dir) / "summary.json").is_file()}
    cold = {mode: cfg for mode, cfg in warmups.items() if not (pathlib.Path(cfg.run_dir) / "summary.json").is_file()}
    for mode, cfg in cold.items() if to_run else {}.items():  # nothing to measure: nothing to warm up
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        print(f"[race] warming up {mode}: {args.warmup_s:.0f} s, not recorded", flush=True)
        train(cfg)
    for (mode, seed), cfg in to_run.items():
        shutil.rmtree(cfg.run_dir, ignore_errors=True)  # no summary: an unfinished attempt
        print(f"[race] {mode} seed {seed}: {args.budget_s:.0f} s of training", flush=True)
        train(cfg)
    runs = []
    for (mode, seed), cfg in configs.items():
        curve = held_out_curve(read_metrics(cfg.run_dir))
        runs.append({"mode": mode, "seed": seed, "time_to_target": time_to_target(curve, args.target),
                     "final": curve[-1].accuracy if curve else None, "samples_per_version": _samples_per_version(cfg),
                     "curve": [list(p) for p in curve]})
    times = {mode: [r["time_to_target"] for r in runs if r["mode"] == mode] for mode in args.modes}
    race = race_summary(times["sync"], times["async"])._asdict() if set(MODES) <= set(args.modes) else None
    result = {"args": dataclasses.asdict(args), "runs": runs, "race": race}
    out.mkdir(parents=True, exist_ok=True)
    (out / "race.json").write_text(json.dumps(result, indent=1))
    text = _markdown(args, runs, race)
    (out / "race.md").write_text(text)
    _plot(runs, args.target, out / "race.png")
    print(text)
    return result


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f}"


def _markdown(args: RaceArgs, runs: list[dict], race: dict | None) -> str:
    lines = [f"Time from the first version to held-out accuracy {args.target} ({args.budget_s:.0f} s of training a "
             "run):", "", "| mode | seed | seconds to the target | last evaluation | evaluations |", "|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['seed']} | {_seconds(r['time_to_target'])} | "
              f"{'–' if r['final'] is None else format(r['final'], '.3f')} | {len(r['curve'])} |" for r in runs]
    if race is not None:
        lines += ["", f"Median async / sync: {race['ratio']:.2f} (95 % bootstrap {race['ci_low']:.2f} – "
                      f"{race['ci_high']:.2f}); medians {_seconds(race['async_median'])} s against "
                      f"{_seconds(race['sync_median'])} s; reached: async {race['async_reached']}, sync "
                      f"{race['sync_reached']} runs."]
        if race["ci_low"] == 0 and race["async_reached"]:
            lines += ["", "The interval's low end is 0: some resamples of sync's runs have a median that never reached "
                          "the target (async / never)."]
    return "\n".join(lines) + "\n"


def _plot(runs: list[dict], target: float, path: pathlib.Path) -> None:
    plt = pyplot_or_none(path, "race")
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, mode in enumerate(MODES):
        for j, r in enumerate(x for x in runs if x["mode"] == mode):
            if not r["curve"]:
                continue
            seconds, accuracy, versions = zip(*r["curve"])
            label = mode if j == 0 else None
            left.plot(seconds, accuracy, color=f"C{i}", alpha=0.7, marker="o", markersize=3, label=label)
            right.plot([v * r["samples_per_version"] for v in versions], accuracy, color=f"C{i}", alpha=0.7,
                       marker="o", markersize=3, label=label)
    for ax, xlabel in ((left, "seconds from the first version"), (right, "trained samples")):
        ax.axhline(target, color="gray", ls="--", lw=1)
        ax.set(xlabel=xlabel, ylabel="held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import tyro
    run_race(tyro.cli(RaceArgs))
