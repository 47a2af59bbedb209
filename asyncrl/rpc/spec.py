"""What a multi-process run is made of, as picklable data: the model to build, each rollout agent, and the run.

A `RunSpec` travels to every process (the spawned ranks, a torchrun rank, an agent joining later); each process
builds what its role needs from it (`asyncrl.rpc.assembly`). Nothing here starts a process or a thread.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable

import torch

from asyncrl.config import (LORA_TARGETS, AlgorithmConfig, AsyncConfig, EvalConfig, LoraConfig, PlacementConfig, RolloutConfig,
                            TrainerConfig)
from asyncrl.data.scoring import Scorer
from asyncrl.data.sources import PromptSource
from asyncrl.policies.engine import Engine, EngineConfig
from asyncrl.policies.implementations import Impl
from asyncrl.policies.loading import (empty_model, gguf_cache_dir, hf_config, load_model, random_model,
                                      resolve_model_dir, smollm2_gguf_path)
from asyncrl.policies.model import CausalLM
from asyncrl.policies.model_directory import ModelDirectory, random_hf_directory
from asyncrl.policies.protocol import RolloutEngine
from asyncrl.tools.hub import local_model_path
from asyncrl.types import Prompt

__all__ = ["ModelSpec", "AgentSpec", "RunSpec", "EngineFactory", "build_embedded_engine"]

EngineFactory = Callable[..., RolloutEngine]
"""`(model, engine_config, *, agent: str) -> RolloutEngine`: how an agent turns its model into an engine."""


def build_embedded_engine(model: CausalLM, config: EngineConfig, *, agent: str) -> RolloutEngine:
    """The default engine factory: asyncrl's own continuous-batching engine."""
    return Engine(model, config)


@dataclasses.dataclass
class ModelSpec:
    """How to build the model in any process: a path for `load_model`, or a config dict for random weights, and
    the implementation that trains it (`asyncrl.policies.implementations.resolve_impl`, settled before launch)."""

    path: str = "smollm2"
    config: dict | None = None
    seed: int = 0
    dtype: str = "float32"
    impl: Impl = "own"
    """own: asyncrl's `CausalLM`; hf: the `transformers` model of the checkpoint (`asyncrl.policies.hf_model`)."""

    def build(self, device: str | torch.device = "cpu", dtype: str | None = None, *, weights: bool = True
              ) -> CausalLM:
        """The model on `device`; `weights` False: its weights left uninitialised where the shapes are known without
        them (`empty_model`: a learner a restore point fills, built without reading or drawing them)."""
        torch_dtype = getattr(torch, dtype or self.dtype)
        if not weights and (shapes := self._shapes()) is not None:
            config, drawn = shapes
            return empty_model(config, dtype=torch_dtype, device=device, cast_buffers=drawn)
        if self.config is not None:
            return random_model(self.config, seed=self.seed, dtype=torch_dtype, device=device, impl=self.impl)
        return load_model(self.path, dtype=torch_dtype, device=device, seed=self.seed, impl=self.impl)

    def _shapes(self) -> tuple[str | dict, bool] | None:
        """Where `empty_model` reads this model's config, and whether its weights are drawn (random: its buffers
        cast as `random_model` casts them); None when only a full build knows (the transformers implementation, a
        GGUF file not converted yet)."""
        if self.impl != "own":
            return None
        if self.config is not None or self.path.startswith("random:"):
            return (self.config if self.config is not None else self.path.removeprefix("random:")), True
        if self.path == "smollm2" or self.path.endswith(".gguf"):
            cached = gguf_cache_dir(smollm2_gguf_path() if self.path == "smollm2" else pathlib.Path(self.path))
            return (str(cached), False) if (cached / "model.safetensors").is_file() else None
        return str(local_model_path(self.path, "--model.path")), False

    def directory(self, device: str = "cpu", dtype: str | None = None) -> ModelDirectory:
        """The model as a Hugging Face directory, for an engine that loads it itself (vLLM, for impl "hf"): a path's
        resolved directory (a Hub name's snapshot, a GGUF file's converted copy); for random weights (`config`, or
        a 'random:' path) a directory written once per process with the weights `random_model(config,
        impl="hf", seed=seed)` builds: both are `asyncrl.policies.hf_model.random_transformers`
        (torch.manual_seed(seed), then `AutoModelForCausalLM.from_config(AutoConfig.for_model(**config),
        dtype=float32)`), so the engine starts from the learner's weights."""
        torch_dtype = getattr(torch, dtype or self.dtype)
        if self.config is not None or self.path.startswith("random:"):
            config = self.config if self.config is not None else hf_config(self.path.removeprefix("random:"))
            path = random_hf_directory(config, seed=self.seed)
        elif self.path == "smollm2":
            path = resolve_model_dir(smollm2_gguf_path())
        else:
            path = resolve_model_dir(local_model_path(self.path, "--model.path"))
        return ModelDirectory(str(path), torch_dtype, str(device))


