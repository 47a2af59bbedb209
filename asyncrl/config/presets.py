"""Ready-made runs, as Python objects (`asyncrl train <preset> --field value` overrides any field)."""

from __future__ import annotations

import dataclasses

from asyncrl.config.run_config import (
    GRPO, AsyncConfig, DataConfig, EnvConfig, EvalConfig, LoraConfig, ModelConfig, OffPolicyConfig, OptimConfig, PlacementConfig,
    RolloutConfig, RunConfig, TrainerConfig,
)

__all__ = ["PRESETS"]

CPU_DEMO = RunConfig(
    model=ModelConfig(path="smollm2"),
    data=DataConfig(task="arithmetic", digits=1, operators="+", system_prompt="Reply with the result only."),
    algorithm=GRPO(clip_ratio_high=0.28),
    rollout=RolloutConfig(n=8, temperature=1.0, max_new_tokens=8, max_prompt_length=64, max_slots=32),
    trainer=TrainerConfig(mini_batch_size=4, max_tokens_per_micro_batch=2048,
                          max_response_length=8, optim=OptimConfig(lr=2e-5)),
    async_training=AsyncConfig(staleness_threshold=0.5, trigger_parameter_sync_step=1, partial_rollout=True,
                               total_versions=20),
    placement=PlacementConfig(launcher="rpc", trainer_devices=("cpu",), agent_devices=("cpu",)),
    run_dir="runs/cpu-demo",
    checkpoint_every=20,  # the last version: `asyncrl eval --model runs/cpu-demo/checkpoints/step_00000020`
    eval=EvalConfig(every_versions=5, at_start=True, at_end=True, max_prompts=32, max_share=0.5),
)
"""SmolLM2-135M-Instruct learns single-digit sums on a 2-core CPU: 1 trainer + 1 rollout process, fully async.
It evaluates 32 held-out sums (greedy, another task seed than training's) at versions 0, 5, 10, 15 and 20 on the
agent beside training; `--eval.every-versions 0 --eval.no-at-start --eval.no-at-end` turns that off."""

CPU_DEMO_LORA = dataclasses.replace(
    CPU_DEMO,
    lora=LoraConfig(rank=16, alpha=32.0),
    trainer=dataclasses.replace(CPU_DEMO.trainer, optim=OptimConfig(lr=2e-4)),
    run_dir="runs/cpu-demo-lora",
)
"""cpu-demo with LoRA: rank-16 adapters (alpha 32) on every linear layer of SmolLM2-135M, the base frozen; lr 2e-4,
10x cpu-demo's full fine-tuning lr, as "LoRA Without Regret" (Thinking Machines, 2025) finds for RL. Each
publication sends the adapters (4.9M fp32 parameters, 19.5 MB) instead of the 135M weights. Measured once on the
2-core machine (2026-11-26): reward 0.06 at version 1, 0.78 at version 6, 1.00 at versions 18-20; the 20
versions in 8.0 minutes; a checkpoint is 57 MB (cpu-demo's: 1.6 GB)."""

CPU_RETRY = RunConfig(
    model=ModelConfig(path="smollm2"),
    data=DataConfig(task="arithmetic", digits=1, operators="+", system_prompt="Reply with the result only."),
    algorithm=GRPO(clip_ratio_high=0.28),
    rollout=RolloutConfig(n=8, temperature=1.0, max_new_tokens=48, max_prompt_length=64, max_slots=32),
    trainer=TrainerConfig(mini_batch_size=4, max_tokens_per_micro_batch=4096, max_response_length=48,
                          optim=OptimConfig(lr=2e-5)),
    async_training=AsyncConfig(staleness_threshold=0.5, trigger_parameter_sync_step=1, partial_rollout=True,
                               total_versions=12),
    placement=PlacementConfig(launcher="rpc", trainer_devices=("cpu",), agent_devices=("cpu",)),
    env=EnvConfig(fn="retry", max_turns=3, max_turn_tokens=8),
    run_dir="runs/cpu-retry",
)
"""SmolLM2-135M-Instruct answers single-digit sums over up to 3 turns: a wrong answer hears "Too high. Try
again." (or too low) and the reward halves per extra turn (1, 0.5, 0.25). Fully async on a 2-core CPU, like
cpu-demo; the episode (3 turns of at most 8 tokens and the feedback between them) fits 48 tokens."""

GSM8K_QWEN2_5_0_5B = RunConfig(
    model=ModelConfig(path="<path to Qwen2.5-0.5B-Instruct>"),
    data=DataConfig(path="<path to gsm8k train.parquet>", on_long="filter", shuffle=True),
    algorithm=GRPO(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean", kl_loss_coef=0.001,
                   kl_loss_type="low_var_kl", overlong_buffer_len=512, overlong_penalty_factor=1.0),
    rollout=RolloutConfig(n=8, temperature=1.0, max_new_tokens=3072, max_prompt_length=1024, max_slots=256),
    trainer=TrainerConfig(mini_batch_size=32, use_dynamic_bsz=True, max_tokens_per_micro_batch=16384,
                          gradient_checkpointing=True, max_response_length=3072,
                          optim=OptimConfig(lr=1e-6, warmup_steps=10),
                          off_policy=OffPolicyConfig(use_rollout_log_probs=True)),
    async_training=AsyncConfig(staleness_threshold=0.2, trigger_parameter_sync_step=4, require_batches=1,
                               partial_rollout=True, total_versions=120),
    placement=PlacementConfig(launcher="rpc", trainer_devices=("cuda:0",), agent_devices=("cuda:1",)),
    checkpoint_every=20,
    run_dir="runs/gsm8k-qwen2.5-0.5b",
)
"""verl's fully-async GRPO on GSM8K with Qwen2.5-0.5B-Instruct on two GPUs (trainer cuda:0, rollout cuda:1):

    asyncrl data convert-gsm8k --src gsm8k/train.jsonl --out data/gsm8k/train.parquet
    asyncrl train gsm8k-qwen2.5-0.5b --model.path /models/Qwen2.5-0.5B-Instruct --data.path data/gsm8k/train.parquet

A version is trigger 4 × require_batches 1 × mini-batch 32 = 128 prompts (1,024 responses); 120 versions are
about two epochs of GSM8K's 7,473 training prompts. GSM8K prompts are 100-250 tokens, so 1,024 filters none.
The rollout may run ahead by staleness 0.2 (153 prompts admitted per version); partial rollouts carry
in-flight responses across weight updates. Micro-batches hold up to 16,384 tokens (4 full-length rows)."""

