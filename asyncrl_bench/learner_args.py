"""The learner benchmark's flags (`asyncrl bench learner --help`) and the learner our step runs with.

Every flag that is a learner knob has the learner's own name and default, read from `TrainerConfig`
(`TRAINER_KNOBS`), so the benchmark times what a run with the defaults trains unless a flag says otherwise;
the other flags describe the workload (rows and their lengths) and the measurement.

    args = LearnerBenchArgs(workload="ragged", rows=64)
    args.trainer_config()      # TrainerConfig's defaults, these knobs, one optimizer step over the 64 rows
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from asyncrl.config import LoraConfig, OptimConfig, RolloutConfig, TrainerConfig

__all__ = ["LearnerBenchArgs", "TRAINER_KNOBS"]

TRAINER_KNOBS = ("max_tokens_per_micro_batch", "pack_sequences", "gradient_checkpointing", "checkpoint_scope",
                 "compile_layers", "compile_scope", "cuda_graphs", "fused_optimizer", "offload", "param_dtype",
                 "fsdp_reshard_after_forward")
"""The flags that are `TrainerConfig` fields of the same name and default (`--trainer.<name>` in a run)."""

LearnerWorkload = Literal["fixed", "ragged"]


@dataclasses.dataclass
class LearnerBenchArgs:
    """Learner train_step vs a plain `transformers` training step: trained tokens/s and MFU."""

    model: str = "random:qwen2.5-0.5b"
    """Model: an HF dir, a .gguf, 'smollm2', or 'random:<preset>'."""
    impl: Literal["auto", "own", "hf"] = "auto"
    """Ours: which implementation trains (--model.impl): asyncrl's own model, or the transformers model behind
    `HFCausalLM` (the HF path; run both on one machine to compare them)."""
    device: str = "cuda"
    rows: int = 16
    """Sequences per optimizer step (a multiple of --group-size)."""
    workload: LearnerWorkload = "fixed"
    """fixed: every row --prompt-len + --response-len tokens; ragged: per group a prompt length uniform in
    [--prompt-len-min, --prompt-len-max], per response a length uniform in [--response-len-min,
    --response-len-max] (RL-like batches)."""
    prompt_len: int = 64
    """fixed: tokens per prompt."""
    response_len: int = 256
    """fixed: tokens per response."""
    prompt_len_min: int = 64
    """ragged: shortest prompt."""
    prompt_len_max: int = 512
    """ragged: longest prompt."""
    response_len_min: int = 32
    """ragged: shortest response."""
    response_len_max: int = 2048
    """ragged: longest response."""
    group_size: int = RolloutConfig.n
    """Responses per prompt (a run's --rollout.n)."""
    max_tokens_per_micro_batch: int = TrainerConfig.max_tokens_per_micro_batch
    """Token budget of one forward/backward, ours and HF's (padded: rows × longest row)."""
    pack_sequences: bool = TrainerConfig.pack_sequences
    """Ours: a micro-batch's rows packed into one sequence (no padding compute); off: right-padded rows."""
    gradient_checkpointing: bool = TrainerConfig.gradient_checkpointing
    """Both sides recompute activations in the backward (HF's whole layers; ours: --checkpoint-scope)."""
    checkpoint_scope: Literal["layer", "mlp"] = TrainerConfig.checkpoint_scope
    """Ours, with gradient checkpointing: recompute only each decoder layer's MLP, or the whole layer."""
    compile_layers: bool = TrainerConfig.compile_layers
    """Ours: torch.compile each decoder layer (CUDA only)."""
    compile_scope: Literal["layer", "model"] = TrainerConfig.compile_scope
    """Ours: each decoder layer, or the model's whole forward, as one compiled region."""
    cuda_graphs: bool = TrainerConfig.cuda_graphs
    """Ours: the compiled layers replayed as CUDA graphs over bucketed packed lengths."""
    fused_optimizer: bool = TrainerConfig.fused_optimizer
    """Fused AdamW on CUDA, ours and HF's."""
    fsdp_reshard_after_forward: bool = TrainerConfig.fsdp_reshard_after_forward
    """With --ranks N > 1: free each layer's gathered weights after its forward (gather again for the backward)."""
    offload: Literal["none", "optimizer", "params"] = TrainerConfig.offload
    """Ours (optimizer: AdamW state in host memory, stepped on the GPU; params: FSDP2's CPU offload on a
    one-rank group)."""
    param_dtype: Literal["float32", "bfloat16"] = TrainerConfig.param_dtype
    """Ours (bfloat16 with --offload optimizer keeps an fp32 master copy on the host)."""
    steps: int = 5
    """Timed optimizer steps (after --warmup-steps)."""
    warmup_steps: int = 2
    """Untimed optimizer steps first, on their own rows (the first compiles; the next ones let the caching
    allocator settle), so the timed steps are steady state. The first step's seconds are reported apart."""
    ranks: int = 1
    """Trainer ranks: N > 1 times our step on a trainer group of N processes (FSDP2, one device each: cuda:0..N-1,
    or gloo processes on CPU), each step's --rows shared among them as a run's group shares a batch
    (`asyncrl_bench.learner_group`); the row gives the group's tok/s, per GPU, and each rank's peak memory.
    Ours only: add --no-baseline."""
    baseline: bool = True
    """Also time a transformers training step (with --lora.rank: transformers + peft's LoRA)."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """--lora.rank R > 0: both sides train rank-R adapters on a frozen base (bf16 on CUDA): `asyncrl_bench.lora`."""
    out: str | None = None
    """Write the result as JSON here."""

    def trainer_config(self, lr: float = OptimConfig.lr) -> TrainerConfig:
        """The learner of our step: `TrainerConfig`'s defaults with these knobs, one optimizer step over all
        `rows` (the HF step uses its optimizer settings too)."""
        return TrainerConfig(mini_batch_size=self.rows // self.group_size, optim=OptimConfig(lr=lr),
                             **self.trainer_knobs())

    def trainer_knobs(self) -> dict:
        """The `TRAINER_KNOBS` flags and their values."""
        return {name: getattr(self, name) for name in TRAINER_KNOBS}

    def validate(self) -> None:
        """Refuse impossible shapes (ValueError naming the CLI flag) before anything is loaded."""
        self.lora.validate()
        if self.offload != "none" and (self.baseline or self.lora.rank > 0):
            raise ValueError(f"--offload {self.offload} times our own step only (compare it with a run of "
                             "--offload none): add --no-baseline, and leave --lora.rank at 0")
        if self.group_size < 1 or self.rows < self.group_size or self.rows % self.group_size:
            raise ValueError(f"--rows {self.rows} must be a positive multiple of --group-size {self.group_size}")
        if self.ranks < 1:
            raise ValueError(f"--ranks {self.ranks} must be >= 1")
        if self.ranks > 1 and (self.baseline or self.lora.rank > 0 or self.offload == "optimizer"):
            raise ValueError(f"--ranks {self.ranks} times our own trainer group only: add --no-baseline, leave "
                             "--lora.rank at 0 and --offload at none or params (the group shards the optimizer)")
        if self.ranks > 1 and self.device.startswith("cuda"):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if self.ranks > count:
                raise ValueError(f"--ranks {self.ranks} needs a GPU per rank (cuda:0..cuda:{self.ranks - 1}); this "
                                 f"machine has {count}")
        if self.ranks > 1 and self.rows // self.group_size < self.ranks:
            raise ValueError(f"--rows {self.rows}: each of the --ranks {self.ranks} trains its own groups of "
                             f"--group-size {self.group_size}; give at least {self.ranks * self.group_size} rows")
        for flag, value in (("--steps", self.steps), ("--max-tokens-per-micro-batch", self.max_tokens_per_micro_batch)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps {self.warmup_steps} must be >= 0")
        if self.workload == "fixed":
            _check_lengths(("--prompt-len", self.prompt_len), ("--response-len", self.response_len))
        else:
            _check_range("--prompt-len", self.prompt_len_min, self.prompt_len_max)
            _check_range("--response-len", self.response_len_min, self.response_len_max)


def _check_lengths(*flags: tuple[str, int]) -> None:
    """Every (flag, length) at least one token."""
    for flag, value in flags:
        if value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")


def _check_range(flag: str, low: int, high: int) -> None:
    """`{flag}-min` and `{flag}-max`: both at least one token, min <= max."""
    _check_lengths((f"{flag}-min", low), (f"{flag}-max", high))
    if low > high:
        raise ValueError(f"{flag}-min {low} must be <= {flag}-max {high}")
