"""`asyncrl bench learner --lora.rank R`: our LoRA GRPO step against a Hugging Face model with peft's LoRA, on
the same rows, in one process (the learner benchmark's LoRA branch; `asyncrl_bench.learner` describes the rest).

Both sides: the base model frozen in bf16 on CUDA (fp32 on CPU), adapters of rank R with the same alpha,
dropout and target layers, in float32, bf16 autocast on CUDA, the learner benchmark's knobs (gradient
checkpointing with `--gradient-checkpointing`), AdamW over the adapters only. peft is timed first, on a
Hugging Face copy of the base (its own weights: one base in memory at a time), then ours on the base itself.

Useful FLOPs of a LoRA step (`lora_train_flops`): a frozen weight still costs its forward and the gradient of
its input, 4 FLOPs per multiply-add instead of 6, per token (decoder layers) and per response token (LM
head); each adapter parameter 6 per token; attention as in full training. The same count for both sides.
The row prints that roofline (`model_flops_per_step`, `peak_flops`, `roofline_step_s`) as the full learner
row does, and each side's first-step seconds and compile counts (`asyncrl_bench.timing`).
"""

from __future__ import annotations

import torch

from asyncrl.policies.lora import apply_lora, lora_targets
from asyncrl_bench.flops import body_params, row_lengths
from asyncrl_bench.learner_args import LearnerBenchArgs
from asyncrl_bench.roofline import flop_roofline, peak_flops
from asyncrl_bench.shared import hf_copy
from asyncrl_bench.timing import StepTimes
from asyncrl_bench.train_steps import time_hf_step, time_our_step, timed_fields

__all__ = ["lora_train_flops", "bench_learner_lora"]

LORA_LR = 1e-5
"""Both sides' learning rate (adapters train at ~10x full fine-tuning's; the value does not change a step's time)."""


def lora_train_flops(config, n_body: int, n_adapter: int, rows: list[tuple[int, int]]) -> float:
    """Useful FLOPs of one LoRA training step over `rows` = (prompt_len, response_len) (module docstring)."""
    tokens = sum(p + r for p, r in rows)
    response = sum(r for _, r in rows)
    squares = sum((p + r) ** 2 for p, r in rows)
    attention_width = config.num_heads * config.head_dim
    return float(4 * n_body * tokens + 6 * n_adapter * tokens + 4 * config.vocab_size * config.hidden_size * response
                 + 6 * config.num_layers * attention_width * squares)


def _base_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def _time_peft_train(args: LearnerBenchArgs, model, step_groups: list[list]) -> StepTimes:
    """`StepTimes` of a transformers + peft LoRA training step over the same groups (after the warm-up steps): the
    plain HF step of `asyncrl_bench.train_steps` on a peft model."""
    from peft import LoraConfig as PeftLora, get_peft_model
    lora = args.lora
    hf = hf_copy(model, _base_dtype(args.device), args.device)
    if args.gradient_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hf.enable_input_require_grads()  # the frozen embeddings' output must carry a gradient through checkpoints
    targets = list(lora_targets(model, lora.target_modules))  # "all-linear" as ours reads it: the same layers
    hf = get_peft_model(hf, PeftLora(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                     target_modules=targets))
    return time_hf_step(args, hf, step_groups, lr=LORA_LR)


def _time_lora_step(args: LearnerBenchArgs, model, step_groups: list[list]) -> StepTimes:
    """`StepTimes` of our GRPO `train_step` with adapters on `model` (after the warm-up steps)."""
    lora = args.lora
    apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.target_modules)
    return time_our_step(args, model, step_groups, lr=LORA_LR)


def bench_learner_lora(args: LearnerBenchArgs, model, step_groups: list[list], row: dict) -> dict:
    """Fill `row` (the learner benchmark's JSON row) with the LoRA comparison: each side's tok/s, MFU and peak
    memory, the ratio. `model`: the base, loaded in `_base_dtype` (ours trains adapters on it, in place)."""
    on_cuda = args.device.startswith("cuda")
    lora = args.lora
    n_body = body_params(model)
    targets = lora_targets(model, lora.target_modules)
    widths = {name.rpartition(".")[2]: (m.in_features, m.out_features) for name, m in model.model.layers[0].named_modules()
              if isinstance(m, torch.nn.Linear) and name.rpartition(".")[2] in targets}
    n_adapter = lora.rank * len(model.model.layers) * sum(i + o for i, o in widths.values())
    timed_rows = [row_lengths(groups) for groups in step_groups[args.warmup_steps:]]
    flops = sum(lora_train_flops(model.config, n_body, n_adapter, rows) for rows in timed_rows)
    peak = peak_flops(args.device)
    tokens = row["tokens_per_step"] * args.steps
    row.update(lora_rank=lora.rank, lora_alpha=lora.alpha, lora_targets=list(targets),
               adapter_params=n_adapter, base_dtype=str(_base_dtype(args.device)).removeprefix("torch."),
               **flop_roofline(flops / args.steps, args.device))
    if args.baseline:
        model.to("cpu")  # one base on the GPU at a time: each side's peak memory is its own
        if on_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        row.update(timed_fields("hf_", _time_peft_train(args, model, step_groups), tokens, flops, peak))
        if on_cuda:
            row["hf_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model.to(args.device)
    row.update(timed_fields("ours_", _time_lora_step(args, model, step_groups), tokens, flops, peak))
    if on_cuda:
        row["ours_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.baseline:
        row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
    return row
