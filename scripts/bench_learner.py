"""Benchmark a learner step against a plain Hugging Face training step, in the same process.

    python scripts/bench_learner.py                      # GPU: Qwen2.5-0.5B shape, 16 × 320 tokens

Both sides: fp32 master weights, bf16 autocast, gradient checkpointing, AdamW, one optimizer step over
`rows` sequences of `prompt_len + response_len` tokens. Ours is the full GRPO `train_step` (collate,
group advantages, PPO clip loss over response tokens, token-budget micro-batches); HF's is
`model(input_ids, labels=...)` + backward + step. Prints trained tokens/s of both and the ratio, plus
peak memory.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time

import torch
import tyro

from asyncrl.config import GRPO, OptimConfig, TrainerConfig
from asyncrl.learner import build_learner, train_step
from asyncrl.policies import load_model, save_pretrained
from asyncrl.types import Completion, Group


@dataclasses.dataclass
class Args:
    model: str = "random:qwen2.5-0.5b"
    device: str = "cuda"
    rows: int = 16
    prompt_len: int = 64
    response_len: int = 256
    group_size: int = 8
    max_tokens_per_micro_batch: int = 8192
    gradient_checkpointing: bool = True
    steps: int = 5
    baseline: bool = True
    out: str | None = None


def groups_for(args: Args, vocab: int, seed: int) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(args.rows // args.group_size):
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        comps = [Completion(torch.randint(0, vocab, (args.response_len,), generator=gen).tolist(),
                            (-torch.rand(args.response_len, generator=gen) * 4).tolist(), [0] * args.response_len,
                            "length") for _ in range(args.group_size)]
        out.append(Group(g, prompt, comps, torch.rand(args.group_size, generator=gen).tolist()))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_ours(args: Args, model) -> float:
    cfg = TrainerConfig(mini_batch_size=args.rows // args.group_size, max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                        gradient_checkpointing=args.gradient_checkpointing, optim=OptimConfig(lr=1e-6))
    state = build_learner(model, cfg, GRPO())
    tokens = args.rows * (args.prompt_len + args.response_len)
    train_step(state, groups_for(args, model.config.vocab_size, 0))  # warm-up
    sync(args.device)
    start = time.perf_counter()
    for step in range(args.steps):
        train_step(state, groups_for(args, model.config.vocab_size, step + 1))
    sync(args.device)
    return tokens * args.steps / (time.perf_counter() - start)


def bench_hf(args: Args, model) -> float:
    import tempfile

    import transformers
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(args.device)
    if args.gradient_checkpointing:
        hf.gradient_checkpointing_enable()
    hf.train()
    optim = torch.optim.AdamW(hf.parameters(), lr=1e-6)
    seq = args.prompt_len + args.response_len
    micro = max(args.max_tokens_per_micro_batch // seq, 1)

    def step(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (args.rows, seq), generator=gen).to(args.device)
        for i in range(0, args.rows, micro):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda")):
                loss = hf(ids[i:i + micro], labels=ids[i:i + micro]).loss
            loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)

    step(0)
    sync(args.device)
    start = time.perf_counter()
    for s in range(args.steps):
        step(s + 1)
    sync(args.device)
    return args.rows * seq * args.steps / (time.perf_counter() - start)


def main(args: Args) -> dict:
    model = load_model(args.model, dtype=torch.float32, device=args.device)
    reference = copy.deepcopy(model) if args.baseline else None
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    ours = bench_ours(args, model)
    row = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "model": args.model, "rows": args.rows, "tokens_per_row": args.prompt_len + args.response_len,
           "ours_tok_s": ours}
    if args.device.startswith("cuda"):
        row["ours_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if args.baseline:
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        row["hf_tok_s"] = bench_hf(args, reference)
        row["ratio"] = ours / row["hf_tok_s"]
        if args.device.startswith("cuda"):
            row["hf_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=2)
    return row


if __name__ == "__main__":
    main(tyro.cli(Args))
