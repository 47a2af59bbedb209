"""Where does a decode step's time go? Times, on one GPU, the pieces of `Engine._decode`:
the captured forward (eager ops vs torch.compile'd), the sampler, and the host-side bookkeeping.

    python scripts/profile_decode.py --batch 256 --attend 640
"""

from __future__ import annotations

import dataclasses
import time

import torch
import tyro

from asyncrl.policies import Engine, EngineConfig, SamplingParams, load_model
from asyncrl.policies.model import use_fused_kernels
from asyncrl.policies.sampling import sample_tokens, use_compiled_sampler


@dataclasses.dataclass
class Args:
    model: str = "random:qwen2.5-0.5b"
    batch: int = 256
    attend: int = 640
    compile: bool = False
    """Also time torch.compile of the whole decode forward."""
    fused: bool = True
    """Compile the elementwise pieces and the sampler (what the engine does on CUDA)."""
    iters: int = 50


def cuda_time(fn, iters: int) -> float:
    """Median milliseconds of fn() measured with CUDA events."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@torch.inference_mode()
def main(args: Args) -> None:
    model = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, EngineConfig(max_slots=args.batch, max_len=args.attend, cuda_graphs=False,
                                        fused_kernels=args.fused))
    print("fused pieces:", use_fused_kernels(args.fused, "cuda"), "sampler:", use_compiled_sampler(args.fused, "cuda"))
    cache = engine.cache
    cache.attend_len = args.attend
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, 1), device="cuda")
    positions = torch.randint(args.attend // 2, args.attend - 1, (args.batch, 1), device="cuda")

    def forward():
        return model.logits(model(tokens, positions, cache=cache, decode=True)[:, 0])

    eager_ms = cuda_time(forward, 10)
    graph, logits = capture(forward)
    graph_ms = cuda_time(graph.replay, args.iters)
    print(f"forward eager {eager_ms:.3f} ms   graph replay {graph_ms:.3f} ms")
    if args.compile:
        compiled = torch.compile(forward, dynamic=False, fullgraph=True)
        start = time.perf_counter()
        compiled()
        print(f"compile took {time.perf_counter() - start:.1f} s")
        cgraph, _ = capture(compiled)
        print(f"compiled graph replay {cuda_time(cgraph.replay, args.iters):.3f} ms")

    temperature = torch.ones(args.batch, device="cuda")
    uniforms = torch.rand(args.batch, device="cuda")
    print(f"sampler {cuda_time(lambda: sample_tokens(logits, temperature, uniforms), args.iters):.3f} ms")
    print(f"logits.float() copy alone {cuda_time(lambda: logits.float() * 1.0, args.iters):.3f} ms")

    # host bookkeeping of one real engine step at this batch size
    engine2 = Engine(model, EngineConfig(max_slots=args.batch, max_len=args.attend, attend_bucket=args.attend,
                                         fused_kernels=args.fused))
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, 64)).tolist()
    params = SamplingParams(max_new_tokens=args.attend - 64, ignore_eos=True)
    for p in prompts:
        engine2.add_request(p, params)
    for _ in range(20):
        engine2.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    n = 50
    for _ in range(n):
        engine2.step()
    torch.cuda.synchronize()
    print(f"engine step (graphs on) {1e3 * (time.perf_counter() - start) / n:.3f} ms")


if __name__ == "__main__":
    main(tyro.cli(Args))
