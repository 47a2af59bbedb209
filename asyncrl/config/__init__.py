"""Configuration: flat typed dataclasses, one per component (`RunConfig` gathers them), the presets, and the
flag helpers every check uses to name what the user typed. This is the floor under the components: it imports
only `asyncrl.algos` (the algorithm dataclasses call its pure functions) and nothing else of the library.

    from asyncrl.config import RunConfig, PRESETS
    about, cfg = PRESETS["cpu-demo"]      # what the preset is for, and its RunConfig
"""

from asyncrl.config.presets import PRESETS
from asyncrl.config.run_config import (CISPO, DAPO, GRPO, GSPO, LORA_TARGETS, PPO, RLOO, AlgorithmConfig,
                                       AsyncConfig, CriticConfig, DataConfig, DrGRPO, EnvConfig, EvalConfig,
                                       LoraConfig, ModelConfig, OffPolicyConfig, OptimConfig, PlacementConfig,
                                       ReinforcePP, RewardConfig, RolloutConfig, RunConfig, TrainerConfig, VLLMConfig)

__all__ = [
    "RunConfig", "ModelConfig", "DataConfig", "RolloutConfig", "VLLMConfig", "TrainerConfig", "OptimConfig",
    "OffPolicyConfig", "AsyncConfig", "PlacementConfig", "RewardConfig", "EnvConfig", "EvalConfig", "LoraConfig",
    "LORA_TARGETS", "AlgorithmConfig", "GRPO", "DrGRPO", "DAPO", "GSPO", "CISPO", "RLOO", "ReinforcePP", "PPO",
    "CriticConfig", "PRESETS",
]
