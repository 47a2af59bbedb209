"""How many prompts an agent should keep in flight (`asyncrl bench admission`): the rows a decode step gets, and its
output tok/s, when a GRPO group is delivered only once its longest sample ends.

An agent keeps G prompts in flight and asks for a new one when a whole group has been delivered. With G = slots // n
(the default) a group's finished samples leave their slots empty until its longest sample ends, so only about
E[length] / E[longest of a group] of the slots generate; with more prompts in flight
(`RolloutConfig.max_concurrent_prompts`), waiting groups take the freed slots. This bench drives our
engine as an agent does: groups of n samples, each sample with its own heavy-tailed budget (log-normal, 99th
percentile --new-tokens, median --new-tokens / --tail-ratio; random weights never stop early, so the budgets are the
lengths), the same budgets for every setting, and a new group admitted when one has finished. For each
--in-flight multiple m, G = m × (slots // n): over the steady part (while groups still wait for admission, as in a
run) the mean rows generating a step and their tok/s, with the ratio to m = 1's, the default, from the same call; and the whole's tok/s and decode steps (its end drains the last groups' tails).

    asyncrl bench admission --model random:qwen2.5-0.5b --slots 256 --n 8 --in-flight 1 2 3
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time

import torch

from asyncrl.config import ModelConfig, RolloutConfig, RunConfig
from asyncrl.policies import Engine, EngineConfig, SamplingParams, load_model
from asyncrl_bench.shared import bench_dtype, device_name, synchronize, write_json
from asyncrl_bench.tails import lognormal_budgets

__all__ = ["AdmissionBenchArgs", "Group", "drive", "bench_admission"]


@dataclasses.dataclass
class AdmissionBenchArgs:
    """Prompts in flight against the rows a decode step gets, on heavy-tailed sample lengths (module docstring)."""

    model: str = "random:qwen2.5-0.5b"
    """Model: 'random:<preset>' (budgets set the lengths), an HF dir, a .gguf or 'smollm2'."""
    device: str = "cuda"
    dtype: str = ModelConfig.engine_dtype
    """Weights and activations (--model.engine-dtype): auto = bfloat16 on CUDA, float32 on CPU."""
    slots: int = RolloutConfig.max_slots
    """The engine's slots (--rollout.max-slots)."""
    n: int = RolloutConfig.n
    """Samples a group (--rollout.n)."""
    in_flight: tuple[float, ...] = (1.0, 2.0)
    """Prompts in flight, as multiples of slots // n (1: the default)."""
    groups: int = 128
    """Groups generated in each setting, twice: the second pass is timed (the first meets every shape it steps
    through, so no CUDA graph is captured while timing)."""
    prompt_len: int = 128
    """Random prompt tokens (a group's samples share their prompt)."""
    new_tokens: int = 1024
    """The budgets' 99th percentile and maximum."""
    tail_ratio: float = 10.0
    """The budgets' 99th percentile over their median."""
    cuda_graphs: bool = RolloutConfig.cuda_graphs
    """Capture the decode step in CUDA graphs (--rollout.cuda-graphs)."""
    seed: int = RunConfig.seed
    out: str | None = None
    """Write the results as JSON here."""

    def validate(self) -> None:
        if self.slots < self.n or self.n < 1:
            raise ValueError(f"--slots {self.slots} must hold at least one group of --n {self.n} (>= 1)")
        if not self.in_flight or min(self.in_flight) <= 0:
            raise ValueError("--in-flight: give positive multiples of slots // n, e.g. 1 2")
        if self.groups < 1 or self.prompt_len < 1 or self.new_tokens < 1:
            raise ValueError("--groups, --prompt-len and --new-tokens must be >= 1")
        if not self.tail_ratio >= 1.0:
            raise ValueError(f"--tail-ratio {self.tail_ratio}: the 99th percentile over the median must be >= 1")
        bench_dtype(self.dtype, self.device)


@dataclasses.dataclass(frozen=True)
class Group:
    prompt: list[int]
    budgets: tuple[int, ...]  # one a sample


