"""asyncrl: asynchronous RL post-training of language models in PyTorch.

The public API is the names in `__all__`. Each is imported from its home the first time it is used, so
`import asyncrl` loads neither torch nor any module of the library (nothing runs at import):

    import asyncrl
    about, cfg = asyncrl.PRESETS["cpu-demo"]            # what the preset is for, and its RunConfig
    summary = asyncrl.train(cfg)                        # checks, launches, returns the RunSummary

* configs (`asyncrl.config`): `RunConfig`, one flat dataclass per component, the algorithms (`GRPO`, `DAPO`,
  `PPO`, ...) and `PRESETS`;
* the command: `train` (`asyncrl.launch.train`) and its `RunSummary`;
* records that cross components (`asyncrl.types`): `Prompt`, `Completion`, `Group`, `GroupInfo`,
  `GenerationOutput`;
* packages: `algos` (pure RL math), `rewards` (pure reward functions), `envs` (multi-turn environments and
  tools), `data` (prompt sources, scoring), `policies` (the model and the rollout engines), `learner` (one
  training step), `checkpoint` (save, resume, export), `config`, `types`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_PACKAGES = ("algos", "checkpoint", "config", "data", "envs", "learner", "policies", "rewards", "types")
_NAMES = {  # home module -> the public names it holds
    "asyncrl.config": ("RunConfig", "ModelConfig", "DataConfig", "RolloutConfig", "VLLMConfig", "TrainerConfig",
                       "OptimConfig", "OffPolicyConfig", "AsyncConfig", "PlacementConfig", "RewardConfig",
                       "EnvConfig", "EvalConfig", "LoraConfig", "CriticConfig", "AlgorithmConfig", "GRPO", "DrGRPO",
                       "DAPO", "GSPO", "CISPO", "RLOO", "ReinforcePP", "PPO", "PRESETS"),
    "asyncrl.launch.train": ("train",),
    "asyncrl.runtime.controller": ("RunSummary",),
    "asyncrl.types": ("Prompt", "Completion", "Group", "GroupInfo", "GenerationOutput"),
}
_HOMES = {name: home for home, names in _NAMES.items() for name in names}

__all__ = ["__version__", *_PACKAGES, *_HOMES]

if TYPE_CHECKING:  # what static tools and editors see; at run time, `__getattr__` below
    from asyncrl import algos, checkpoint, config, data, envs, learner, policies, rewards, types
    from asyncrl.config import (CISPO, DAPO, GRPO, GSPO, PPO, PRESETS, RLOO, AlgorithmConfig, AsyncConfig,
                                CriticConfig, DataConfig, DrGRPO, EnvConfig, EvalConfig, LoraConfig, ModelConfig,
                                OffPolicyConfig, OptimConfig, PlacementConfig, ReinforcePP, RewardConfig,
                                RolloutConfig, RunConfig, TrainerConfig, VLLMConfig)
    from asyncrl.launch.train import train
    from asyncrl.runtime.controller import RunSummary
    from asyncrl.types import Completion, GenerationOutput, Group, GroupInfo, Prompt


def __getattr__(name: str):
    """A public name, from its home (imported the first time; a package, once imported, is an attribute of
    this one and no longer comes here)."""
    if name in _PACKAGES:
        return importlib.import_module(f"asyncrl.{name}")
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
