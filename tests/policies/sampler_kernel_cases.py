"""Runs the Triton sampler (`asyncrl.policies.triton_sampler`) on the cases given as JSON on argv, compiled on a GPU
or under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1), and checks each row against an fp64 CDF; prints
one JSON list of per-case findings. `test_triton_sampler.py` runs this in a process of its own: TRITON_INTERPRET must
be set before the kernels are defined."""

import json
import math
import os
import sys

import torch

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

from asyncrl.policies.sampling import sample_tokens  # noqa: E402
from asyncrl.policies.triton_sampler import triton_sample  # noqa: E402


def _inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(case["seed"])
    batch, vocab = case["batch"], case["vocab"]
    logits = torch.randn(batch, vocab, generator=gen) * case["spread"]
    for row, (lo, hi) in case.get("masked", {}).items():  # a band of -inf (masked vocabulary)
        logits[int(row), lo:hi] = float("-inf")
    for row, (at, value) in case.get("peaks", {}).items():  # a row whose mass sits on one token
        logits[int(row), at] = value
    temperature = torch.tensor(case["temperature"], dtype=torch.float32)
    uniforms = torch.tensor(case["uniforms"], dtype=torch.float32)
    return logits.to(getattr(torch, case["dtype"])), temperature, uniforms


def _check_row(z: torch.Tensor, greedy: bool, u: float, token: int, logp: float, tol: float) -> list[str]:
    """Where token/logp disagree with the fp64 distribution softmax(z) beyond rounding (empty: they agree)."""
    probs = torch.softmax(z, -1)
    problems = []
    if greedy:
        if token != int(z.argmax()):
            problems.append(f"greedy token {token}, argmax {int(z.argmax())}")
    else:
        cdf = torch.cumsum(probs, -1)
        below = float(cdf[token - 1]) if token > 0 else 0.0
        if not (probs[token] > 0 and below - tol <= u < float(cdf[token]) + tol):
            problems.append(f"u={u} outside [{below}, {float(cdf[token])}) of token {token}")
    if abs(logp - math.log(float(probs[token]))) > tol * 10 + 1e-5 * abs(logp):
        problems.append(f"logp {logp} vs fp64 {math.log(float(probs[token]))}")
    return problems


def run(case: dict) -> dict:
    logits, temperature, uniforms = _inputs(case)
    kw = dict(chunk=case["chunk"], block=case["block"])
    tokens, logp = (t.cpu() for t in triton_sample(logits.to(DEVICE), temperature.to(DEVICE), uniforms.to(DEVICE), **kw))
    eager = sample_tokens(logits.float(), temperature, uniforms)
    # rounding of a sum of V fp32 terms on both sides (see tests/tolerances.py), plus the fp64 reference's own
    tol = 4 * 2 * math.sqrt(case["vocab"]) * torch.finfo(torch.float32).eps
    problems = []
    for b in range(case["batch"]):
        t = float(temperature[b])
        z = logits[b].double() / (t if t > 0 else 1.0)
        problems += [f"row {b}: {p}" for p in _check_row(z, t <= 0, float(uniforms[b]), int(tokens[b]),
                                                         float(logp[b]), tol)]
    alone = [triton_sample(logits[b:b + 1].to(DEVICE), temperature[b:b + 1].to(DEVICE), uniforms[b:b + 1].to(DEVICE),
                           **kw) for b in range(case["batch"])]
    batch_free = all(int(a[0][0]) == int(tokens[b]) and float(a[1][0]) == float(logp[b]) for b, a in enumerate(alone))
    return {"case": case["name"], "problems": problems, "batch_free": batch_free,
            "tokens_as_eager": int((tokens == eager[0]).sum()), "rows": case["batch"]}


if __name__ == "__main__":
    print(json.dumps([run(case) for case in json.loads(sys.argv[1])]))
