"""From a `RunConfig` to the `RunSpec` both launchers run (`build_spec`), and the small picklable factories it
holds: the multi-process launcher sends each to the process that uses it (the prompt source to the trainer,
the scorer and the environment setup to each agent), where it builds the tokenizer and the task locally.

    spec = build_spec(cfg)          # what `asyncrl.launch.train.train` launches; `asyncrl.launch.preflight` checks it
    source = SourceFactory(cfg.data, tokenizer_path(cfg), cfg.rollout.max_prompt_length)()

The checks (`asyncrl.launch.preflight`), evaluation (`asyncrl.evaluate`) and export (`asyncrl.export`) build prompts,
scorers and tokenizers with the same functions, so they read the data exactly as a run does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable
import logging

from asyncrl.config import LORA_TARGETS, DataConfig, EnvConfig, EvalConfig, RunConfig
from asyncrl.config.run_config import ALL_LINEAR
from asyncrl.data.files import RowKeys, load_prompt_file
from asyncrl.data.scoring import Scorer, Workers, decode_ids
from asyncrl.data.sources import DatasetSource, GeneratedSource, PromptSource
from asyncrl.data.tasks import ArithmeticTask, CountdownTask, ToyTask
from asyncrl.envs import ChatRenderer, EnvRuntime, TokenRenderer, env_tool_schemas, load_env
from asyncrl.envs.isolated import runs_isolated
from asyncrl.policies.implementations import resolve_backend, resolve_impl
from asyncrl.policies.loading import load_tokenizer
from asyncrl.policies.vllm_engine import build_vllm_engine
from asyncrl.rewards.plugin import RewardTable, absolute_reward_spec
from asyncrl.rpc.spec import AgentSpec, ModelSpec, RunSpec, build_embedded_engine
from asyncrl.types import Prompt

__all__ = ["SourceFactory", "ScorerFactory", "EnvSetup", "build_spec", "tokenizer_path", "run_tokenizer", "task_of",
           "row_keys", "with_system", "env_tools"]

log = logging.getLogger(__name__)


def tokenizer_path(cfg: RunConfig) -> str:
    """Where a run's tokenizer comes from: --model.tokenizer, else the model ('random:…' has none)."""
    return cfg.model.tokenizer or cfg.model.path


def run_tokenizer(model_path: str):
    """The tokenizer of a model path, None for 'random:' models."""
    if model_path.startswith("random:"):
        return None
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
            return DatasetSource(self.file_prompts(), seed=self.data.seed, shuffle=self.data.shuffle)
        return GeneratedSource(self.task_maker())

    def task_maker(self) -> Callable[[int], Prompt]:
        """index -> prompt `index` of the built-in task."""
        tokenizer = with_system(run_tokenizer(self.model_path), self.data.system_prompt, env_tools(self.env_fn))
        task = task_of(self.data)

        def make(index: int) -> Prompt:
            prompt = task.prompt(index, tokenizer)
            if len(prompt.prompt_ids) > self.max_prompt_length:
                raise ValueError(f"{self.data.task} prompt {index} has {len(prompt.prompt_ids)} tokens > "
                                 f"--rollout.max-prompt-length {self.max_prompt_length}; raise it")
            return prompt

        return make

    def file_prompts(self, flag: str = "--data.path") -> list[Prompt]:
        """The rows of the prompt file, rendered and length-filtered."""
        tokenizer = run_tokenizer(self.model_path)
        if tokenizer is None:
            raise ValueError(f"{flag} {self.data.path} needs a tokenizer to render its prompts, and "
                             f"--model.path {self.model_path} has none; use a model with a tokenizer, set "
                             "--model.tokenizer, or --data.task toy for random models")
        tokenizer = with_system(tokenizer, None, env_tools(self.env_fn))
        prompts, stats = load_prompt_file(self.data.path, tokenizer, max_prompt_length=self.max_prompt_length,
                                          on_long=self.data.on_long, on_empty=self.data.on_empty,
                                          system_prompt=self.data.system_prompt, keys=row_keys(self.data))
        log.info("data: %s: %d rows, %d kept, %d filtered (longer than %d tokens), %d truncated, %d empty dropped",
                 self.data.path, stats["rows"], stats["kept"], stats["filtered_too_long"], self.max_prompt_length,
                 stats["truncated"], stats["empty"])
        if not stats["rows"]:
            raise ValueError(f"{flag} {self.data.path} holds no rows; check the file")
        if not prompts:
            raise ValueError(f"{flag} {self.data.path}: all {stats['rows'] - stats['empty']} prompts are longer "
                             f"than --rollout.max-prompt-length {self.max_prompt_length} tokens; raise it or pass "
                             "--data.on-long truncate")
        return prompts


def row_keys(data: DataConfig) -> RowKeys:
    """Where --data.path's rows keep their prompt and answer (--data.prompt-key / answer-key / data-source)."""
    return RowKeys(prompt=data.prompt_key, answer=data.answer_key, data_source=data.data_source)


