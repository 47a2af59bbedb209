"""Does asynchrony cost accuracy, and does the off-policy correction matter? The learning-quality grid.

    python -m scripts.learning_grid --model smollm2 --devices cuda:0 cuda:0 --parallel 6 --out runs/grid  # repo root
    python -m scripts.learning_grid --model smollm2 --devices cpu cpu --steps 48 --seeds 0 --out runs/grid-cpu

Every cell trains the same model on the same task for the same number of learner steps (so the same number of
samples, `--steps` × `--mini-batch-size` × `--n`), once per seed; only the mode and the correction differ:

    sync            colocated: one process generates a batch, then trains on it (staleness 0, trigger 1)
    stale-partial   fully async, 1 trainer + 1 rollout process: staleness 0.5, trigger 4, partial rollout,
                    the default correction (behaviour log-probs as π_old)
    lag-naive       the bypass cell: a forced lag, staleness --lag, trigger 1, no partial rollout, so the rollout
                    runs up to --lag versions ahead of the trainer; behaviour log-probs as π_old (PPO's clip around
                    μ, the sampler), no importance weights
    lag-ignore-mu   the same lag, π_old recomputed with the learner's weights and μ ignored: no importance weights,
                    no rejection, the clip around a policy that did not sample the data (the "naive PPO under
                    staleness" of the literature; docs/staleness.md says why not to do it). With one update a step
                    π_θ = π_old at the update, so the clip never acts: a policy gradient on stale samples as if
                    they were fresh
    lag-opsm        lag-naive with off-policy sequence masking: a negative-advantage sequence whose mean
                    log μ − log π_θ exceeds --opsm-threshold δ gets no loss
    lag-ess         lag-naive with the ESS-scaled step: each update's learning rate times the normalised effective
                    sample size of its ratios π_θ/μ
    lag-drift-budget  lag-naive with a drift budget (--drift-budget nats a token of KL(μ‖π_θ)): publication is
                    held back at the lag whose predicted drift fits it, so the lag realised may stay below --lag
    lag-corrected   the same lag, corrected: decoupled PPO (proximal log-probs recomputed with the learner's
                    weights before the update, the clip around them) with token-level truncated importance
                    weights π_prox/μ (C = 2)
    lag-rejected    lag-corrected, and tokens whose π_prox/μ lies outside [1/2, 2] get no loss (token rejection)
    lag-m2po        the same lag, decoupled PPO with M2PO's second-moment trust region instead of weights: the
                    fewest tokens of largest (log π_prox − log μ)² get no loss, keeping the step's mean below 0.04
    lag-dec-m2      lag-corrected with M = 2 updates per learner step: the step's groups split into 2 mini-batches
                    of half the size, one optimizer step each, π_prox recomputed once before the first, so from the
                    second update on π_θ ≠ π_prox and the decoupled clip acts (verl's ppo_mini_batch_size)
    lag-dec-m4      the same with M = 4 (mini-batches of a quarter)
    lag-m2po-m4     lag-m2po with M = 4
    sync-dec-m2     sync with lag-dec-m2's updates and correction: what M updates per step cost without a lag
    sync-dec-m4     the same with M = 4
    sync-tis        sync with lag-corrected's correction (π_old recomputed, token TIS π_prox/μ, C = 2): what the
                    correction does where the rollout is the learner's policy in the same dtype
    sync-fp8        sync-tis with the rollout's K/V cache in float8 e4m3 (--rollout.kv-dtype fp8): the train-rollout
                    mismatch fp8 adds (rollout_corr/mismatch_kl in the curve) and what the correction absorbs of it
    lag-corrected-fp8  lag-corrected with fp8 K/V: the mismatch on top of the lag

Every cell trains `--mini-batch-size` groups per learner step; a cell of M updates per step does so as M
mini-batches of `--mini-batch-size` / M groups (`--async-training.require-batches M`), so versions, samples
and the rollout's admission per version (hence the lag in versions) are those of the one-update cells.

The task is the built-in two-digit sums, or a prompt file (`--data-path`, e.g. the GSM8K-calc prompts of
`asyncrl data convert-gsm8k-calc`), evaluated on another file (`--eval-data-path`, its first `--eval-prompts`
rows). A run ends with a checkpoint, which is evaluated on prompts of another task seed (`--eval-seed`) at the
training temperature; the pre-registered evaluation of docs/staleness.md is `--eval-prompts 1024 --eval-n 8`.
Per cell: the final evaluation accuracy and the training reward over the last quarter of the steps, mean ± std
over seeds, the version lag that was actually trained on, the drift from the behaviour policy (the means over
steps of actor/behaviour_kl, the k3 estimate of KL(μ‖π_θ), and of its k1 estimate actor/behaviour_k1), and the
run's means of the PPO clip fraction and of the behaviour/proximal mismatch KL (only the cells that recompute
π_prox record it). Every step's curve keeps the drift metrics (and OPSM's masked fraction, the ESS-scaled step's
lr scale and the drift budget's lag cap where a cell logs them); `scripts/staleness_analysis.py` reads them.
Writes one directory per run (its metrics.jsonl and result.json), then results.json, learning_grid.md and
learning_grid.png to --out. A run whose result.json exists is not run again: an interrupted grid resumes where
it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import time

from asyncrl.config import (
    GRPO, AsyncConfig, DataConfig, ModelConfig, OffPolicyConfig, OptimConfig, PlacementConfig, RolloutConfig,
    RunConfig, TrainerConfig,
)
from asyncrl.evaluate import evaluate
from asyncrl.launch.train import train
from asyncrl.tracking import read_metrics
from asyncrl_bench.plots import pyplot_or_none

__all__ = ["GridArgs", "CELLS", "CORRECTIONS", "cell_config", "run_one", "aggregate", "table", "run_grid"]

CELLS: dict[str, dict] = {
    "sync": dict(staleness=0.0, trigger=1, partial=False, colocated=True, correction="none", updates=1),
    "stale-partial": dict(staleness=0.5, trigger=4, partial=True, colocated=False, correction="none", updates=1),
    "lag-naive": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="none", updates=1),
    "lag-ignore-mu": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="ignore-mu",
                          updates=1),
    "lag-opsm": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="opsm", updates=1),
    "lag-ess": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="ess", updates=1),
    "lag-drift-budget": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="none", updates=1,
                             drift_budget=True),
    "lag-corrected": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="tis", updates=1),
    "lag-rejected": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="tis+rs", updates=1),
    "lag-m2po": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="m2po", updates=1),
    "lag-dec-m2": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="tis", updates=2),
    "lag-dec-m4": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="tis", updates=4),
    "lag-m2po-m4": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="m2po", updates=4),
    "sync-dec-m2": dict(staleness=0.0, trigger=1, partial=False, colocated=True, correction="tis", updates=2),
    "sync-dec-m4": dict(staleness=0.0, trigger=1, partial=False, colocated=True, correction="tis", updates=4),
    "sync-tis": dict(staleness=0.0, trigger=1, partial=False, colocated=True, correction="tis", updates=1),
    "sync-fp8": dict(staleness=0.0, trigger=1, partial=False, colocated=True, correction="tis", updates=1,
                     kv_dtype="fp8"),
    "lag-corrected-fp8": dict(staleness=None, trigger=1, partial=False, colocated=False, correction="tis",
                              updates=1, kv_dtype="fp8"),
}
"""Cell -> knobs; staleness None means --lag; correction names an entry of CORRECTIONS; updates = optimizer steps
per learner step (mini-batches of --mini-batch-size / updates groups); drift_budget (where present) bounds the lag
by --drift-budget (`AsyncConfig.drift_budget`); kv_dtype (where present) is --rollout.kv-dtype (default auto)."""

CORRECTIONS: dict[str, OffPolicyConfig] = {
    "none": OffPolicyConfig(),
    "tis": OffPolicyConfig(use_rollout_log_probs=False, is_level="token", is_threshold=2.0),
    "tis+rs": OffPolicyConfig(use_rollout_log_probs=False, is_level="token", is_threshold=2.0, rs_stat="k1",
                              rs_level="token", rs_upper=2.0),
    "m2po": OffPolicyConfig(use_rollout_log_probs=False, m2_threshold=0.04),
    "ignore-mu": OffPolicyConfig(use_rollout_log_probs=False),
    "opsm": OffPolicyConfig(opsm_threshold=0.1),
    "ess": OffPolicyConfig(ess_scaled_lr=True),
}
"""The off-policy settings of the cells: behaviour log-probs as π_old (bypass); decoupled PPO with token TIS
(C = 2); the same plus token rejection of π_prox/μ outside [1/2, 2] (IcePop-style masking); decoupled PPO with
M2PO (τ = 0.04, arXiv:2510.01161); π_old recomputed with μ ignored (no weights, no rejection or masking: every
other field at its default); bypass with OPSM (DeepSeek-V3.2; `cell_config` sets δ to --opsm-threshold); bypass
with the ESS-scaled step (VCPO, arXiv:2602.17616)."""


@dataclasses.dataclass
class GridArgs:
    """The grid's runs. A flag that is a run's knob keeps that knob's default (`RunConfig` and its parts; the
    run's flag is named beside it) unless it is part of the grid's experiment, which says so: the task (two-digit
    sums with a system prompt, their lengths), the learning rate, the rollout's slots and a longer sync timeout."""

    model: str = ModelConfig.path
    """--model.path."""
    tokenizer: str | None = ModelConfig.tokenizer
    """Tokenizer for a 'random:' model (smoke runs; --model.tokenizer)."""
    devices: tuple[str, str] = ("cpu", "cpu")
    """Trainer device, rollout device (sync puts both roles on the first)."""
    cells: tuple[str, ...] = tuple(CELLS)
    seeds: tuple[int, ...] = (0, 1, 2)
    digits: int = 2
    """The grid's task, the built-in arithmetic: two-digit sums (--data.digits, the grid's own)."""
    system_prompt: str = "Reply with the result only."
    """The grid's task: the model is asked for the number alone (--data.system-prompt, the grid's own; with
    --data-path, the system message of the rows without one of their own)."""
    data_path: str | None = DataConfig.path
    """A .jsonl or .parquet prompt file to train on in place of the sums (--data.path), e.g. GSM8K-calc's train
    split made by `asyncrl data convert-gsm8k-calc` (its rows' data_source picks the reward). Needs
    --eval-data-path; --max-prompt-length and --max-new-tokens must fit its prompts and answers."""
    eval_data_path: str | None = None
    """The prompt file of the evaluation when training from --data-path (e.g. GSM8K-calc's test split): its
    first --eval-prompts rows that fit --max-prompt-length, in file order."""
    n: int = RolloutConfig.n
    """Responses per prompt (--rollout.n)."""
    mini_batch_size: int = TrainerConfig.mini_batch_size
    """Prompts per learner step (a cell of M updates per step trains them as M mini-batches;
    --trainer.mini-batch-size)."""
    steps: int = 96
    """Learner steps of every run (a multiple of every cell's trigger)."""
    lag: float = 6.0
    """--async-training.staleness-threshold of the lag cells: how many versions the rollout may run ahead."""
    lr: float = 1e-5
    """The grid's learning rate (--trainer.optim.lr, the grid's own)."""
    opsm_threshold: float = 0.1
    """δ of the lag-opsm cell, nats a token (--trainer.off-policy.opsm-threshold; docs/staleness.md's
    pre-registered value)."""
    drift_budget: float = 0.02
    """The lag-drift-budget cell's budget, nats a token of KL(μ‖π_θ) (--async-training.drift-budget;
    docs/staleness.md's pre-registered value)."""
    temperature: float = RolloutConfig.temperature
    """--rollout.temperature (the learner's and the evaluation's too)."""
    max_new_tokens: int = 32
    """The grid's task: a sum's answer fits (--rollout.max-new-tokens, the grid's own)."""
    max_prompt_length: int = 96
    """The grid's task: a sum's prompt fits (--rollout.max-prompt-length, the grid's own)."""
    slots: int = 128
    """Engine slots of the rollout process: a learner step's --mini-batch-size × --n responses at once with the
    defaults (--rollout.max-slots, the grid's own)."""
    max_tokens_per_micro_batch: int = TrainerConfig.max_tokens_per_micro_batch
    """Learner micro-batch token budget (memory only: the loss and gradient do not depend on it;
    --trainer.max-tokens-per-micro-batch)."""
    eval_prompts: int = 128
    """Evaluation prompts of every run (docs/staleness.md's pre-registered evaluation: 1024)."""
    eval_n: int = 4
    """Samples per evaluation prompt (docs/staleness.md's pre-registered evaluation: 8)."""
    eval_seed: int = 1000
    """Task seed of the evaluation prompts (training uses the run's seed)."""
    parallel: int = 1
    """Runs at once (each is its own set of processes)."""
    threads_per_process: int = PlacementConfig.threads_per_process
    """--placement.threads-per-process."""
    sync_timeout_s: float = 600.0
    """--async-training.sync-timeout-s, the grid's own (longer than a run's): --parallel runs share the GPUs, so a
    weight sync can wait behind another run's work."""
    keep_checkpoints: bool = False
    """Keep each run's final checkpoint after its evaluation (SmolLM2-135M with its optimizer: ~1.6 GB each)."""
    out: str = "runs/learning-grid"


