"""The learner benchmark: our GRPO step against a plain Hugging Face training step in the same process
(`asyncrl bench learner`; its LoRA branch, `--lora.rank`, is `asyncrl_bench.lora`).

    asyncrl bench learner                                 # GPU: Qwen2.5-0.5B shape, 16 × 320 tokens
    asyncrl bench learner --workload ragged --rows 64     # GPU: RL-like lengths (prompts 64-512, responses 32-2048)
    asyncrl bench learner --workload ragged --rows 64 --no-pack-sequences --gradient-checkpointing   # variants

A GRPO `train_step` against a plain HF training step, on the same rows. Both sides run the learner's
defaults unless a flag says otherwise (each learner knob is a `TrainerConfig` field of the same name and
default: `asyncrl_bench.learner_args`): fp32 master weights, bf16 autocast on CUDA, the learner's token
budget per micro-batch, no recompute (`--gradient-checkpointing`: ours recomputes `--checkpoint-scope mlp`
or whole layers, HF's whole layers), gradient clipping and AdamW with the learner's settings (fused on CUDA),
one optimizer step over `rows` sequences (`asyncrl_bench.train_steps` times both). Workloads: `fixed`, every
row `prompt_len + response_len` tokens; `ragged`, per group a prompt length uniform in [`prompt_len_min`,
`prompt_len_max`] and per response a length uniform in [`response_len_min`, `response_len_max`], as RL
batches are. Every step's rows are drawn (seeded per step)
before the clock starts. Ours is the full `train_step` (collate, group advantages, PPO clip loss over response
tokens, token-budget micro-batches packed into one sequence each, or padded with `--no-pack-sequences`;
`--compile-layers`); HF's sorts the rows by length, cuts them into micro-batches by our padded budget rule
(rows × longest row <= `max_tokens_per_micro_batch`, a longer row alone), right-pads them with an attention
mask, labels the response tokens (-100 on prompt and padding) and runs `model(...).loss` + backward per
micro-batch, then the step. Throughput counts real tokens only (prompt + response of every row, no padding),
the same count for both sides. `--warmup-steps` untimed steps come first (the first one compiles; its seconds
are reported as `*_first_step_s`), then `--steps` timed ones; the row counts the frames torch.compile compiled
in each phase (`*_compiles_warmup`, `*_compiles_timed`: a steady state compiles nothing). MFU = model FLOPs /
time / the GPU's peak dense bf16 FLOP/s (H100, H200: 989 TFLOP/s; A100: 312; null on CPU or an unknown GPU,
`roofline_note` says so); the row prints that roofline (`model_flops_per_step`, `peak_flops`,
`roofline_step_s`), with `train_flops` (`asyncrl_bench.flops`): 6·N_body per token (decoder layers
and final norm) + 6·V·H per response token (LM head) + 6·L·(heads·head_dim)·s² per row of s tokens (causal
attention). Both sides are credited the same useful FLOPs (padding and recomputation do not count), so
ours_mfu / hf_mfu = ours_tok_s / hf_tok_s = ratio. Prints one JSON row: workload, mean tokens and response
tokens per step, each side's tok/s, MFU and peak memory (CUDA), the ratio.

`scripts/bench_learner.py` is a thin wrapper over this module.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import resource

import torch

from asyncrl.policies import load_model
from asyncrl.types import Completion, Group
from asyncrl_bench.flops import body_params, flops_config, row_lengths, train_flops
from asyncrl_bench.learner_args import LearnerBenchArgs
from asyncrl_bench.learner_group import bench_learner_group
from asyncrl_bench.lora import bench_learner_lora
from asyncrl_bench.roofline import flop_roofline, peak_flops
from asyncrl_bench.shared import device_name, hf_copy, write_json
from asyncrl_bench.train_steps import time_hf_step, time_our_step, timed_fields

__all__ = ["LearnerBenchArgs", "bench_learner", "groups_for"]


def _draw_length(args: LearnerBenchArgs, gen: torch.Generator, fixed: int, low: int, high: int) -> int:
    """`fixed` for the fixed workload (nothing drawn); uniform in [low, high] for the ragged one."""
    if args.workload == "fixed":
        return fixed
    return int(torch.randint(low, high + 1, (), generator=gen))


def _random_completion(gen: torch.Generator, vocab: int, length: int) -> Completion:
    """A finished ("length") completion of `length` random tokens with random behaviour log-probs."""
    return Completion(torch.randint(0, vocab, (length,), generator=gen).tolist(),
                      (-torch.rand(length, generator=gen) * 4).tolist(), [0] * length, "length")


def groups_for(args: LearnerBenchArgs, vocab: int, seed: int) -> list[Group]:
    """`rows // group_size` groups of random prompts, responses and rewards, the same for the same seed.
    Lengths: fixed, `prompt_len` / `response_len`; ragged, per group a prompt length uniform in
    [prompt_len_min, prompt_len_max] and per response one in [response_len_min, response_len_max]."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(args.rows // args.group_size):
        prompt_len = _draw_length(args, gen, args.prompt_len, args.prompt_len_min, args.prompt_len_max)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        comps = [_random_completion(gen, vocab, _draw_length(args, gen, args.response_len, args.response_len_min,
                                                             args.response_len_max))
                 for _ in range(args.group_size)]
        out.append(Group(g, prompt, comps, torch.rand(args.group_size, generator=gen).tolist()))
    return out