GSM8K_CALCULATOR_QWEN2_5_0_5B = dataclasses.replace(
    GSM8K_QWEN2_5_0_5B,
    rollout=dataclasses.replace(GSM8K_QWEN2_5_0_5B.rollout, max_new_tokens=2048),
    trainer=dataclasses.replace(GSM8K_QWEN2_5_0_5B.trainer, max_response_length=2048),
    algorithm=dataclasses.replace(GSM8K_QWEN2_5_0_5B.algorithm, overlong_buffer_len=256),
    env=EnvConfig(fn="calculator", max_turns=6, max_turn_tokens=768),
    run_dir="runs/gsm8k-calculator-qwen2.5-0.5b",
)
"""GSM8K with a calculator tool, Qwen2.5-0.5B-Instruct, 2 GPUs: Qwen's chat template tells the model about
`calculator(expression)`; each <tool_call> is answered with a tool message; the final answer (a turn without a
call) is scored by the GSM8K reward. Up to 6 turns of at most 768 tokens, 2,048 response tokens per episode
(tool outputs included, not trained):

    asyncrl train gsm8k-calculator-qwen2.5-0.5b --model.path /models/Qwen2.5-0.5B-Instruct \
        --data.path data/gsm8k/train.parquet"""

QWEN3_8B_LORA = RunConfig(
    model=ModelConfig(path="random:qwen3-8b"),
    data=DataConfig(task="toy"),
    algorithm=GRPO(clip_ratio_high=0.28),
    rollout=RolloutConfig(n=8, temperature=1.0, max_new_tokens=512, max_prompt_length=512, max_slots=128),
    trainer=TrainerConfig(mini_batch_size=16, max_tokens_per_micro_batch=16384, gradient_checkpointing=True,
                          checkpoint_scope="layer", max_response_length=512, optim=OptimConfig(lr=1e-5)),
    async_training=AsyncConfig(staleness_threshold=0.0, trigger_parameter_sync_step=1, colocated=True,
                               total_versions=10),
    placement=PlacementConfig(launcher="rpc", trainer_devices=("cuda:0",), agent_devices=("cuda:0",)),
    lora=LoraConfig(rank=32, alpha=32.0),
    run_dir="runs/qwen3-8b-lora",
)
"""A Qwen3-8B-shaped model (random weights unless --model.path gives real ones) trained with rank-32 LoRA on
one GPU: the trainer process hosts the engine (colocated; the engine frees its KV cache while the learner
trains). The frozen base is bf16 (16.4 GB), the adapters fp32 (87M parameters: 1.4 GB with their gradients and
AdamW moments); lr 1e-5, 10x a full fine-tuning lr. Whole decoder layers are recomputed in the backward pass:
a step of 16 x 8 ragged rows (55k tokens, KL to the base included) peaked at 27.4 GiB on an H200 (8.9k tok/s)
against 58.0 GiB with MLP-only recompute (10.3k tok/s), leaving the engine room on an 80 GB card. Measured
on one H100 (2026-11-26, 3 versions): 13.3 s a version after the first (update 6.3 s, generation of 128 x 512
tokens 6.9 s), 4,980 trained tok/s, each publication 349 MB of adapters in 0.07 s, peak 63.4 GiB allocated
(76.7 GiB reserved) by the process holding learner and engine. Fully async on the same GPU: --async-training.no-colocated
--async-training.staleness-threshold 0.5 (trainer and agent processes both on cuda:0). With real weights:

    asyncrl train qwen3-8b-lora --model.path /models/Qwen3-8B --data.path data/gsm8k/train.parquet"""

PRESETS: dict[str, tuple[str, RunConfig]] = {
    "cpu-demo": ("SmolLM2-135M on single-digit arithmetic, fully async on CPU (the `make train` job)", CPU_DEMO),
    "cpu-demo-lora": ("cpu-demo with rank-16 LoRA adapters on SmolLM2-135M (frozen base, lr 2e-4), fully async on "
                      "CPU", CPU_DEMO_LORA),
    "cpu-retry": ("SmolLM2-135M on single-digit sums over up to 3 turns with too-high/too-low feedback (multi-turn, "
                  "fully async on CPU)", CPU_RETRY),
    "gsm8k-qwen2.5-0.5b": ("Qwen2.5-0.5B-Instruct GRPO on GSM8K, fully async on 2 GPUs (needs --model.path and "
                           "--data.path)", GSM8K_QWEN2_5_0_5B),
    "gsm8k-calculator-qwen2.5-0.5b": ("Qwen2.5-0.5B-Instruct on GSM8K with a calculator tool, multi-turn, fully async "
                                      "on 2 GPUs (needs --model.path and --data.path)", GSM8K_CALCULATOR_QWEN2_5_0_5B),
    "qwen3-8b-lora": ("Qwen3-8B shape (random weights unless --model.path) with rank-32 LoRA on one GPU, colocated",
                      QWEN3_8B_LORA),
}