def _run_dir(args: GridArgs, cell: str, seed: int) -> pathlib.Path:
    return pathlib.Path(args.out) / cell / f"seed{seed}"


def _data(args: GridArgs, path: str | None, seed: int, shuffle: bool) -> DataConfig:
    """The grid's task: the prompt file `path`, or the built-in sums (None)."""
    return DataConfig(path=path, task="arithmetic", digits=args.digits, operators="+",
                      system_prompt=args.system_prompt, shuffle=shuffle, seed=seed)


def _check_data_paths(args: GridArgs) -> None:
    if args.data_path is not None and args.eval_data_path is None:
        raise ValueError(f"--data-path {args.data_path}: also pass --eval-data-path, the prompt file to evaluate on "
                         "(e.g. the test split of the same task)")
    if args.data_path is None and args.eval_data_path is not None:
        raise ValueError(f"--eval-data-path {args.eval_data_path}: evaluates a grid trained from --data-path; pass "
                         "it too (without it the grid trains and evaluates on the built-in sums)")


def _drift_budget(args: GridArgs, cell: str, knobs: dict) -> dict:
    """The AsyncConfig keyword of a drift-budget cell (none for the others)."""
    if not knobs.get("drift_budget"):
        return {}
    if "drift_budget" not in {f.name for f in dataclasses.fields(AsyncConfig)}:
        raise ValueError(f"--cells {cell}: this checkout's AsyncConfig has no drift_budget; run the other cells, or "
                         "update asyncrl to a version with --async-training.drift-budget")
    return {"drift_budget": args.drift_budget}


