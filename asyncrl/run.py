"""From a `RunConfig` to a running job: build the data, the scorer, the launch spec, and train.

    summary = train(PRESETS["cpu-demo"])

The factories here are small picklable objects: the multi-process launcher sends them to the process
that uses them (the prompt source to the trainer, the scorer to each agent), where they build the
tokenizer and the task locally.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time

import torch

from asyncrl.config import DataConfig, RunConfig
from asyncrl.data.scoring import Scorer
from asyncrl.data.files import load_prompt_file
from asyncrl.data.sources import DatasetSource, GeneratedSource, PromptSource
from asyncrl.data.tasks import ArithmeticTask, CountdownTask, ToyTask
from asyncrl.rewards import arithmetic_reward, countdown_reward, even_token_reward, gsm8k_reward, math_reward
from asyncrl.rpc.assembly import resume_checkpoint
from asyncrl.rpc.controller import RunSummary
from asyncrl.rpc.launch import launch, run_torchrun
from asyncrl.rpc.spec import AgentSpec, ModelSpec, RunSpec
from asyncrl.tracking import Tracker, TrackingConfig

__all__ = ["REWARDS", "SourceFactory", "ScorerFactory", "build_spec", "train"]

log = logging.getLogger("asyncrl.run")

REWARDS = {
    "arithmetic": arithmetic_reward,
    "countdown": countdown_reward,
    "toy": even_token_reward,
    "openai/gsm8k": gsm8k_reward,
    "math": math_reward,
}
"""data_source -> reward function (response_text, ground_truth) -> float. Add entries for new data."""


def _tokenizer(model_path: str):
    if model_path.startswith("random:"):
        return None
    from asyncrl.policies.loading import load_tokenizer, smollm2_gguf_path
    return load_tokenizer(smollm2_gguf_path() if model_path == "smollm2" else model_path)


def _task(data: DataConfig):
    if data.task == "arithmetic":
        return ArithmeticTask(digits=data.digits, operators=data.operators, seed=data.seed)
    if data.task == "countdown":
        return CountdownTask(seed=data.seed)
    return ToyTask()


class _SystemTokenizer:
    """Wraps a tokenizer so task prompts get the configured system message."""

    def __init__(self, tokenizer, system: str):
        self.tokenizer, self.system = tokenizer, system
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template([{"role": "system", "content": self.system}] + messages, **kwargs)

    def encode(self, text):
        return self.tokenizer.encode(text)


@dataclasses.dataclass
class SourceFactory:
    data: DataConfig
    model_path: str
    max_prompt_length: int

    def __call__(self) -> PromptSource:
        if self.data.path is not None:
            return self._file_source()
        tokenizer = _tokenizer(self.model_path)
        if tokenizer is not None and self.data.system_prompt:
            tokenizer = _SystemTokenizer(tokenizer, self.data.system_prompt)
        task = _task(self.data)

        def make(index: int):
            prompt = task.prompt(index, tokenizer)
            if len(prompt.prompt_ids) > self.max_prompt_length:
                raise ValueError(f"{self.data.task} prompt {index} has {len(prompt.prompt_ids)} tokens > "
                                 f"rollout.max_prompt_length={self.max_prompt_length}; raise it")
            return prompt

        return GeneratedSource(make)

    def _file_source(self) -> DatasetSource:
        tokenizer = _tokenizer(self.model_path)
        if tokenizer is None:
            raise ValueError(f"data.path={self.data.path!r} needs a tokenizer to render its prompts, and "
                             f"model.path={self.model_path!r} has none; use a model with a tokenizer, set model.tokenizer, or "
                             "data.task=toy for random models")
        prompts, stats = load_prompt_file(self.data.path, tokenizer, max_prompt_length=self.max_prompt_length,
                                          on_long=self.data.on_long, system_prompt=self.data.system_prompt)
        log.info("data: %s: %d rows, %d kept, %d filtered (longer than %d tokens), %d truncated", self.data.path,
                 stats["rows"], stats["kept"], stats["filtered_too_long"], self.max_prompt_length, stats["truncated"])
        if not stats["rows"]:
            raise ValueError(f"data.path={self.data.path!r} holds no rows; check the file")
        if not prompts:
            raise ValueError(f"data.path={self.data.path!r}: all {stats['rows']} prompts are longer than "
                             f"rollout.max_prompt_length={self.max_prompt_length} tokens; raise it or set "
                             "data.on_long=truncate")
        return DatasetSource(prompts, seed=self.data.seed, shuffle=self.data.shuffle)


@dataclasses.dataclass
class ScorerFactory:
    model_path: str
    strict: bool = False

    def __call__(self) -> Scorer:
        return Scorer(REWARDS, tokenizer=_tokenizer(self.model_path), strict=self.strict)


def _engine_dtype(cfg: RunConfig, device: str) -> str:
    if cfg.model.engine_dtype != "auto":
        return cfg.model.engine_dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def build_spec(cfg: RunConfig, *, log_fn=None) -> RunSpec:
    cfg.validate()
    model = ModelSpec(path=cfg.model.path, seed=cfg.model.seed, dtype=cfg.trainer.param_dtype)
    agents = [AgentSpec(device=d, engine_dtype=_engine_dtype(cfg, d)) for d in cfg.placement.agent_devices]
    tokenizer = cfg.model.tokenizer or cfg.model.path  # the factories only read the tokenizer from it
    return RunSpec(model=model, algorithm=cfg.algorithm, trainer=cfg.trainer, rollout=cfg.rollout,
                   async_=cfg.async_training,
                   source_factory=SourceFactory(cfg.data, tokenizer, cfg.rollout.max_prompt_length),
                   scorer_factory=ScorerFactory(tokenizer, strict=cfg.strict_rewards), agents=agents,
                   trainer_devices=list(cfg.placement.trainer_devices), reference=cfg.algorithm.needs_reference,
                   seed=cfg.seed, run_dir=cfg.run_dir, checkpoint_every=cfg.checkpoint_every, resume=cfg.resume,
                   resume_or_start=cfg.resume_or_start, log_fn=log_fn, master_addr=cfg.placement.master_addr,
                   join_port=cfg.placement.join_port, threads_per_process=cfg.placement.threads_per_process,
                   colocate=cfg.async_training.colocated and cfg.placement.launcher != "local",
                   restart_agents=cfg.placement.restart_agents, restart_backoff_s=cfg.placement.restart_backoff_s,
                   max_run_time_s=cfg.placement.max_run_time_s)


def _config_dict(cfg: RunConfig) -> dict:
    def plain(obj):
        if dataclasses.is_dataclass(obj):
            return {"_type": type(obj).__name__, **{f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
        if isinstance(obj, (list, tuple)):
            return [plain(x) for x in obj]
        return obj
    return plain(cfg)


def train(cfg: RunConfig) -> RunSummary | None:
    """Run training as configured; write run_dir/config.json, metrics.jsonl and summary.json."""
    cfg.validate()  # before anything is written: a bad config leaves no run directory behind
    spec = build_spec(cfg)
    resume_checkpoint(spec)  # a resume without a checkpoint is refused before anything starts
    run_dir = pathlib.Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(_config_dict(cfg), indent=2, default=str))
    tracker = Tracker(TrackingConfig(run_dir=cfg.run_dir, wandb=cfg.wandb), run_config=_config_dict(cfg))
    spec = dataclasses.replace(spec, log_fn=tracker)
    start = time.time()
    if cfg.placement.launcher == "rpc":
        summary = launch(spec)
    elif cfg.placement.launcher == "torchrun":
        summary = run_torchrun(spec)
        if summary is None:  # not rank 0: nothing to report
            return None
    else:
        summary = _train_local(spec, tracker)
    tracker.close()
    (run_dir / "summary.json").write_text(json.dumps(
        {"versions": summary.versions, "steps": summary.steps, "ledger": summary.ledger,
         "dead_agents": summary.dead_agents, "agents": summary.agents, "interrupted": summary.interrupted,
         "checkpoint": summary.checkpoint, "wall_s": time.time() - start}, indent=2))
    return summary


def _train_local(spec: RunSpec, tracker) -> RunSummary:
    from asyncrl.rpc.lifecycle import StopRequest, on_signals
    from asyncrl.rpc.local import LocalRun
    torch.set_num_threads(spec.threads_per_process)
    stop = StopRequest()
    on_signals(stop.set)
    run = LocalRun.from_spec(spec, log_metrics=tracker, on_step=tracker.log_samples, stop=stop)
    summary = run.run()
    if stop.is_set() and summary.interrupted is None:
        summary.interrupted = stop.reason
    return summary