def _time_hf_train(args: LearnerBenchArgs, model, step_groups: list[list]):
    """`StepTimes` of a plain transformers training step (fp32 weights; whole-layer checkpointing with
    --gradient-checkpointing) over the same groups (`train_steps.time_hf_step`)."""
    hf = hf_copy(model, torch.float32, args.device)
    if args.gradient_checkpointing:
        hf.gradient_checkpointing_enable()
    return time_hf_step(args, hf, step_groups)


def _learner_row(args: LearnerBenchArgs, timed_rows: list[list[tuple[int, int]]]) -> dict:
    """The JSON row's description of the run: device, model, workload and knobs, mean tokens per step."""
    tokens = sum(p + r for rows in timed_rows for p, r in rows)
    response = sum(r for rows in timed_rows for _, r in rows)
    return {"device": device_name(args.device), "model": args.model, "impl": args.impl, "workload": args.workload,
            "rows": args.rows, "tokens_per_row": tokens / (args.rows * args.steps),
            "tokens_per_step": tokens / args.steps, "response_tokens_per_step": response / args.steps,
            **args.trainer_knobs(), "warmup_steps": args.warmup_steps, "steps": args.steps}


def _host_copy(model, device: str):
    """A copy of `model`'s weights in host memory (the baseline's; the GPU holds one model at a time)."""
    model.to("cpu")
    copied = copy.deepcopy(model)
    model.to(device)
    return copied


def _hf_fields(args: LearnerBenchArgs, reference, step_groups: list[list], tokens: float, flops: float,
               peak: float | None) -> dict:
    """The baseline's fields (`hf_error` instead when it runs out of GPU memory)."""
    on_cuda = args.device.startswith("cuda")
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        times = _time_hf_train(args, reference, step_groups)
    except torch.OutOfMemoryError as err:
        return {"hf_error": f"out of GPU memory: {str(err).splitlines()[0]}"}
    row = timed_fields("hf_", times, tokens, flops, peak)
    if on_cuda:
        row["hf_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def bench_learner(args: LearnerBenchArgs) -> dict:
    """Run the learner benchmark; print one JSON row and return it. Both sides train on the same rows (drawn
    before the clock starts); tok/s counts their real tokens, MFU their `train_flops` over the device's peak."""
    args.validate()
    on_cuda = args.device.startswith("cuda")
    lora = args.lora.rank > 0
    dtype = torch.bfloat16 if (lora and on_cuda) or args.param_dtype == "bfloat16" else torch.float32
    group = args.ranks > 1  # the ranks load their own copies; this one gives the vocabulary and the FLOPs
    model = load_model(args.model, dtype=dtype, device="cpu" if args.offload == "params" or group else args.device,
                       impl=args.impl)
    step_groups = [groups_for(args, model.config.vocab_size, seed) for seed in range(args.warmup_steps + args.steps)]
    timed_rows = [row_lengths(groups) for groups in step_groups[args.warmup_steps:]]
    if lora:
        row = bench_learner_lora(args, model, step_groups, _learner_row(args, timed_rows))
        print(json.dumps(row), flush=True)
        write_json(args.out, row)
        return row
    n_body = body_params(model)
    flops = sum(train_flops(flops_config(model), n_body, rows) for rows in timed_rows)
    peak = peak_flops(args.device)
    row = {**_learner_row(args, timed_rows), **flop_roofline(flops / args.steps, args.device)}
    if getattr(model, "impl", "own") == "hf":  # what the load-time probes left on, and why
        row["hf_features"] = dataclasses.asdict(model.features)
    if group:
        del model
        row = bench_learner_group(args, step_groups, row, flops)
        print(json.dumps(row), flush=True)
        write_json(args.out, row)
        return row
    tokens = row["tokens_per_step"] * args.steps
    reference = _host_copy(model, args.device) if args.baseline and args.offload != "params" else None
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    row.update(timed_fields("ours_", time_our_step(args, model, step_groups), tokens, flops, peak))
    if on_cuda:
        row["ours_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["host_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    if args.baseline:
        del model
        row.update(_hf_fields(args, reference, step_groups, tokens, flops, peak))
        if "hf_tok_s" in row:
            row["ratio"] = row["ours_tok_s"] / row["hf_tok_s"]
    print(json.dumps(row), flush=True)
    write_json(args.out, row)
    return row