def cell_config(args: GridArgs, cell: str, seed: int) -> RunConfig:
    """The RunConfig of one (cell, seed): shared hyperparameters, the cell's mode and correction."""
    if cell not in CELLS:
        raise ValueError(f"--cells {cell}: unknown cell; choose from {', '.join(CELLS)}")
    _check_data_paths(args)
    k = CELLS[cell]
    if args.steps % k["trigger"]:
        raise ValueError(f"--steps {args.steps}: must be a multiple of {cell}'s trigger ({k['trigger']}) so that "
                         "every cell trains the same number of samples")
    updates = k["updates"]
    if args.mini_batch_size % updates:
        raise ValueError(f"--mini-batch-size {args.mini_batch_size}: must be a multiple of {cell}'s updates per "
                         f"step ({updates}) so that its mini-batches add up to the same prompts per learner step")
    trainer, rollout = args.devices
    off_policy = dataclasses.replace(CORRECTIONS[k["correction"]])
    if off_policy.opsm_threshold is not None:
        off_policy.opsm_threshold = args.opsm_threshold
    staleness = args.lag if k["staleness"] is None else k["staleness"]
    return RunConfig(
        model=ModelConfig(path=args.model, tokenizer=args.tokenizer, seed=seed),
        data=_data(args, args.data_path, seed, shuffle=DataConfig.shuffle),
        algorithm=GRPO(clip_ratio_low=0.2, clip_ratio_high=0.28),
        rollout=RolloutConfig(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              max_prompt_length=args.max_prompt_length, max_slots=args.slots,
                              kv_dtype=k.get("kv_dtype", RolloutConfig.kv_dtype)),
        trainer=TrainerConfig(mini_batch_size=args.mini_batch_size // updates, temperature=args.temperature,
                              max_response_length=args.max_new_tokens, off_policy=off_policy,
                              max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                              optim=OptimConfig(lr=args.lr)),
        async_training=AsyncConfig(staleness_threshold=staleness, trigger_parameter_sync_step=k["trigger"],
                                   partial_rollout=k["partial"], colocated=k["colocated"], require_batches=updates,
                                   total_versions=args.steps // k["trigger"], sync_timeout_s=args.sync_timeout_s,
                                   **_drift_budget(args, cell, k)),
        placement=PlacementConfig(launcher="rpc", trainer_devices=(trainer,),
                                  agent_devices=(trainer if k["colocated"] else rollout,),
                                  threads_per_process=args.threads_per_process),
        run_dir=str(_run_dir(args, cell, seed)), wandb="off", seed=seed,
        checkpoint_every=args.steps // k["trigger"],  # one checkpoint: the end of the run, evaluated below
    )


