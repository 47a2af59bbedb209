"""Multi-turn episodes on the embedded engine: later turns continued from held K/V (sessions) vs prefilled
whole, in the same process on the same model and episodes.

    python -m scripts.bench_sessions                                   # GPU: Qwen2.5-0.5B shape, bf16
    python -m scripts.bench_sessions --model tiny-qwen2 --device cpu --dtype float32 --episodes 8

Every episode takes `--turns` turns of `--turn-tokens` sampled tokens, with `--env-tokens` environment tokens
appended after each; the episodes turn in waves (all of a wave's turns are queued together, as an agent's
episodes come back from their environment steps). Prints the wall time and the prefilled tokens of each mode
and their ratio. The first wave of each mode is a warm-up (CUDA graphs, allocator) and is not counted.
"""

from __future__ import annotations

import dataclasses
import random
import time

import torch

from asyncrl.policies import Engine, EngineConfig, SamplingParams, random_model


@dataclasses.dataclass
class Args:
    model: str = "qwen2.5-0.5b"
    device: str = "cuda"
    dtype: str = "bfloat16"
    episodes: int = 64
    prompt_len: int = 256
    turns: int = 4
    turn_tokens: int = 64
    env_tokens: int = 32
    repeats: int = 2


def run_episodes(engine: Engine, args: Args, sessions: bool, seed: int) -> tuple[float, int]:
    """(seconds, prefilled tokens) of one set of episodes."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    seqs = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.episodes)]
    before = engine.stats["prefill_tokens"]
    sync = torch.cuda.synchronize if engine.model.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for turn in range(args.turns):
        for i, seq in enumerate(seqs):
            params = SamplingParams(n=1, max_new_tokens=args.turn_tokens, ignore_eos=True, seed=seed + 1000 * i + turn)
            engine.add_request(seq, params, request_id=f"e{i}.t{turn}", sessions=[f"s{seed}.e{i}"] if sessions else None)
        done = {}
        while len(done) < len(seqs):
            for out in engine.step():
                done[out.request_id] = out
        for i in range(len(seqs)):
            seqs[i] = seqs[i] + done[f"e{i}.t{turn}"].completions[0].token_ids + [
                rng.randrange(3, vocab) for _ in range(args.env_tokens)]
    sync()
    seconds = time.perf_counter() - start
    if sessions:
        engine.end_sessions([f"s{seed}.e{i}" for i in range(args.episodes)])
    return seconds, engine.stats["prefill_tokens"] - before


def main(args: Args) -> dict:
    model = random_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    longest = args.prompt_len + args.turns * (args.turn_tokens + args.env_tokens)
    engine = Engine(model, EngineConfig(max_slots=args.episodes, max_len=longest + 8))
    for sessions in (False, True):  # warm-up
        run_episodes(engine, dataclasses.replace(args, turns=2), sessions, seed=99)
    results = {}
    for sessions in (False, True):
        times, prefilled = [], 0
        for r in range(args.repeats):
            seconds, prefilled = run_episodes(engine, args, sessions, seed=r)
            times.append(seconds)
        results["sessions" if sessions else "whole"] = (min(times), max(times), prefilled)
    w, s = results["whole"], results["sessions"]
    generated = args.episodes * args.turns * args.turn_tokens
    print(f"{args.model} {args.dtype} on {args.device}: {args.episodes} episodes x {args.turns} turns of "
          f"{args.turn_tokens} tokens, prompt {args.prompt_len}, {args.env_tokens} environment tokens per turn")
    print("| mode | seconds (min-max of %d) | generated tok/s | prefilled tokens |" % args.repeats)
    print("|---|---|---|---|")
    for name, (lo, hi, pre) in (("prefilled whole", w), ("sessions (held K/V)", s)):
        print(f"| {name} | {lo:.2f}-{hi:.2f} | {generated / lo:,.0f} | {pre:,} |")
    print(f"sessions / whole: {w[0] / s[0]:.2f}x the speed, {s[2] / w[2]:.2f}x the prefilled tokens")
    return results


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Args))
