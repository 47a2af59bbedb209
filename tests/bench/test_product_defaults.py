"""The benchmarks measure the product's defaults unless a flag says otherwise: every flag of a benchmark's
arguments that means a run's knob (a field of `RunConfig`, its parts, or `EngineConfig`) has that knob's
default. Every field of every arguments class is placed below, as one of

    MIRRORS    the knob it means, whose default it must have;
    DIFFERENT  the knob it means and why the benchmark differs on purpose (checked still to differ);
    OWN        no knob of a run (the workload, the devices, the measurement);

so a new field, or a new benchmark (`asyncrl bench`'s list), fails until it is placed, and a mirrored field
re-declared with another value fails."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.config import RolloutConfig, RunConfig, TrainerConfig
from asyncrl.policies import EngineConfig
from asyncrl_bench.async_runs import AsyncBenchArgs, variant_config
from asyncrl_bench.cli import BENCHMARKS
from asyncrl_bench.learner import LearnerBenchArgs
from asyncrl_bench.learner_args import TRAINER_KNOBS
from scripts.learning_grid import GridArgs, cell_config
from scripts.profile_learner import ProfileArgs

GPU_SHAPE = "a model shape to measure on a GPU (a run's default is the CPU demo's model)"

MIRRORS: dict[str, dict[str, str]] = {
    "LearnerBenchArgs": {
        "group_size": "run.rollout.n", "lora": "run.lora", "impl": "run.model.impl",
        **{knob: f"run.trainer.{knob}" for knob in TRAINER_KNOBS},
    },
    "AsyncBenchArgs": {
        "tokenizer": "run.model.tokenizer", "data": "run.data.path", "digits": "run.data.digits",
        "system_prompt": "run.data.system_prompt", "n": "run.rollout.n",
        "mini_batch_size": "run.trainer.mini_batch_size",
        "max_new_tokens": "run.rollout.max_new_tokens", "max_prompt_length": "run.rollout.max_prompt_length",
        "temperature": "run.rollout.temperature", "lr": "run.trainer.optim.lr", "slots": "run.rollout.max_slots",
        "time_budget_s": "run.async_training.time_budget_s", "trainer_dtype": "run.trainer.param_dtype",
        "gradient_checkpointing": "run.trainer.gradient_checkpointing",
        "max_tokens_per_micro_batch": "run.trainer.max_tokens_per_micro_batch", "seed": "run.seed",
        "sync_timeout_s": "run.async_training.sync_timeout_s",
        "threads_per_process": "run.placement.threads_per_process",
    },
    "EngineBenchArgs": {
        "dtype": "run.model.engine_dtype", "new_tokens": "run.rollout.max_new_tokens", "data": "run.data.path",
        "tokenizer": "run.model.tokenizer", "cuda_graphs": "run.rollout.cuda_graphs",
        "decode_attention": "run.rollout.decode_attention", "decode_ahead": "engine.decode_ahead", "seed": "run.seed",
        "kv_dtype": "run.rollout.kv_dtype", "kv_layout": "run.rollout.kv_layout",
        "system_prompt_len": "run.rollout.share_prefix",
    },
    "AttentionBenchArgs": {},
    "SpeculationBenchArgs": {
        "dtype": "run.model.engine_dtype", "tokenizer": "run.model.tokenizer", "data": "run.data.path",
        "n": "run.rollout.n", "new_tokens": "run.rollout.max_new_tokens", "seed": "run.seed",
        "temperature": "run.rollout.temperature", "max_rows": "run.rollout.speculation.max_rows",
    },
    "GridArgs": {
        "model": "run.model.path", "tokenizer": "run.model.tokenizer", "n": "run.rollout.n",
        "mini_batch_size": "run.trainer.mini_batch_size", "temperature": "run.rollout.temperature",
        "max_tokens_per_micro_batch": "run.trainer.max_tokens_per_micro_batch",
        "threads_per_process": "run.placement.threads_per_process", "data_path": "run.data.path",
    },
    "ProfileArgs": {
        "max_tokens_per_micro_batch": "run.trainer.max_tokens_per_micro_batch",
        "gradient_checkpointing": "run.trainer.gradient_checkpointing", "cuda_graphs": "run.trainer.cuda_graphs",
        "compile_scope": "run.trainer.compile_scope",
    },
    "LaunchBenchArgs": {},
    "AdmissionBenchArgs": {
        "dtype": "run.model.engine_dtype", "slots": "run.rollout.max_slots", "n": "run.rollout.n",
        "cuda_graphs": "run.rollout.cuda_graphs", "seed": "run.seed",
    },
}

DIFFERENT: dict[str, dict[str, tuple[str, str]]] = {
    "LearnerBenchArgs": {"model": ("run.model.path", GPU_SHAPE)},
    "AsyncBenchArgs": {"model": ("run.model.path", GPU_SHAPE)},
    "EngineBenchArgs": {
        "model": ("run.model.path", GPU_SHAPE),
        "n": ("run.rollout.n", "one sample per prompt, so that a batch size is the sequences decoded together"),
        "vllm_prefix_caching": ("run.rollout.vllm.enable_prefix_caching",
                                "the timed run repeats the warm-up's prompts: a cache would skip their prefill"),
    },
    "AttentionBenchArgs": {"model": ("run.model.path", "only the shape of a GPU model is used")},
    "SpeculationBenchArgs": {
        "model": ("run.model.path", GPU_SHAPE),
        "tokens": ("run.rollout.speculation.tokens", "the draft lengths measured (a run's default: off)"),
    },
    "GridArgs": {
        "digits": ("run.data.digits", "the grid's task: two-digit sums"),
        "system_prompt": ("run.data.system_prompt", "the grid's task: the number alone is asked for"),
        "max_new_tokens": ("run.rollout.max_new_tokens", "the grid's task: a sum's answer"),
        "max_prompt_length": ("run.rollout.max_prompt_length", "the grid's task: a sum's prompt"),
        "lr": ("run.trainer.optim.lr", "the grid's learning rate"),
        "slots": ("run.rollout.max_slots", "a learner step's responses at once"),
        "sync_timeout_s": ("run.async_training.sync_timeout_s", "parallel runs share the GPUs"),
        "opsm_threshold": ("run.trainer.off_policy.opsm_threshold", "the lag-opsm cell's δ (the others: off)"),
        "drift_budget": ("run.async_training.drift_budget", "the lag-drift-budget cell's budget (the others: off)"),
    },
    "ProfileArgs": {"model": ("run.model.path", GPU_SHAPE)},
    "LaunchBenchArgs": {"versions": ("run.async_training.total_versions", "a tiny job: its launch is what is timed")},
    "AdmissionBenchArgs": {
        "model": ("run.model.path", GPU_SHAPE),
        "new_tokens": ("run.rollout.max_new_tokens", "the heavy-tailed budgets' maximum, as the tail bench's rows"),
    },
}

OWN: dict[str, set[str]] = {
    "LearnerBenchArgs": {"device", "rows", "workload", "prompt_len", "response_len", "prompt_len_min", "prompt_len_max",
                       "response_len_min", "response_len_max", "steps", "warmup_steps", "baseline", "out", "ranks"},
    "AsyncBenchArgs": {"variants", "devices", "steps", "out", "nccl_reference"},
    "EngineBenchArgs": {"device", "backends", "batch_sizes", "prompt_len", "seeded", "out", "lengths", "tail_ratio"},
    "AttentionBenchArgs": {"batch_sizes", "contexts", "lengths", "kernels", "dtype", "iters", "max_cache_gb", "seed",
                         "out"},
    "GridArgs": {"devices", "cells", "seeds", "steps", "lag", "eval_prompts", "eval_n", "eval_seed", "eval_data_path",
               "parallel", "keep_checkpoints", "out"},
    "ProfileArgs": {"rows", "workload", "warmup_steps", "layer_tokens", "top"},
    "LaunchBenchArgs": {"repeats", "agents", "restart", "timeout_s", "out"},
    "SpeculationBenchArgs": {"device", "prompts", "prompt_len", "batch_sizes", "steps", "out", "vllm"},
    "AdmissionBenchArgs": {"device", "in_flight", "groups", "prompt_len", "tail_ratio", "out"},
}

ARGS_CLASSES = [args for name, (args, _, _) in BENCHMARKS.items() if name != "plan"] + [GridArgs, ProfileArgs]
"""Every `asyncrl bench` benchmark's arguments (`plan` takes `asyncrl plan`'s own, the product's) and the scripts'
that mirror a run's knobs."""