def _eval(args: GridArgs, model: str, device: str) -> dict:
    data = _data(args, args.eval_data_path, args.eval_seed, shuffle=False)  # a file: its first rows, every run alike
    return evaluate(model, data, num_prompts=args.eval_prompts, n=args.eval_n, temperature=args.temperature,
                    max_new_tokens=args.max_new_tokens, max_slots=min(256, args.eval_prompts * args.eval_n),
                    device=device, tokenizer=args.tokenizer, seed=args.eval_seed, max_prompt_length=args.max_prompt_length)


def _curve(run_dir: pathlib.Path, samples_per_step: int) -> list[dict]:
    rows = read_metrics(run_dir)
    keys = {"reward": "critic/score/mean", "lag_mean": "training/version_lag/mean",
            "lag_max": "training/version_lag/max", "mismatch_kl": "rollout_corr/mismatch_kl",
            "clipfrac": "actor/pg_clipfrac", "response_length": "response_length/mean",
            "behaviour_kl": "actor/behaviour_kl", "behaviour_k1": "actor/behaviour_k1",
            "behaviour_ess": "actor/behaviour_ess", "opsm_masked_fraction": "actor/opsm_masked_fraction",
            "lr_scale": "actor/lr_scale", "drift_lag_cap": "fully_async/drift/lag_cap"}
    return [{"step": r["training/global_step"], "samples": r["training/global_step"] * samples_per_step,
             **{name: r.get(key) for name, key in keys.items()}} for r in rows]


