"""The two training steps the learner benchmarks time on the same rows, and each side's fields of the row.

- ours: GRPO `train_step` with the learner `LearnerBenchArgs.trainer_config` describes (full weights, or the
  LoRA adapters already applied to the model);
- Hugging Face's: the rows length-sorted and cut into micro-batches by our padded budget rule (rows × longest
  row <= budget, a longer row alone), right-padded with an attention mask, the response tokens labelled (-100
  on prompt and padding), `model(...).loss` + backward per micro-batch under bf16 autocast on CUDA, then
  gradient clipping and AdamW with our optimizer's settings (a transformers model, or a peft one).

    times = time_our_step(args, model, step_groups)
    row.update(timed_fields("ours_", times, tokens, flops, peak))
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from asyncrl.config import GRPO, OptimConfig, TrainerConfig
from asyncrl.learner import build_learner, shard_model, split_rows, train_step
from asyncrl_bench.learner_args import LearnerBenchArgs
from asyncrl_bench.roofline import mfu
from asyncrl_bench.timing import StepTimes, time_steps

__all__ = ["time_our_step", "time_hf_step", "hf_micro_batches", "timed_fields"]


def _one_rank_group(args: LearnerBenchArgs, model):
    """`--offload params`: the model sharded by FSDP2 over a group of one (the shards live on the host)."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
    shard_model(model, DeviceMesh.from_group(dist.group.WORLD, torch.device(args.device).type), offload=True)
    return dist.group.WORLD


def time_our_step(args: LearnerBenchArgs, model, step_groups: list[list], *, lr: float = OptimConfig.lr) -> StepTimes:
    """Seconds of our GRPO `train_step` over each step's groups (the first --warmup-steps untimed)."""
    group = _one_rank_group(args, model) if args.offload == "params" else None
    state = build_learner(model, args.trainer_config(lr), GRPO(), group=group)
    return time_steps(args.device, lambda groups: train_step(state, groups), step_groups, args.warmup_steps)


def _padded_batch(sequences: list[tuple[list[int], list[int]]], device: str) -> dict[str, torch.Tensor]:
    """HF inputs for (prompt_ids, response_ids) rows: right-padded `input_ids`, `attention_mask`, and `labels`
    = the response's token ids (-100 on prompt and padding: HF shifts them, so the loss is the response's)."""
    width = max(len(p) + len(r) for p, r in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (prompt, response) in enumerate(sequences):
        end = len(prompt) + len(response)
        ids[i, :end] = torch.tensor(prompt + response)
        mask[i, :end] = 1
        labels[i, len(prompt):end] = torch.tensor(response)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def hf_micro_batches(groups: list, budget: int, device: str) -> list[dict[str, torch.Tensor]]:
    """The rows of `groups` as padded HF micro-batches, cut by our padded budget rule (rows × longest row
    <= budget, longest first; a longer row alone)."""
    sequences = [(g.prompt_ids, c.token_ids) for g in groups for c in g.completions]
    lengths = [len(p) + len(r) for p, r in sequences]
    padded = TrainerConfig(max_tokens_per_micro_batch=budget, pack_sequences=False)
    return [_padded_batch([sequences[r] for r in rows], device)
            for rows in split_rows(list(range(len(lengths))), lengths, padded)]


def time_hf_step(args: LearnerBenchArgs, hf, step_groups: list[list], *, lr: float = OptimConfig.lr) -> StepTimes:
    """Seconds of a Hugging Face training step of `hf` (prepared: checkpointing, adapters) over the same groups
    (after the warm-up steps): its trainable parameters under AdamW with our optimizer's settings (fused on
    CUDA with --fused-optimizer), its gradients clipped as ours are."""
    optim = args.trainer_config(lr).optim
    on_cuda = args.device.startswith("cuda")
    params = [p for p in hf.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                              weight_decay=optim.weight_decay, fused=on_cuda and args.fused_optimizer)
    hf.train()

    def step(groups: list) -> None:
        for batch in hf_micro_batches(groups, args.max_tokens_per_micro_batch, args.device):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
                loss = hf(**batch).loss
            loss.backward()
        if optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, optim.grad_clip)
        adamw.step()
        adamw.zero_grad(set_to_none=True)

    return time_steps(args.device, step, step_groups, args.warmup_steps)


def timed_fields(prefix: str, times: StepTimes, tokens: float, flops: float, peak: float | None) -> dict:
    """One side's tok/s and MFU over its timed steps, its first-step and warm-up seconds, compile counts."""
    return {f"{prefix}tok_s": tokens / times.timed_s, f"{prefix}mfu": mfu(flops, times.timed_s, peak),
            **times.row(prefix)}