def product_default(path: str):
    """The default of a run's knob: 'run.trainer.max_tokens_per_micro_batch' (a field of `RunConfig()` and its
    parts) or 'engine.decode_ahead' (of `EngineConfig()`)."""
    root, *attributes = path.split(".")
    value = {"run": RunConfig, "engine": EngineConfig}[root]()
    for attribute in attributes:
        value = getattr(value, attribute)
    return value


def default(args_class: type, name: str):
    field = {f.name: f for f in dataclasses.fields(args_class)}[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def drifted(args_class: type, mirrors: dict[str, str]) -> list[str]:
    """'Class.field = value, the run's knob path = value' for every mirrored field whose default differs."""
    return [f"{args_class.__name__}.{name} = {default(args_class, name)!r}, {path} = {product_default(path)!r}"
            for name, path in mirrors.items() if default(args_class, name) != product_default(path)]


@pytest.mark.parametrize("args_class", ARGS_CLASSES, ids=lambda c: c.__name__)
def test_every_field_is_placed_once(args_class):
    name = args_class.__name__
    assert name in MIRRORS and name in DIFFERENT and name in OWN, f"place {name}'s fields in MIRRORS, DIFFERENT, OWN"
    placed = [*MIRRORS[name], *DIFFERENT[name], *OWN[name]]
    assert len(placed) == len(set(placed)), f"placed twice: {sorted({n for n in placed if placed.count(n) > 1})}"
    assert sorted(placed) == sorted(f.name for f in dataclasses.fields(args_class))


@pytest.mark.parametrize("args_class", ARGS_CLASSES, ids=lambda c: c.__name__)
def test_a_flag_that_is_a_runs_knob_has_its_default(args_class):
    assert not drifted(args_class, MIRRORS[args_class.__name__]), (
        "read the default from the config class (e.g. `= TrainerConfig.max_tokens_per_micro_batch`), or, if the "
        "benchmark must differ, move the field to DIFFERENT with the reason")


@pytest.mark.parametrize("args_class", ARGS_CLASSES, ids=lambda c: c.__name__)
def test_a_deliberate_difference_still_differs(args_class):
    same = {name: path for name, (path, _) in DIFFERENT[args_class.__name__].items()
            if default(args_class, name) == product_default(path)}
    assert not same, f"these now agree with the run's knob: move them to MIRRORS: {same}"


def test_a_redeclared_default_is_found():
    """The check itself, on a class that re-declares two knobs with other values (as the learner benchmark's
    budget and recompute once were) and one with the same value."""
    budget, recompute = TrainerConfig.max_tokens_per_micro_batch, TrainerConfig.gradient_checkpointing
    planted = dataclasses.make_dataclass("Planted", [("max_tokens_per_micro_batch", int, budget // 2),
                                                     ("gradient_checkpointing", bool, not recompute),
                                                     ("n", int, RolloutConfig.n)])
    found = drifted(planted, {"max_tokens_per_micro_batch": "run.trainer.max_tokens_per_micro_batch",
                              "gradient_checkpointing": "run.trainer.gradient_checkpointing", "n": "run.rollout.n"})
    assert found == [
        f"Planted.max_tokens_per_micro_batch = {budget // 2}, run.trainer.max_tokens_per_micro_batch = {budget}",
        f"Planted.gradient_checkpointing = {not recompute}, run.trainer.gradient_checkpointing = {recompute}"]


def test_the_learner_benchmark_times_the_default_learner():
    """At a default step's rows, our side's learner is `TrainerConfig()` itself; a knob's flag reaches it."""
    rows = TrainerConfig.mini_batch_size * RolloutConfig.n
    assert LearnerBenchArgs(rows=rows).trainer_config() == TrainerConfig()
    changed = LearnerBenchArgs(rows=16, max_tokens_per_micro_batch=8192, gradient_checkpointing=True,
                               checkpoint_scope="layer").trainer_config(lr=1e-5)
    assert (changed.mini_batch_size, changed.max_tokens_per_micro_batch, changed.gradient_checkpointing,
            changed.checkpoint_scope, changed.optim.lr) == (2, 8192, True, "layer", 1e-5)


@pytest.mark.parametrize("args_class, config_of", [
    (AsyncBenchArgs, lambda args: variant_config(args, "stale-partial")),
    (GridArgs, lambda args: cell_config(args, "stale-partial", seed=RunConfig.seed)),
], ids=["AsyncBenchArgs", "GridArgs"])
def test_a_mirrored_flag_reaches_its_knob(args_class, config_of):
    """The run a variant or cell trains carries each mirrored flag's value at the knob it names."""
    config = config_of(args_class())
    for name, path in MIRRORS[args_class.__name__].items():
        value = config
        for attribute in path.split(".")[1:]:
            value = getattr(value, attribute)
        assert value == default(args_class, name), f"{args_class.__name__}.{name} -> {path}"
