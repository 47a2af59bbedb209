"""The learner benchmark: our GRPO step against a plain Hugging Face training step in the same process
(`asyncrl bench learner`; its LoRA branch, `--lora.rank`, is `asyncrl_bench.lora`).

    asyncrl bench learner                                 # GPU: Qwen2.5-0.5B shape, 16 × 320 tokens
    asyncrl bench learner --workload ragged --rows 64     # GPU: RL-like lengths (prompts 64-512, responses 32-2048)
    asyncrl bench learner --workload ragged --rows 64 --no-pack-sequences --checkpoint-scope mlp   # our variants

A GRPO `train_step` against a plain HF training step, on the same rows. Both sides: fp32 master
weights, bf16 autocast on CUDA, gradient checkpointing (ours: `--checkpoint-scope layer|mlp`; HF's: whole
layers), gradient clipping at 1.0, AdamW (fused on CUDA with `--fused-optimizer`), one optimizer step over
`rows` sequences. Workloads: `fixed`, every row `prompt_len + response_len` tokens; `ragged`, per group a
prompt length uniform in [`prompt_len_min`, `prompt_len_max`] and per response a length uniform in
[`response_len_min`, `response_len_max`], as RL batches are. Every step's rows are drawn (seeded per step)
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
`roofline_step_s`), with `train_flops`: 6·N_body per token (decoder layers
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
from typing import Literal

import torch

from asyncrl.config import LoraConfig
from asyncrl_bench.roofline import PEAK_BF16_FLOPS, flop_roofline, mfu as _mfu, peak_flops
from asyncrl_bench.shared import device_name, hf_copy, write_json
from asyncrl_bench.timing import StepTimes, time_steps

__all__ = ["LearnerBenchArgs", "bench_learner", "groups_for", "row_lengths", "body_params", "train_flops",
           "peak_flops", "PEAK_BF16_FLOPS"]

LearnerWorkload = Literal["fixed", "ragged"]


@dataclasses.dataclass
class LearnerBenchArgs:
    """Learner train_step vs a plain `transformers` training step: trained tokens/s and MFU."""

    model: str = "random:qwen2.5-0.5b"
    """Model: an HF dir, a .gguf, 'smollm2', or 'random:<preset>'."""
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
    group_size: int = 8
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one forward/backward, ours and HF's (padded: rows × longest row)."""
    pack_sequences: bool = True
    """Ours: a micro-batch's rows packed into one sequence (no padding compute); off: right-padded rows."""
    gradient_checkpointing: bool = True
    """Both sides (HF's recomputes whole layers)."""
    checkpoint_scope: Literal["layer", "mlp"] = "mlp"
    """Ours, with gradient checkpointing: recompute only each decoder layer's MLP, or the whole layer."""
    compile_layers: bool = True
    """Ours: torch.compile each decoder layer (CUDA only)."""
    compile_scope: Literal["layer", "model"] = "layer"
    """Ours: --trainer.compile-scope (each decoder layer, or the model's whole forward, as one compiled region)."""
    cuda_graphs: bool = False
    """Ours: --trainer.cuda-graphs (the compiled layers replayed as CUDA graphs over bucketed packed lengths)."""
    fused_optimizer: bool = True
    """Fused AdamW on CUDA, ours and HF's."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """Ours: --trainer.offload (optimizer: AdamW state in host memory, stepped on the GPU; params: FSDP2's CPU
    offload on a one-rank group)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Ours: --trainer.param-dtype (bfloat16 with --offload optimizer keeps an fp32 master copy on the host)."""
    steps: int = 5
    """Timed optimizer steps (after --warmup-steps)."""
    warmup_steps: int = 2
    """Untimed optimizer steps first, on their own rows (the first compiles; the next ones let the caching
    allocator settle), so the timed steps are steady state. The first step's seconds are reported apart."""
    baseline: bool = True
    """Also time a transformers training step (with --lora.rank: transformers + peft's LoRA)."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """--lora.rank R > 0: both sides train rank-R adapters on a frozen base (bf16 on CUDA): `asyncrl_bench.lora`."""
    out: str | None = None
    """Write the result as JSON here."""

    def validate(self) -> None:
        """Refuse impossible shapes (ValueError naming the CLI flag) before anything is loaded."""
        self.lora.validate()
        if self.offload != "none" and (self.baseline or self.lora.rank > 0):
            raise ValueError(f"--offload {self.offload} times our own step only (compare it with a run of "
                             "--offload none): add --no-baseline, and leave --lora.rank at 0")
        if self.group_size < 1 or self.rows < self.group_size or self.rows % self.group_size:
            raise ValueError(f"--rows {self.rows} must be a positive multiple of --group-size {self.group_size}")
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


def _draw_length(args: LearnerBenchArgs, gen: torch.Generator, fixed: int, low: int, high: int) -> int:
    """`fixed` for the fixed workload (nothing drawn); uniform in [low, high] for the ragged one."""
    if args.workload == "fixed":
        return fixed
    return int(torch.randint(low, high + 1, (), generator=gen))


def _random_completion(gen: torch.Generator, vocab: int, length: int):
    """A finished ("length") completion of `length` random tokens with random behaviour log-probs."""
    from asyncrl.types import Completion
    return Completion(torch.randint(0, vocab, (length,), generator=gen).tolist(),
                      (-torch.rand(length, generator=gen) * 4).tolist(), [0] * length, "length")


def groups_for(args: LearnerBenchArgs, vocab: int, seed: int) -> list:
    """`rows // group_size` groups of random prompts, responses and rewards, the same for the same seed.
    Lengths: fixed, `prompt_len` / `response_len`; ragged, per group a prompt length uniform in
    [prompt_len_min, prompt_len_max] and per response one in [response_len_min, response_len_max]."""
    from asyncrl.types import Group
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


def row_lengths(groups: list) -> list[tuple[int, int]]:
    """(prompt_len, response_len) of every row (completion) of `groups`."""
    return [(len(g.prompt_ids), len(c.token_ids)) for g in groups for c in g.completions]


def body_params(model) -> int:
    """Parameters of the decoder layers and the final norm: no embedding, no LM head."""
    body = (model.model.layers, model.model.norm)
    return sum(p.numel() for module in body for p in module.parameters())


def train_flops(config, n_body: int, rows: list[tuple[int, int]]) -> float:
    """Useful model FLOPs of one training step (forward + backward, 2 + 4 FLOPs per multiply-add) over `rows`
    = (prompt_len, response_len), for a `TransformerConfig`-like `config`:
      6 · n_body per token (the decoder layers' matmuls),
      6 · vocab · hidden per response token (the LM head: only response log-probs are trained),
      6 · layers · (heads · head_dim) · s² per row of s = prompt + response tokens (causal attention: QKᵀ and
      AV, 2 · 2 · s² · width forward over the half of the s × s scores a causal mask keeps, twice that back).
    Padding and recomputation (gradient checkpointing) are not useful work and are not counted."""
    tokens = sum(p + r for p, r in rows)
    response = sum(r for _, r in rows)
    squares = sum((p + r) ** 2 for p, r in rows)
    attention_width = config.num_heads * config.head_dim
    return float(6 * n_body * tokens + 6 * config.vocab_size * config.hidden_size * response
                 + 6 * config.num_layers * attention_width * squares)


def _time_train_step(args: LearnerBenchArgs, model, step_groups: list[list], *, lr: float = 1e-6) -> StepTimes:
    """Seconds of our GRPO `train_step` over each step's groups (the first --warmup-steps untimed)."""
    from asyncrl.config import GRPO, OptimConfig, TrainerConfig
    from asyncrl.learner import build_learner, train_step
    cfg = TrainerConfig(mini_batch_size=max(args.rows // args.group_size, 1),
                        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                        pack_sequences=args.pack_sequences, gradient_checkpointing=args.gradient_checkpointing,
                        checkpoint_scope=args.checkpoint_scope, compile_layers=args.compile_layers,
                        compile_scope=args.compile_scope, cuda_graphs=args.cuda_graphs,
                        fused_optimizer=args.fused_optimizer, offload=args.offload, param_dtype=args.param_dtype,
                        optim=OptimConfig(lr=lr))
    group = None
    if args.offload == "params":  # FSDP2 on a group of one: the shards live on the host
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from asyncrl.learner import shard_model
        if not dist.is_initialized():
            dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        group = dist.group.WORLD
        shard_model(model, DeviceMesh.from_group(group, torch.device(args.device).type), offload=True)
    state = build_learner(model, cfg, GRPO(), group=group)
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


def _hf_micro_batches(groups: list, budget: int, device: str) -> list[dict[str, torch.Tensor]]:
    """The rows of `groups` as padded HF micro-batches, cut by our padded budget rule (rows × longest row
    <= budget, longest first; a longer row alone)."""
    from asyncrl.config import TrainerConfig
    from asyncrl.learner import split_rows
    sequences = [(g.prompt_ids, c.token_ids) for g in groups for c in g.completions]
    lengths = [len(p) + len(r) for p, r in sequences]
    padded = TrainerConfig(max_tokens_per_micro_batch=budget, pack_sequences=False)
    return [_padded_batch([sequences[r] for r in rows], device) for rows in split_rows(list(range(len(lengths))),
                                                                                       lengths, padded)]


def _time_hf_train(args: LearnerBenchArgs, model, step_groups: list[list]) -> StepTimes:
    """Seconds of a plain transformers training step over the same groups (after the warm-up steps): padded
    micro-batches, `model(...).loss` under bf16 autocast on CUDA, backward per micro-batch, gradient clipping
    at 1.0, AdamW (fused on CUDA with --fused-optimizer, as ours)."""
    hf = hf_copy(model, torch.float32, args.device)
    if args.gradient_checkpointing:
        hf.gradient_checkpointing_enable()
    hf.train()
    on_cuda = args.device.startswith("cuda")
    optim = torch.optim.AdamW(hf.parameters(), lr=1e-6, fused=on_cuda and args.fused_optimizer)

    def step(groups: list) -> None:
        for batch in _hf_micro_batches(groups, args.max_tokens_per_micro_batch, args.device):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
                loss = hf(**batch).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)

    return time_steps(args.device, step, step_groups, args.warmup_steps)


def _learner_row(args: LearnerBenchArgs, timed_rows: list[list[tuple[int, int]]]) -> dict:
    """The JSON row's description of the run: device, model, workload and knobs, mean tokens per step."""
    tokens = sum(p + r for rows in timed_rows for p, r in rows)
    response = sum(r for rows in timed_rows for _, r in rows)
    return {"device": device_name(args.device), "model": args.model, "workload": args.workload,
            "rows": args.rows, "tokens_per_row": tokens / (args.rows * args.steps),
            "tokens_per_step": tokens / args.steps, "response_tokens_per_step": response / args.steps,
            "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch, "pack_sequences": args.pack_sequences,
            "gradient_checkpointing": args.gradient_checkpointing, "checkpoint_scope": args.checkpoint_scope,
            "compile_layers": args.compile_layers, "compile_scope": args.compile_scope,
            "cuda_graphs": args.cuda_graphs,
            "fused_optimizer": args.fused_optimizer,
            "offload": args.offload, "param_dtype": args.param_dtype, "warmup_steps": args.warmup_steps,
            "steps": args.steps}


def _host_copy(model, device: str):
    """A copy of `model`'s weights in host memory (the baseline's; the GPU holds one model at a time)."""
    model.to("cpu")
    copied = copy.deepcopy(model)
    model.to(device)
    return copied


def _timed_fields(prefix: str, times: StepTimes, tokens: float, flops: float, peak: float | None) -> dict:
    """One side's tok/s and MFU over its timed steps, its first-step and warm-up seconds, compile counts."""
    return {f"{prefix}tok_s": tokens / times.timed_s, f"{prefix}mfu": _mfu(flops, times.timed_s, peak),
            **times.row(prefix)}


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
    row = _timed_fields("hf_", times, tokens, flops, peak)
    if on_cuda:
        row["hf_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def bench_learner(args: LearnerBenchArgs) -> dict:
    """Run the learner benchmark; print one JSON row and return it. Both sides train on the same rows (drawn
    before the clock starts); tok/s counts their real tokens, MFU their `train_flops` over the device's peak."""
    from asyncrl.policies import load_model
    args.validate()
    on_cuda = args.device.startswith("cuda")
    lora = args.lora.rank > 0
    dtype = torch.bfloat16 if (lora and on_cuda) or args.param_dtype == "bfloat16" else torch.float32
    model = load_model(args.model, dtype=dtype, device="cpu" if args.offload == "params" else args.device)
    step_groups = [groups_for(args, model.config.vocab_size, seed) for seed in range(args.warmup_steps + args.steps)]
    timed_rows = [row_lengths(groups) for groups in step_groups[args.warmup_steps:]]
    if lora:
        from asyncrl_bench.lora import bench_learner_lora
        row = bench_learner_lora(args, model, step_groups, _learner_row(args, timed_rows))
        print(json.dumps(row), flush=True)
        write_json(args.out, row)
        return row
    n_body = body_params(model)
    flops = sum(train_flops(model.config, n_body, rows) for rows in timed_rows)
    peak = peak_flops(args.device)
    row = {**_learner_row(args, timed_rows), **flop_roofline(flops / args.steps, args.device)}
    tokens = row["tokens_per_step"] * args.steps
    reference = _host_copy(model, args.device) if args.baseline and args.offload != "params" else None
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    row.update(_timed_fields("ours_", _time_train_step(args, model, step_groups), tokens, flops, peak))
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