def run_one(args: GridArgs, cell: str, seed: int) -> dict:
    """Train one (cell, seed), evaluate its final checkpoint; write and return its result.json."""
    cfg = cell_config(args, cell, seed)
    cfg.validate()
    shutil.rmtree(cfg.run_dir, ignore_errors=True)  # no result.json: whatever is there is an unfinished attempt
    start = time.time()
    summary = train(cfg)
    if summary.interrupted or summary.checkpoint is None:
        raise RuntimeError(f"{cell} seed {seed}: the run stopped early ({summary.interrupted}) at step "
                           f"{summary.steps}; see {cfg.run_dir}")
    train_s = time.time() - start
    samples_per_step = cfg.trainer.mini_batch_size * cfg.async_training.require_batches * cfg.rollout.n
    curve = _curve(pathlib.Path(cfg.run_dir), samples_per_step)
    tail = [c for c in curve if c["step"] > 0.75 * args.steps and c["reward"] is not None]
    lags = [c["lag_mean"] for c in curve if c["lag_mean"] is not None]
    result = {"cell": cell, "seed": seed, "steps": summary.steps, "train_s": train_s,
              "samples": summary.steps * samples_per_step,
              "train_reward_last_quarter": statistics.fmean(c["reward"] for c in tail),
              "forced_lag": cfg.async_training.staleness_threshold,
              "lag_mean": statistics.fmean(lags) if lags else 0.0,
              "lag_max": max((c["lag_max"] or 0 for c in curve), default=0),
              "drift_kl": _mean_of(curve, "behaviour_kl"), "drift_k1": _mean_of(curve, "behaviour_k1"),
              "eval": _eval(args, summary.checkpoint, args.devices[1]), "curve": curve}
    (pathlib.Path(cfg.run_dir) / "result.json").write_text(json.dumps(result, indent=1))
    if not args.keep_checkpoints:
        shutil.rmtree(pathlib.Path(cfg.run_dir) / "checkpoints", ignore_errors=True)
    return result


