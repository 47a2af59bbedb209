"""Ready-made runs, as Python objects (`asyncrl train <preset> --field value` overrides any field)."""

from __future__ import annotations

from asyncrl.config import (
    GRPO, AsyncConfig, DataConfig, ModelConfig, OffPolicyConfig, OptimConfig, PlacementConfig, RolloutConfig,
    RunConfig, TrainerConfig,
)

__all__ = ["PRESETS"]

CPU_DEMO = RunConfig(
    model=ModelConfig(path="smollm2"),
    data=DataConfig(task="arithmetic", digits=1, operators="+", system_prompt="Reply with the result only."),
    algorithm=GRPO(clip_ratio_high=0.28),
    rollout=RolloutConfig(n=8, temperature=1.0, max_new_tokens=8, max_prompt_length=64, max_slots=32),
    trainer=TrainerConfig(mini_batch_size=4, max_tokens_per_micro_batch=2048, temperature=1.0,
                          max_response_length=8, optim=OptimConfig(lr=2e-5)),
    async_training=AsyncConfig(staleness_threshold=0.5, trigger_parameter_sync_step=1, partial_rollout=True,
                               total_versions=20),
    placement=PlacementConfig(launcher="rpc", trainer_devices=("cpu",), agent_devices=("cpu",)),
    run_dir="runs/cpu-demo",
)
"""SmolLM2-135M-Instruct learns single-digit sums on a 2-core CPU: 1 trainer + 1 rollout process, fully async."""

PRESETS: dict[str, tuple[str, RunConfig]] = {
    "cpu-demo": ("SmolLM2-135M on single-digit arithmetic, fully async on CPU (the `make train` job)", CPU_DEMO),
}
