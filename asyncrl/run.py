"""From a `RunConfig` to a running job: build the data, the scorer, the launch spec, and train.

    summary = train(PRESETS["cpu-demo"])

The factories here are small picklable objects: the multi-process launcher sends them to the process
that uses them (the prompt source to the trainer, the scorer to each agent), where they build the
tokenizer and the task locally.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
import time

import torch

from asyncrl.config import DataConfig, EnvConfig, RunConfig
from asyncrl.console import Console
from asyncrl.data.scoring import Scorer, Workers, decode_ids
from asyncrl.data.files import load_prompt_file
from asyncrl.data.sources import DatasetSource, GeneratedSource, PromptSource
from asyncrl.data.tasks import ArithmeticTask, CountdownTask, ToyTask
from asyncrl.resume_check import config_record
from asyncrl.rewards.plugin import absolute_reward_spec
from asyncrl.rewards.registry import BUILTIN_REWARDS
from asyncrl.rpc.assembly import resume_checkpoint
from asyncrl.rpc.controller import RunSummary
from asyncrl.rpc.launch import run_torchrun
from asyncrl.rpc.supervise import launch
from asyncrl.policies.vllm_engine import build_vllm_engine
from asyncrl.rpc.spec import AgentSpec, ModelSpec, RunSpec, build_embedded_engine
from asyncrl.tracking import Tracker, TrackingConfig

__all__ = ["REWARDS", "SourceFactory", "ScorerFactory", "EnvSetup", "build_spec", "train"]

log = logging.getLogger("asyncrl.run")

REWARDS = BUILTIN_REWARDS
"""data_source -> built-in reward function (response_text, ground_truth) -> float. Rewards of your own:
--reward.fn (`asyncrl.rewards.plugin`)."""


def tokenizer_path(cfg: RunConfig) -> str:
    """Where a run's tokenizer comes from: --model.tokenizer, else the model ('random:…' has none)."""
    return cfg.model.tokenizer or cfg.model.path


def run_tokenizer(model_path: str):
    """The tokenizer of a model path, None for 'random:' models."""
    if model_path.startswith("random:"):
        return None
    from asyncrl.policies.loading import load_tokenizer
    return load_tokenizer(model_path)


def task_of(data: DataConfig):
    """The built-in procedural task --data.task names."""
    if data.task == "arithmetic":
        return ArithmeticTask(digits=data.digits, operators=data.operators, seed=data.seed)
    if data.task == "countdown":
        return CountdownTask(seed=data.seed)
    return ToyTask()


def with_system(tokenizer, system: str | None, tools: list[dict] | None = None):
    """The tokenizer, rendering prompts with `system` as the system message and the environment's `tools` in
    the chat template's tool format, when given."""
    if tokenizer is None or not (system or tools):
        return tokenizer
    return _PromptTokenizer(tokenizer, system, tools)


class _PromptTokenizer:
    """Wraps a tokenizer so prompts get the configured system message and the environment's tools."""

    def __init__(self, tokenizer, system: str | None, tools: list[dict] | None):
        self.tokenizer, self.system, self.tools = tokenizer, system, tools
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def apply_chat_template(self, messages, **kwargs):
        head = [{"role": "system", "content": self.system}] if self.system else []
        if self.tools:
            kwargs["tools"] = self.tools
        return self.tokenizer.apply_chat_template(head + list(messages), **kwargs)

    def encode(self, text, **kwargs):
        return self.tokenizer.encode(text, **kwargs)


def env_tools(env_fn: str | None) -> list[dict] | None:
    """JSON schemas of the tools of the environment --env.fn names (None: no environment or no tools)."""
    if env_fn is None:
        return None
    from asyncrl.envs import env_tool_schemas, load_env
    return env_tool_schemas(load_env(env_fn))


