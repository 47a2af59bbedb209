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
from asyncrl.policies.shared_prompt_attention import sdpa_shared_prompt, shared_prompt_attention  # noqa: E402
from asyncrl.policies.shared_prompt_cache import SharedPromptKVCache  # noqa: E402
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


def shared_reference(q, cache: SharedPromptKVCache, positions):
    """Each row over its logical sequence (its prompt segments, then its own slot up to positions[b]), in float64."""
    t = cache.tables
    group = q.shape[1] // cache.k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    prompt_k, prompt_v, own_k, own_v = (p[0].cpu() for p in (cache.prompt_k, cache.prompt_v, cache.k, cache.v))
    for b in range(q.shape[0]):
        start, last = int(t.row_start[b]), int(positions[b])
        segments = [(int(s), int(n)) for s, n in zip(t.row_slots[b], t.row_lens[b])]
        keys, values = (torch.cat([pool[s, :, :n] for s, n in segments] + [own[b, :, :last - start + 1]], 1).double()
                        .repeat_interleave(group, 0) for pool, own in ((prompt_k, own_k), (prompt_v, own_v)))
        scores = torch.einsum("hd,hld->hl", q[b].double(), keys) / math.sqrt(q.shape[-1])
        out[b] = torch.einsum("hl,hld->hd", torch.softmax(scores, -1), values)
    return out


def run_shared(case: dict) -> dict:
    """Groups of rows over shared prompts (in scattered slots; a group of more than 8 rows takes two readers; with
    `share`, groups after the first read the first's prompt prefix, then their own) and padding rows bound to no
    prompt, as a captured step's: the kernel against SDPA and against float64."""
    gen = torch.Generator().manual_seed(case["seed"])
    kv_heads, group, dim = case["kv_heads"], case["group"], case["dim"]
    sizes, padding = case["groups"], case["padding"]
    rows = sum(sizes) + padding
    share = case.get("share", 0)
    cache = SharedPromptKVCache(1, rows + 1, kv_heads, case["max_len"], dim, torch.float32, DEVICE,
                                max_prompt_len=case["max_prompt_len"], num_prompts=len(sizes) + 1, share_prefix=share)
    order = torch.randperm(sum(sizes), generator=gen).tolist()
    first = None
    for i, (size, length) in enumerate(zip(sizes, case["prompt_lens"])):
        prompt = [1000 + i] * length
        if share and first is not None:
            prompt = first[:share + i] + prompt
        first = first or prompt
        bound, order = order[:size], order[size:]
        match = cache.match(prompt, 0)
        cache.bind(bound, cache.open(prompt[match[1] if match else 0:], parent=match))
    cache.prepare()
    for pool in (cache.k, cache.v, cache.prompt_k, cache.prompt_v):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    starts = cache.tables.row_start.tolist()
    responses = [int(torch.randint(1, cache.response_len + 1, (1,), generator=gen)) for _ in range(rows)]
    positions = torch.tensor([s + r - 1 if s else 0 for s, r in zip(starts, responses)], device=DEVICE)
    q = torch.randn(rows, kv_heads * group, dim, generator=gen).to(DEVICE)
    attend = cache.max_len
    args = (q, cache.prompt_k[0], cache.prompt_v[0], cache.k[0], cache.v[0], cache.tables, positions, attend)
    got = shared_prompt_attention(triton_decode_attention)(*args).cpu()  # the Triton form (any non-SDPA decode)
    want = shared_reference(q.cpu(), cache, positions.cpu()).float()
    sdpa = sdpa_shared_prompt(*args).cpu()
    atol = 4 * 4 * math.sqrt(max(attend, dim)) * torch.finfo(torch.float32).eps * float(cache.v.abs().max())
    shared_rows = int((cache.tables.row_lens[:, -1] > 0).sum()) if share else 0
    return {"case": case, "max_abs_diff": float(max((got - want).abs().max(), (sdpa - want).abs().max())),
            "atol": atol, "rows_sharing": shared_rows}


def run(case: dict) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both sides, also on a GPU
    if "groups" in case:
        return run_shared(case)
    gen = torch.Generator().manual_seed(case["seed"])
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