# ------------------------------------------------------------------------------------------ the grid
def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _mean_of(curve: list[dict], key: str) -> float | None:
    """The mean of one curve column over a run's steps (None: the run did not record it)."""
    values = [c[key] for c in curve if c.get(key) is not None]
    return statistics.fmean(values) if values else None


def _cell_mean(runs: list[dict], key: str) -> float | None:
    values = [v for v in (_mean_of(r["curve"], key) for r in runs) if v is not None]
    return statistics.fmean(values) if values else None


def aggregate(results: list[dict]) -> list[dict]:
    """Per cell (in CELLS order): seeds, eval accuracy and last-quarter training reward as (mean, std), lag,
    and the mean over steps and seeds of the drift (k3 and k1 of KL(μ‖π_θ)), the clip fraction and the mismatch
    KL (None where not recorded)."""
    rows = []
    for cell in CELLS:
        mine = [r for r in results if r["cell"] == cell]
        if not mine:
            continue
        rows.append({"cell": cell, "seeds": sorted(r["seed"] for r in mine),
                     "samples": mine[0]["samples"],
                     "eval_accuracy": _mean_std([r["eval"]["accuracy"] for r in mine]),
                     "train_reward": _mean_std([r["train_reward_last_quarter"] for r in mine]),
                     "lag_mean": statistics.fmean(r["lag_mean"] for r in mine),
                     "lag_max": max(r["lag_max"] for r in mine),
                     "drift_kl": _cell_mean(mine, "behaviour_kl"), "drift_k1": _cell_mean(mine, "behaviour_k1"),
                     "train_s": statistics.fmean(r["train_s"] for r in mine),
                     "clipfrac": _cell_mean(mine, "clipfrac"), "mismatch_kl": _cell_mean(mine, "mismatch_kl"),
                     "per_seed": [round(r["eval"]["accuracy"], 3) for r in sorted(mine, key=lambda r: r["seed"])]})
    return rows


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def _sci(value: float | None) -> str:
    """A drift: nats a token, from ~1e-6 (fp32 engine and learner at no lag) to ~0.1."""
    return "–" if value is None else f"{value:.2e}"


def table(rows: list[dict], initial: dict | None) -> str:
    lines = ["| cell | seeds | trained samples | eval accuracy (mean ± std) | per seed | train reward, last quarter "
             "| version lag mean / max | drift KL(μ‖π) k3 / k1 | train s | pg_clipfrac | mismatch KL |",
             "|" + "---|" * 11]
    if initial is not None:
        lines.append(f"| initial model | – | 0 | {initial['accuracy']:.3f} | – | – | – | – | – | – | – |")
    for r in rows:
        (acc, acc_sd), (rew, rew_sd) = r["eval_accuracy"], r["train_reward"]
        lines.append(f"| {r['cell']} | {len(r['seeds'])} | {r['samples']:,} | {acc:.3f} ± {acc_sd:.3f} | "
                     f"{' / '.join(f'{a:.3f}' for a in r['per_seed'])} | {rew:.3f} ± {rew_sd:.3f} | "
                     f"{r['lag_mean']:.2f} / {r['lag_max']} | {_sci(r.get('drift_kl'))} / "
                     f"{_sci(r.get('drift_k1'))} | {r['train_s']:.0f} | {_num(r.get('clipfrac'))} | "
                     f"{_num(r.get('mismatch_kl'))} |")
    return "\n".join(lines)