@dataclasses.dataclass
class SourceFactory:
    data: DataConfig
    model_path: str
    max_prompt_length: int
    env_fn: str | None = None
    """--env.fn: prompts are rendered with its tools."""

    def __call__(self) -> PromptSource:
        if self.data.path is not None:
            return self._file_source()
        tokenizer = with_system(run_tokenizer(self.model_path), self.data.system_prompt, env_tools(self.env_fn))
        task = task_of(self.data)

        def make(index: int):
            prompt = task.prompt(index, tokenizer)
            if len(prompt.prompt_ids) > self.max_prompt_length:
                raise ValueError(f"{self.data.task} prompt {index} has {len(prompt.prompt_ids)} tokens > "
                                 f"--rollout.max-prompt-length {self.max_prompt_length}; raise it")
            return prompt

        return GeneratedSource(make)

    def _file_source(self) -> DatasetSource:
        tokenizer = run_tokenizer(self.model_path)
        if tokenizer is None:
            raise ValueError(f"--data.path {self.data.path} needs a tokenizer to render its prompts, and "
                             f"--model.path {self.model_path} has none; use a model with a tokenizer, set "
                             "--model.tokenizer, or --data.task toy for random models")
        tokenizer = with_system(tokenizer, None, env_tools(self.env_fn))
        prompts, stats = load_prompt_file(self.data.path, tokenizer, max_prompt_length=self.max_prompt_length,
                                          on_long=self.data.on_long, on_empty=self.data.on_empty,
                                          system_prompt=self.data.system_prompt)
        log.info("data: %s: %d rows, %d kept, %d filtered (longer than %d tokens), %d truncated, %d empty dropped",
                 self.data.path, stats["rows"], stats["kept"], stats["filtered_too_long"], self.max_prompt_length,
                 stats["truncated"], stats["empty"])
        if not stats["rows"]:
            raise ValueError(f"--data.path {self.data.path} holds no rows; check the file")
        if not prompts:
            raise ValueError(f"--data.path {self.data.path}: all {stats['rows'] - stats['empty']} prompts are longer "
                             f"than --rollout.max-prompt-length {self.max_prompt_length} tokens; raise it or pass "
                             "--data.on-long truncate")
        return DatasetSource(prompts, seed=self.data.seed, shuffle=self.data.shuffle)


@dataclasses.dataclass
class ScorerFactory:
    """Builds the scorer in the process that scores (plug-ins are imported there: functions loaded from
    files do not pickle)."""

    model_path: str
    strict: bool = False
    reward_fns: tuple[str, ...] = ()
    """--reward.fn specs."""
    timeout_s: float = 60.0
    max_concurrency: int = 16

    def __call__(self, *, workers: Workers | None = None) -> Scorer:
        """`workers`: where sync plug-ins run (the agent's worker processes; None: in the calling thread)."""
        from asyncrl.rewards.plugin import RewardTable
        return Scorer(RewardTable.from_specs(self.reward_fns), tokenizer=run_tokenizer(self.model_path),
                      strict=self.strict, timeout_s=self.timeout_s, max_concurrency=self.max_concurrency,
                      workers=workers)


@dataclasses.dataclass
class EnvSetup:
    """Builds the environment runtime in the rollout process (environment classes from files do not pickle)."""

    env: EnvConfig
    model_path: str
    """Where the tokenizer comes from (observations are rendered with its chat template)."""

    def __call__(self, *, workers: Workers | None = None):
        """`workers`: where the episodes of an environment of your own with a sync step live (None: here)."""
        from asyncrl.envs import ChatRenderer, EnvRuntime, TokenRenderer, env_tool_schemas, load_env
        from asyncrl.envs.isolated import runs_isolated
        factory = load_env(self.env.fn)
        tokenizer = run_tokenizer(self.model_path)
        if tokenizer is None:
            renderer, decode = TokenRenderer(), decode_ids
        else:
            renderer = ChatRenderer(tokenizer, tools=env_tool_schemas(factory))
            decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
        return EnvRuntime(factory, renderer, decode, max_turns=self.env.max_turns,
                          max_turn_tokens=self.env.max_turn_tokens, step_timeout_s=self.env.step_timeout_s,
                          max_concurrency=self.env.max_concurrency, observation_role=self.env.observation_role,
                          isolated_spec=self.env.fn if runs_isolated(self.env.fn, factory) else None, workers=workers)


def _engine_dtype(cfg: RunConfig, device: str) -> str:
    if cfg.model.engine_dtype != "auto":
        return cfg.model.engine_dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def build_spec(cfg: RunConfig, *, log_fn=None) -> RunSpec:
    cfg.validate()
    model = ModelSpec(path=cfg.model.path, seed=cfg.model.seed, dtype=cfg.trainer.param_dtype)
    factory = build_embedded_engine
    if cfg.rollout.backend == "vllm":
        factory = functools.partial(build_vllm_engine, options=cfg.rollout.vllm)
    agents = [AgentSpec(device=d, engine_dtype=_engine_dtype(cfg, d), engine_factory=factory)
              for d in cfg.placement.agent_devices]
    tokenizer = cfg.model.tokenizer or cfg.model.path  # the factories only read the tokenizer from it
    trainer = cfg.trainer
    if trainer.temperature is None:  # the learner's log-probs are those of the distribution sampled from
        trainer = dataclasses.replace(trainer, temperature=cfg.rollout.temperature)
    if trainer.max_response_length is None and cfg.algorithm.overlong_buffer_len != 0:  # shaping needs the budget
        trainer = dataclasses.replace(trainer, max_response_length=cfg.rollout.max_new_tokens)
    return RunSpec(model=model, algorithm=cfg.algorithm, trainer=trainer, rollout=cfg.rollout,
                   async_=cfg.async_training,
                   source_factory=SourceFactory(cfg.data, tokenizer, cfg.rollout.max_prompt_length, cfg.env.fn),
                   env_setup=EnvSetup(cfg.env, tokenizer) if cfg.env.fn is not None else None,
                   scorer_factory=ScorerFactory(tokenizer, strict=cfg.strict_rewards, reward_fns=tuple(map(absolute_reward_spec, cfg.reward.fn)),
                                                 timeout_s=cfg.reward.timeout_s,
                                                 max_concurrency=cfg.reward.max_concurrency), agents=agents,
                   trainer_devices=list(cfg.placement.trainer_devices), lora=cfg.lora,
                   reference=cfg.algorithm.needs_reference and not cfg.lora.enabled,  # LoRA: the base is the reference
                   seed=cfg.seed, run_dir=cfg.run_dir, checkpoint_every=cfg.checkpoint_every, resume=cfg.resume,
                   resume_or_start=cfg.resume_or_start, log_fn=log_fn, master_addr=cfg.placement.master_addr,
                   join_port=cfg.placement.join_port, threads_per_process=cfg.placement.threads_per_process,
                   colocate=cfg.async_training.colocated and cfg.placement.launcher != "local",
                   restart_agents=cfg.placement.restart_agents, restart_backoff_s=cfg.placement.restart_backoff_s,
                   max_run_time_s=cfg.placement.max_run_time_s, token_file=cfg.placement.token_file,
                   user_code_workers=cfg.placement.user_code_workers)


