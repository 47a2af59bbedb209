"""Runs the Triton decode-attention kernel against SDPA for the cases given as JSON on argv, compiled on a GPU or under
Triton's interpreter on CPU tensors (TRITON_INTERPRET=1); prints one JSON list of {case, max_abs_diff, atol}.
`test_decode_attention.py` runs this in a process of its own: TRITON_INTERPRET must be set before the kernel is
defined."""

import json
import math
import os
import sys

import torch

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

from asyncrl.policies.decode_attention import sdpa_decode  # noqa: E402
from asyncrl.policies.triton_decode import triton_decode_attention  # noqa: E402


def causal_reference(q, k, v, lengths, width: int):
    """Width queries a slot (q [B·W, H, D]), query w of slot b over its first lengths[b] − (W − 1 − w) positions:
    softmax attention written out in float64."""
    batch, heads = lengths.shape[0], q.shape[1]
    group = heads // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(batch):
        keys, values = (t[b].double().repeat_interleave(group, 0) for t in (k, v))  # [H, L, D]
        for w in range(width):
            seen = int(lengths[b]) - (width - 1 - w)
            scores = torch.einsum("hd,hld->hl", q[b * width + w].double(), keys[:, :seen]) / math.sqrt(q.shape[-1])
            out[b * width + w] = torch.einsum("hl,hld->hd", torch.softmax(scores, -1), values[:, :seen])
    return out


def run(case: dict) -> dict:
    gen = torch.Generator().manual_seed(case["seed"])
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both sides, also on a GPU
    batch, kv_heads, group, dim, max_len = case["batch"], case["kv_heads"], case["group"], case["dim"], case["max_len"]
    slots = batch + 2  # slots past the batch hold other sequences: never read
    k, v = (torch.randn(slots, kv_heads, max_len, dim, generator=gen) for _ in range(2))
    width = case.get("width", 1)
    q = torch.randn(batch * width, kv_heads * group, dim, generator=gen)
    positions = torch.tensor(case["positions"])  # each slot's last query's position
    attend = int(positions.max()) + 1
    q, k, v, positions = (t.to(DEVICE) for t in (q, k, v, positions))
    got = triton_decode_attention(q, k, v, positions + 1, attend_len=attend, block_n=case["block_n"],
                                  splits=case["splits"], width=width).cpu()
    if width == 1:
        want = sdpa_decode(q, k, v, positions, attend).cpu()
    else:
        want = causal_reference(q.cpu(), k.cpu(), v.cpu(), positions.cpu() + 1, width).float()
    # softmax-weighted sums over <= attend terms of values ~N(0, 1): float32 rounding, sqrt(terms) growth
    atol = 4 * 4 * math.sqrt(max(attend, dim)) * torch.finfo(torch.float32).eps * float(v.abs().max())
    return {"case": case, "max_abs_diff": float((got - want).abs().max()), "atol": atol}


if __name__ == "__main__":
    print(json.dumps([run(case) for case in json.loads(sys.argv[1])]))