def _plot(results: list[dict], rows: list[dict], initial: dict | None, path: pathlib.Path) -> None:
    plt = pyplot_or_none(path, "grid", " (run the same command where it is installed: the finished runs are not "
                                     "run again)")
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, cell in enumerate(r["cell"] for r in rows):
        color = f"C{i}"
        for j, run in enumerate(r for r in results if r["cell"] == cell):
            points = [(c["samples"], c["reward"]) for c in run["curve"] if c["reward"] is not None]
            left.plot(*zip(*points), color=color, alpha=0.7, lw=1, label=cell if j == 0 else None)
    left.set(xlabel="trained samples", ylabel="training reward (critic/score/mean)",
             title="training reward, one line per seed")
    left.legend(fontsize=8)
    names = [r["cell"] for r in rows]
    right.bar(names, [r["eval_accuracy"][0] for r in rows], yerr=[r["eval_accuracy"][1] for r in rows],
              color=[f"C{i}" for i in range(len(rows))], capsize=4)
    if initial is not None:
        right.axhline(initial["accuracy"], color="gray", ls="--", label="initial model")
        right.legend(fontsize=8)
    right.set(ylabel="held-out accuracy (mean ± std over seeds)", title="after equal trained samples")
    plt.setp(right.get_xticklabels(), rotation=30, ha="right")  # cell names stay apart with many cells
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _child(args_file: str, key: str) -> None:
    args = GridArgs(**{k: tuple(v) if isinstance(v, list) else v
                       for k, v in json.loads(pathlib.Path(args_file).read_text()).items()})
    if key == "initial":
        result = _eval(args, args.model, args.devices[1])
        (pathlib.Path(args.out) / "initial.json").write_text(json.dumps(result, indent=1))
        return
    cell, _, seed = key.rpartition(":")
    run_one(args, cell, int(seed))


def _spawn(out: pathlib.Path, key: str) -> subprocess.Popen:
    log = out / f"{key.replace(':', '_seed')}.log"
    cmd = [sys.executable, "-m", "scripts.learning_grid", "--child", str(out / "grid.json"), key]
    print(f"[grid] started {key}", flush=True)
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def run_grid(args: GridArgs) -> list[dict]:
    """Every (cell, seed) not yet done, `--parallel` at a time, each in its own process; then the summary."""
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for cell in args.cells:
        for seed in args.seeds:
            cell_config(args, cell, seed).validate()  # every cell checks before anything runs
    (out / "grid.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
    failed = []
    if not (out / "initial.json").is_file() and _spawn(out, "initial").wait():  # alone: a model's first
        failed.append("initial")                                                  # load may convert and cache it
    todo = [f"{c}:{s}" for s in args.seeds for c in args.cells if not (_run_dir(args, c, s) / "result.json").is_file()]
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    while todo or running:
        while todo and len(running) < max(1, args.parallel):
            key = todo.pop(0)
            running[key] = (_spawn(out, key), time.time())
        time.sleep(1.0)
        for key, (proc, began) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[key]
            print(f"[grid] {key} {'done' if proc.returncode == 0 else f'FAILED ({proc.returncode})'} after "
                  f"{time.time() - began:.0f} s", flush=True)
            if proc.returncode:
                failed.append(key)
    results = [json.loads(p.read_text()) for p in sorted(out.glob("*/seed*/result.json"))]
    initial = json.loads((out / "initial.json").read_text()) if (out / "initial.json").is_file() else None
    rows = aggregate(results)
    text = table(rows, initial)
    (out / "results.json").write_text(json.dumps({"args": dataclasses.asdict(args), "initial": initial,
                                                  "cells": rows, "runs": results}, indent=1))
    (out / "learning_grid.md").write_text(text + "\n")
    if rows:
        _plot(results, rows, initial, out / "learning_grid.png")
    print(text)
    if failed:
        raise SystemExit(f"[grid] failed: {', '.join(failed)}; their logs are in {out}")
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(*sys.argv[2:4])
    else:
        import tyro
        run_grid(tyro.cli(GridArgs))