@dataclasses.dataclass
class EvalPrompts:
    """The held-out prompts of `--eval.*` (built on rank 0): the rows of every --eval.data file in order, or the
    training task's prompts under --eval.task-seed; the first --eval.max-prompts of them (the task: 64 unless
    given)."""

    eval: EvalConfig
    data: DataConfig
    model_path: str
    max_prompt_length: int
    env_fn: str | None = None

    def __call__(self) -> list[Prompt]:
        limit = self.eval.max_prompts
        if not self.eval.data:
            task_data = dataclasses.replace(self.data, seed=self.eval.task_seed)
            make = SourceFactory(task_data, self.model_path, self.max_prompt_length, self.env_fn).task_maker()
            return [make(i) for i in range(limit or 64)]
        prompts: list[Prompt] = []
        for path in self.eval.data:
            rows = dataclasses.replace(self.data, path=path, shuffle=False)
            prompts += SourceFactory(rows, self.model_path, self.max_prompt_length, self.env_fn).file_prompts("--eval.data")
        return prompts[:limit]


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


def resolved_lora_targets(cfg: RunConfig, impl: str) -> tuple[str, ...]:
    """The leaf names --lora.target-modules adapts on the run's model: on asyncrl's own models all-linear is the
    seven projections; on an HF-path model the layers it has (read from the model built on the meta device)."""
    if not cfg.lora.enabled or (impl == "own" and cfg.lora.target_modules == (ALL_LINEAR,)):
        return LORA_TARGETS
    if impl == "own":
        return tuple(cfg.lora.target_modules)
    from asyncrl.policies.implementations import model_config_dict
    from asyncrl.policies.lora import lora_targets
    from asyncrl.policies.meta_model import meta_transformers
    try:
        return lora_targets(meta_transformers(model_config_dict(cfg.model.path)), cfg.lora.target_modules)
    except ValueError:  # names the model lacks: the preflight's LoRA check says which, naming the flag
        return tuple(cfg.lora.target_modules)


def _engine_dtype(cfg: RunConfig, device: str, *, vllm: bool = False) -> str:
    """--model.engine-dtype on `device`: auto is bf16 on CUDA, fp32 on CPU, except that vLLM on CPU runs a hybrid
    model's Gated DeltaNet layers in bf16 only (a float32 engine of one is refused before launch)."""
    recurrent = vllm and not device.startswith("cuda") and _has_recurrent_layers(cfg.model.path)
    if cfg.model.engine_dtype != "auto":
        if recurrent and cfg.model.engine_dtype != "bfloat16":
            raise ValueError(f"--model.engine-dtype {cfg.model.engine_dtype}: vLLM on CPU runs the linear-attention "
                             f"layers of {cfg.model.path} in bfloat16 only; pass --model.engine-dtype bfloat16 or auto")
        return cfg.model.engine_dtype
    return "bfloat16" if device.startswith("cuda") or recurrent else "float32"


def _has_recurrent_layers(path: str) -> bool:
    from asyncrl.policies.implementations import model_config_dict
    from asyncrl.policies.model_directory import has_recurrent_layers
    try:
        return has_recurrent_layers(model_config_dict(path))
    except ValueError:  # no config.json there: the preflight names --model.path
        return False


def _run_impl(cfg: RunConfig) -> str:
    """--model.impl resolved on the run's model (`resolve_impl`). A path without a config.json yet (a download the
    preflight asks for, naming --model.path) still gives a spec: own, unless hf was asked for."""
    from asyncrl.policies.implementations import model_config_dict
    try:
        config = model_config_dict(cfg.model.path)
    except ValueError:
        return "hf" if cfg.model.impl == "hf" else "own"
    return resolve_impl(cfg.model.path, cfg.model.impl, config=config)


def build_spec(cfg: RunConfig, *, validated: bool = False) -> RunSpec:
    """The run `cfg` describes. `cfg` is validated first unless `validated` says the caller did (preflight
    does: `asyncrl train` validates once)."""
    if not validated:
        cfg.validate()
    impl = _run_impl(cfg)
    model = ModelSpec(path=cfg.model.path, seed=cfg.model.seed, dtype=cfg.trainer.param_dtype, impl=impl)
    factory = build_embedded_engine
    if resolve_backend(impl, cfg.rollout.backend) == "vllm":
        factory = functools.partial(build_vllm_engine, options=cfg.rollout.vllm,
                                    return_routes=cfg.trainer.routing_replay == "r3")
    elif cfg.rollout.vllm.tensor_parallel_size != 1:
        raise ValueError(f"--rollout.vllm.tensor-parallel-size {cfg.rollout.vllm.tensor_parallel_size} shards vLLM's "
                         f"model, but --rollout.backend {cfg.rollout.backend} runs the embedded engine for "
                         f"{cfg.model.path} (one device); add --rollout.backend vllm")
    agents = [AgentSpec(device=d, engine_dtype=_engine_dtype(cfg, d, vllm=factory is not build_embedded_engine),
                        engine_factory=factory)
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
                   lora_targets=resolved_lora_targets(cfg, impl),
                   reference=cfg.algorithm.needs_reference and not cfg.lora.enabled,  # LoRA: the base is the reference
                   seed=cfg.seed, run_dir=cfg.run_dir, checkpoint_every=cfg.checkpoint_every, resume=cfg.resume,
                   resume_or_start=cfg.resume_or_start, placement=cfg.placement, eval=cfg.eval,
                   eval_prompts=EvalPrompts(cfg.eval, cfg.data, tokenizer, cfg.rollout.max_prompt_length, cfg.env.fn)
                   if cfg.evaluates else None,
                   colocate=cfg.async_training.colocated and cfg.placement.launcher != "local")
