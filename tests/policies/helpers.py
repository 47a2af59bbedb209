"""Shared builders for the `asyncrl.policies` tests: tiny random models whose outputs vary, references.

`random_model('tiny-qwen2')` initialises with std 0.02, which gives near-uniform, repetitive outputs; the
models here use a larger `initializer_range` (and optionally random norm weights and biases) so greedy and
sampled sequences differ token by token and a wrong index or a stale K/V shows up in the logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import Tensor

from asyncrl.policies import ARCH_PRESETS, CausalLM, Engine, EngineConfig, SamplingParams, random_model
from asyncrl.policies.model import token_logprobs
from asyncrl.types import GenerationOutput
from tests.timing import limit
from tests.tolerances import forward_tol

VOCAB = ARCH_PRESETS["tiny-qwen2"]["vocab_size"]  # 256
EOS = ARCH_PRESETS["tiny-qwen2"]["eos_token_id"]  # 2


def tiny_config(model_type: str = "qwen2", *, initializer_range: float = 0.5, **overrides) -> dict:
    """The `tiny-qwen2` preset as an HF config dict, with another model_type / init scale / fields."""
    cfg = dict(ARCH_PRESETS["tiny-qwen2"], model_type=model_type, initializer_range=initializer_range)
    cfg.update(overrides)
    return cfg


def tiny_model(seed: int = 0, *, perturb: bool = False, **config) -> CausalLM:
    """A float32 CPU model of `tiny_config(**config)`; `perturb` also randomises norm weights and biases
    (random init leaves them at 1 and 0, which would hide a misplaced norm or a dropped bias)."""
    model = random_model(tiny_config(**config), seed=seed)
    if perturb:
        gen = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                elif name.endswith(".bias"):
                    p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def make_prompts(lengths, seed: int = 0) -> list[list[int]]:
    """Random prompts of these lengths, ids in [3, VOCAB) (no BOS/EOS)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def small_config(**overrides) -> EngineConfig:
    """An engine small enough for CPU tests; attend_bucket=8 so the decode attention length changes bucket
    several times within one generation."""
    kw = dict(max_slots=8, max_len=128, attend_bucket=8, max_prefill_tokens=4096)
    kw.update(overrides)
    return EngineConfig(**kw)


@torch.no_grad()
def forward_logprobs(model: CausalLM, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> Tensor:
    """The training side: one forward over prompt + tokens, log-probs of `tokens` at `temperature` (on the CPU)."""
    ids = torch.tensor([prompt + tokens], device=model.device)
    logits = model.logits(model(ids))[0, len(prompt) - 1:-1]
    return token_logprobs(logits, ids[0, len(prompt):], temperature).cpu()


@torch.no_grad()
def logprob_tol(model: CausalLM, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> float:
    """Tolerance for log-probs of `tokens` computed two ways (engine vs training forward, in a batch vs
    alone): `forward_tol` at the scale of the logits they come from, over prompt + tokens, at `temperature`
    (0, greedy, reports log-probs at 1)."""
    logits = model.logits(model(torch.tensor([prompt + tokens], device=model.device)))
    return forward_tol(logits, model.config, temperature=temperature)


@torch.no_grad()
def manual_greedy(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full re-forward of the growing sequence (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model.logits(model(torch.tensor([seq])))[0, -1].argmax()))
    return seq[len(prompt):]


def run_alone(model: CausalLM, prompt: list[int], params: SamplingParams, config: EngineConfig | None = None
              ) -> GenerationOutput:
    """The same request on a fresh engine with nothing else in the batch."""
    return Engine(model, config or small_config()).generate([prompt], params)[0]


def drain(engine: Engine, max_steps: int = 10_000) -> dict[str, GenerationOutput]:
    """step() until nothing is unfinished; the outputs by request id."""
    done: dict[str, GenerationOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} returned twice"
            done[out.request_id] = out
    raise AssertionError(f"engine did not finish in {max_steps} steps")


def drain_across_an_update(engine: Engine, weights, *, at_step: int, kv: str,
                           max_steps: int = 10_000) -> dict[str, GenerationOutput]:
    """`drain`, with `update_weights(weights, version=1, kv=kv)` before step `at_step` (requests keep being admitted
    across it)."""
    done: dict[str, GenerationOutput] = {}
    for step in range(max_steps):
        if not engine.has_unfinished():
            return done
        if step == at_step:
            engine.update_weights(weights, version=1, kv=kv)
        done.update({o.request_id: o for o in engine.step()})
    raise AssertionError(f"engine did not finish in {max_steps} steps")


def token_lists(out: GenerationOutput) -> list[list[int]]:
    return [c.token_ids for c in out.completions]


def assert_same_output(a: GenerationOutput, b: GenerationOutput, model: CausalLM, params: SamplingParams) -> None:
    """Same tokens, finish reasons and versions; log-probs equal up to batch-composition rounding (of the
    `model` that generated both, sampling with `params`)."""
    assert len(a.completions) == len(b.completions)
    for i, (ca, cb) in enumerate(zip(a.completions, b.completions)):
        assert ca.token_ids == cb.token_ids, f"sample {i}: tokens differ"
        assert ca.finish_reason == cb.finish_reason, f"sample {i}: {ca.finish_reason} != {cb.finish_reason}"
        assert ca.versions == cb.versions
        atol = logprob_tol(model, a.prompt_ids, ca.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=atol, rtol=0)


@torch.no_grad()
def assert_follows_the_model(model: CausalLM, prompts: list[list[int]], outs: list[GenerationOutput],
                             temperature: float) -> None:
    """The sampled tokens follow the model's distribution at `temperature`: a randomised probability integral
    transform (F(t−1) + w·p(t), w ~ U(0, 1), is U(0, 1) for t drawn from p, whatever the vocabulary's order, and
    independent across tokens) passes a KS test at p = 0.001 over at least 300 tokens."""
    gen = torch.Generator().manual_seed(0)
    pit = []
    for prompt, out in zip(prompts, outs):
        for c in out.completions:
            logits = model.logits(model(torch.tensor([prompt + c.token_ids])))[0, len(prompt) - 1:-1]
            p = torch.softmax(logits.double() / temperature, -1)
            t = torch.tensor(c.token_ids)
            lo = torch.cumsum(p, -1).gather(-1, t[:, None])[:, 0] - p.gather(-1, t[:, None])[:, 0]
            pit.append(lo + torch.rand(len(t), generator=gen, dtype=torch.float64) * p.gather(-1, t[:, None])[:, 0])
    v = torch.sort(torch.cat(pit)).values
    n = len(v)
    assert n > 300
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum(grid - v, v - (grid - 1 / n)).max().item()
    assert ks < 1.95 / n ** 0.5, f"KS statistic {ks:.3f} over {n} tokens (critical {1.95 / n ** 0.5:.3f} at p=0.001)"


def assert_consistent(out: GenerationOutput) -> None:
    """Every completion carries one log-prob and one version per token."""
    for c in out.completions:
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions)


def run_kernel_cases(module: str, cases: list[dict]) -> list[dict]:
    """Run a Triton kernel's case module (`python -m module cases-as-JSON`) in a process of its own: compiled
    where a GPU is, else under Triton's interpreter on CPU (TRITON_INTERPRET must be set before the kernels are
    defined). Returns the JSON list the module prints last."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-m", module, json.dumps(cases)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=limit(300))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