@dataclasses.dataclass
class AgentSpec:
    """One rollout agent: its device, its engine's precision and size, and how its engine is built."""

    device: str = "cpu"
    engine_dtype: str = "float32"
    max_len: int | None = None
    """KV slot length (default: rollout.max_prompt_length + rollout.max_new_tokens)."""
    engine_factory: EngineFactory = build_embedded_engine
    """Builds the engine from the model (another backend, or a wrapper that adds instrumentation)."""


@dataclasses.dataclass
class RunSpec:
    """Everything a multi-process run needs, picklable (sent to every process)."""

    model: ModelSpec
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    rollout: RolloutConfig
    async_: AsyncConfig
    source_factory: Callable[[], PromptSource]
    scorer_factory: Callable[..., Scorer]
    """Builds the scorer in the process that scores: `scorer_factory(workers=pool)`, where `pool` is the agent's
    worker processes for sync user code (`asyncrl.rpc.worker_pool`) or None; `scorer_factory()` in-process."""
    env_setup: Callable[..., Any] | None = None
    """Builds each agent's `asyncrl.envs.EnvRuntime` for multi-turn episodes (None: one turn per response), called
    like `scorer_factory` (`env_setup(workers=pool)`)."""
    agents: list[AgentSpec] = dataclasses.field(default_factory=lambda: [AgentSpec()])
    trainer_devices: list[str] = dataclasses.field(default_factory=lambda: ["cpu"])
    reference: bool = False
    """Build a frozen reference model (needed by KL losses); a LoRA run's reference is its base instead."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """Adapters on the policy (rank 0: none): the learner trains them, the engines merge the published ones."""
    lora_targets: tuple[str, ...] = LORA_TARGETS
    """The leaf names of the layers `lora` adapts on this model (--lora.target-modules resolved against it before
    launch): what the engines accept adapters and base weights for."""
    seed: int = 0
    run_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    """Resume from the newest checkpoint in run_dir; refused when there is none (unless resume_or_start)."""
    resume_or_start: bool = False
    """Resume when run_dir holds a checkpoint, start fresh otherwise."""
    resume_from: str | None = None
    """The checkpoint the run resumes from, once `asyncrl.rpc.assembly.resolve_resume` has chosen it (and
    consumed `resume` / `resume_or_start`); None: a fresh start."""
    rpc_timeout_s: float = 120.0
    startup_timeout_s: float = 600.0
    """How long rank 0 waits for the configured agents to build their engines and join."""
    bucket_mb: int = 256
    colocate: bool = False
    """Host agent i inside trainer rank i's process, on its device (needs one agent per trainer)."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Held-out evaluation during training (`--eval.*`)."""
    eval_prompts: Callable[[], list[Prompt]] | None = None
    """Builds the held-out prompts on rank 0 (None: no evaluation)."""
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    """The process and network knobs (`--placement.*`): address, join port, token file, threads per process,
    agent restarts and back-off, the wall-clock cap, user-code workers. The roles this spec runs are
    `trainer_devices` and `agents`; the launchers read no devices from here."""

    def __post_init__(self):
        if self.colocate and len(self.agents) != len(self.trainer_devices):
            raise ValueError(f"colocate=True hosts one agent per trainer rank: got {len(self.agents)} agents for "
                             f"{len(self.trainer_devices)} trainer devices; give one AgentSpec per trainer device")

    @property
    def num_trainers(self) -> int:
        return len(self.trainer_devices)

    @property
    def num_agent_processes(self) -> int:
        return 0 if self.colocate else len(self.agents)

    def agent_spec(self, slot: int, device: str | None = None) -> AgentSpec:
        """The spec of agent `slot`; an agent joining beyond the configured ones copies agent 0's, on `device`."""
        base = self.agents[slot] if slot < len(self.agents) else self.agents[0]
        return base if device is None else dataclasses.replace(base, device=device)

    def engine_config(self, agent: AgentSpec, slot: int) -> EngineConfig:
        max_len = agent.max_len or (self.rollout.max_prompt_length + self.rollout.max_new_tokens)
        return EngineConfig(max_slots=self.rollout.max_slots, max_len=max_len, cuda_graphs=self.rollout.cuda_graphs,
                            decode_attention=self.rollout.decode_attention, kv_dtype=self.rollout.kv_dtype,
                            speculation=self.rollout.speculation, kv_layout=self.rollout.kv_layout,
                            max_prompt_len=self.rollout.max_prompt_length if self.rollout.kv_layout == "shared-prompt"
                            else None, max_prompts=self.rollout.max_prompts or self.rollout.concurrent_prompts,
                            share_prefix=self.rollout.share_prefix,
                            seed=self.seed + slot, lora_rank=self.lora.rank, lora_alpha=self.lora.alpha,
                            lora_targets=self.lora_targets)