def _prepare_run_dir(cfg: RunConfig, spec: RunSpec) -> pathlib.Path:
    """Before anything starts (rank 0 of a torchrun job only): refuse a new run into a used run directory
    (`asyncrl.run_dir`), delete the old run with --overwrite, settle the checkpoints a resume reads (and refuse
    a resume without one), and write config.json: the config and its data fingerprint (`asyncrl.resume_check`),
    which each checkpoint copies."""
    from asyncrl.console import phase
    from asyncrl.resume_check import run_record
    from asyncrl.run_dir import clear_run_dir, owns_run_dir, run_dir_problem
    run_dir = pathlib.Path(cfg.run_dir)
    if not owns_run_dir(cfg):
        return run_dir
    problem = run_dir_problem(cfg)
    if problem is not None:
        raise ValueError(problem)
    if cfg.overwrite and (removed := clear_run_dir(run_dir)):
        phase(f"--overwrite: deleted {', '.join(removed)} from {run_dir}")
    resume_checkpoint(spec)  # a resume without a checkpoint is refused before anything starts
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(run_record(cfg), indent=2))
    return run_dir


def train(cfg: RunConfig, *, preflight_done: bool = False) -> RunSummary | None:
    """Run training as configured; write run_dir/config.json, metrics.jsonl and summary.json.

    Every up-front check (`asyncrl.preflight`) runs first unless the caller ran it: a bad config raises
    ValueError listing the problems and leaves no run directory behind. A new run into a run directory that
    holds one is refused unless `cfg.overwrite` (`asyncrl.run_dir`); a resume that changes what cannot change
    is refused (`asyncrl.resume_check`)."""
    if not preflight_done:
        from asyncrl.preflight import preflight
        report = preflight(cfg)
        if not report.ok:
            raise ValueError("\n  ".join(["the run cannot start:", *report.problems]))
        for note in report.notes:
            log.info("note: %s", note)
    spec = build_spec(cfg)
    run_dir = _prepare_run_dir(cfg, spec)
    console = Console(total=cfg.async_training.total_versions, time_budget_s=cfg.async_training.time_budget_s,
                      warn_share=cfg.reward.error_warn_share)
    tracker = Tracker(TrackingConfig(run_dir=cfg.run_dir, wandb=cfg.wandb), run_config=config_record(cfg),
                      console=console)
    _announce(spec, cfg.placement.launcher)
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
         "checkpoint": summary.checkpoint, "rewards": summary.rewards, "wall_s": time.time() - start}, indent=2))
    return summary


def _announce(spec: RunSpec, launcher: str) -> None:
    """The start-up line of the launch: which processes start where."""
    from asyncrl.console import phase
    if launcher == "local":
        phase(f"running in this process: the trainer and {len(spec.agents)} rollout agent thread(s)")
        return
    if launcher == "torchrun":
        return  # every rank is its own process, started by torchrun
    trainers = ", ".join(f"trainer{r} on {d}" for r, d in enumerate(spec.trainer_devices))
    if spec.colocate:
        phase(f"starting {spec.num_trainers} processes: {trainers} (each hosts a rollout engine)")
        return
    agents = ", ".join(f"agent{i} on {a.device}" for i, a in enumerate(spec.agents))
    count = spec.num_trainers + len(spec.agents)
    phase(f"starting {count} process{'es' * (count != 1)}: {trainers}; {agents}")


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
