"""Benchmark the embedded engine against Hugging Face `generate` in the same process.

    python scripts/bench_engine.py                              # GPU: Qwen2.5-0.5B shape, bf16, batch 64 and 256
    python scripts/bench_engine.py --model smollm2 --device cpu --dtype float32 --batch-sizes 8 \
        --prompt-len 64 --new-tokens 64                         # CPU: SmolLM2-135M

Both sides get the same random prompts, generate exactly `new_tokens` tokens per sequence (EOS ignored)
by sampling at temperature 1, and are timed after a warm-up run (CUDA graphs captured, kernels loaded).
Printed per batch size: our output tok/s, HF's, the ratio, our mean decode-step time, and the fraction of
the memory-bandwidth ceiling that step reaches (weights + KV read once per step). Also the logprob
mismatch between the engine and a training forward of the same tokens (mean |Δlogp| and
KL(engine‖train) estimated on the sampled tokens).
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch
import tyro

from asyncrl.policies import Engine, EngineConfig, SamplingParams, load_model, token_logprobs
from asyncrl.policies.model import CausalLM

PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}  # bytes/s, SXM parts


@dataclasses.dataclass
class Args:
    model: str = "random:qwen2.5-0.5b"
    """Model: an HF dir, a .gguf, 'smollm2', or 'random:<preset>'."""
    device: str = "cuda"
    dtype: str = "bfloat16"
    batch_sizes: tuple[int, ...] = (64, 256)
    prompt_len: int = 128
    new_tokens: int = 512
    baseline: bool = True
    """Also time transformers' generate."""
    cuda_graphs: bool = True
    seed: int = 0
    out: str | None = None
    """Write the results as JSON here."""


def peak_bandwidth() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def step_bytes(model: CausalLM, batch: int, attend_len: int) -> float:
    """Bytes a decode step must move at least: every weight once (the embedding only for B rows) + KV."""
    cfg = model.config
    elem = torch.finfo(model.dtype).bits // 8
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * elem
    if cfg.tie_word_embeddings:
        weights += cfg.vocab_size * cfg.hidden_size * elem
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    return weights + batch * attend_len * kv_per_token


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_ours(engine: Engine, prompts: list[list[int]], params: SamplingParams, device: str):
    engine.generate(prompts, params)  # warm-up: captures graphs
    engine.stats.clear()
    sync(device)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.completions)
    return outs, tokens / seconds, seconds / max(engine.stats["decode_steps"], 1)


def bench_hf(model_path: str, model: CausalLM, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    import tempfile

    import transformers

    from asyncrl.policies import save_pretrained
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=model.dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0,
                  top_p=1.0, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:, :8], max_new_tokens=8, do_sample=True, pad_token_id=0)  # warm-up
        sync(device)
        start = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        sync(device)
    seconds = time.perf_counter() - start
    del hf
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / seconds


@torch.inference_mode()
def mismatch(model: CausalLM, outs, max_rows: int = 32) -> dict[str, float]:
    """Engine behaviour logprobs vs a training forward of the same tokens."""
    diffs, kls = [], []
    for out in outs[:max_rows]:
        for c in out.completions:
            seq = torch.tensor([out.prompt_ids + c.token_ids], device=model.device)
            logits = model.logits(model(seq))[0, len(out.prompt_ids) - 1:-1]
            train = token_logprobs(logits, seq[0, len(out.prompt_ids):])
            engine = torch.tensor(c.logprobs, device=model.device)
            diffs.append((engine - train).abs().mean().item())
            kls.append((engine - train).mean().item())  # k1 estimate of KL(engine ‖ train) on engine samples
    return {"mean_abs_dlogp": sum(diffs) / len(diffs), "kl_engine_train": sum(kls) / len(kls)}


def main(args: Args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, dtype=dtype, device=args.device, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=args.seed)
    results, bandwidth = [], peak_bandwidth()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    for batch in args.batch_sizes:
        prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
        config = EngineConfig(max_slots=batch, max_len=args.prompt_len + args.new_tokens,
                              cuda_graphs=args.cuda_graphs)
        engine = Engine(model, config)
        outs, ours, step_s = bench_ours(engine, prompts, params, args.device)
        print("compiled pieces:", engine.fused, flush=True)
        row = {"device": device_name, "model": args.model, "dtype": args.dtype, "batch": batch,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "ours_tok_s": ours,
               "decode_step_ms": step_s * 1e3, **mismatch(model, outs)}
        if bandwidth:
            mean_attend = args.prompt_len + args.new_tokens / 2
            row["bandwidth_fraction"] = step_bytes(model, batch, int(mean_attend)) / bandwidth / step_s
        del engine, outs
        if args.baseline:
            row["hf_tok_s"] = bench_hf(args.model, model, prompts, args.new_tokens, args.device)
            row["ratio"] = ours / row["hf_tok_s"]
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