def drive(engine, groups: list[Group], in_flight: int, device: str) -> dict:
    """Generate `groups` keeping `in_flight` of them admitted, a new one admitted once a whole group has finished (as
    an agent does): seconds, tokens and decode steps of the whole, and the mean rows generating a step and their tokens
    a second over the steady part, the steps while groups still waited for admission (a run's agent never drains; the
    last groups' tails are the batch's, `asyncrl bench engine --lengths lognormal`)."""
    pending, left, owner = collections.deque(enumerate(groups)), {}, {}
    steps = tokens = steady_steps = steady_rows = 0
    steady_s = 0.0
    synchronize(device)
    start = time.perf_counter()
    while pending or left:
        while pending and len(left) < in_flight:
            index, group = pending.popleft()
            left[index] = len(group.budgets)
            for k, budget in enumerate(group.budgets):
                params = SamplingParams(n=1, temperature=1.0, max_new_tokens=budget, ignore_eos=True)
                owner[engine.add_request(group.prompt, params, request_id=f"g{index}s{k}")] = index
        steady, step_start = bool(pending), time.perf_counter()
        for out in engine.step():
            index = owner.pop(out.request_id)
            tokens += sum(len(c.token_ids) for c in out.completions)
            left[index] -= 1
            if not left[index]:
                del left[index]
        steps += 1
        if steady:
            steady_steps, steady_rows = steady_steps + 1, steady_rows + engine.num_running
            steady_s += time.perf_counter() - step_start
    synchronize(device)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "decode_steps": steps,
            "steady_steps": steady_steps, "running_rows": steady_rows / max(steady_steps, 1),
            "steady_tok_s": steady_rows / steady_s if steady_s else None}


def _groups(args: AdmissionBenchArgs, vocab: int, count: int, seed: int) -> list[Group]:
    budgets = lognormal_budgets(count * args.n, maximum=args.new_tokens, tail_ratio=args.tail_ratio, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return [Group(torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist(),
                  tuple(budgets[i * args.n:(i + 1) * args.n])) for i in range(count)]


def _expected_share(groups: list[Group]) -> float:
    """E[length] / E[longest of a group]: the share of the slots that generate with slots // n groups in flight."""
    return (statistics.fmean(b for g in groups for b in g.budgets) / statistics.fmean(max(g.budgets) for g in groups))


def bench_admission(args: AdmissionBenchArgs) -> list[dict]:
    args.validate()
    model = load_model(args.model, dtype=bench_dtype(args.dtype, args.device), device=args.device, seed=args.seed)
    engine = Engine(model, EngineConfig(max_slots=args.slots, max_len=args.prompt_len + args.new_tokens,
                                        cuda_graphs=args.cuda_graphs))
    vocab, per_slots = model.config.vocab_size, max(args.slots // args.n, 1)
    timed = _groups(args, vocab, args.groups, args.seed)
    rows, base = [], None
    for multiple in args.in_flight:
        prompts = max(round(multiple * per_slots), 1)
        # the budgets fix every step's rows and lengths, so a first pass meets (and captures the CUDA graphs of)
        # every shape the timed second pass steps through
        drive(engine, timed, prompts, args.device)
        result = drive(engine, timed, prompts, args.device)
        steady = result["steady_tok_s"]
        base = base or steady  # the first setting's
        row = {"device": device_name(args.device), "model": args.model, "slots": args.slots, "n": args.n,
               "in_flight_multiple": multiple, "prompts_in_flight": prompts, "groups": args.groups,
               "new_tokens": args.new_tokens, "tail_ratio": args.tail_ratio,
               "tok_s": result["tokens"] / result["seconds"], "slots_generating": result["running_rows"] / args.slots,
               "expected_share_at_one": _expected_share(timed), **result,
               "ratio_vs_first": steady / base if steady and base else None}
        print(f"prompts in flight {prompts} ({multiple:g} × slots // n): steady {steady or 0:,.0f} tok/s with "
              f"{row['slots_generating']:.0%} of the slots generating ({row['ratio_vs_first'] or 0:.2f}× the first "
              f"setting's); the whole: {row['tok_s']:,.0f} tok/s, {result['decode_steps']} decode steps", flush=True)
        rows.append(row)
    write_json(args.out, rows)
    return rows
