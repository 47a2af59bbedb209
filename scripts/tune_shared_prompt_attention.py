"""One layer's shared-prompt decode attention (`asyncrl.policies.triton_decode.triton_shared_prompt_attention`) at
Qwen3-1.7B / 8B head shapes, over launch configurations, beside the per-slot kernel on whole sequences. GPU only.

    python scripts/tune_shared_prompt_attention.py out.json

n = 8 samples of 2,048-token prompts with 256 cached response positions each, in bf16; 32 and 96 prompts (the
per-slot kernel at 32 only: its cache of 96 × 8 whole sequences would not fit beside). Milliseconds a call from
CUDA events over 20 calls after one; each configuration is (block_n, num_warps, prompt splits, num_stages), the
response splits 1. Prints each shape's per-slot time, the default configuration's and the best, with the bytes
the shared layout must read over the best time.
"""

import itertools
import json
import sys

import torch

from asyncrl.policies.shared_prompt_cache import SharedPromptKVCache
from asyncrl.policies.triton_decode import triton_decode_attention, triton_shared_prompt_attention
from asyncrl_bench.timing import cuda_time_us


def timeit(fn, reps: int = 20) -> float:
    """Milliseconds a call (CUDA events over `reps` calls after one)."""
    return cuda_time_us(fn, reps) / 1e3


def main(path: str) -> None:
    out = []
    for name, kv_heads, group in (("1.7b", 8, 2), ("8b", 8, 4)):
        for prompts in (32, 96):
            n, prompt_len, room, dim, responses = 8, 2048, 512, 128, 256
            rows = prompts * n
            cache = SharedPromptKVCache(1, rows, kv_heads, prompt_len + room, dim, torch.bfloat16, "cuda",
                                        max_prompt_len=prompt_len, num_prompts=prompts)
            for i in range(prompts):
                cache.bind(list(range(i * n, i * n + n)), cache.open(list(range(prompt_len))))
            cache.prepare()
            for pool in (cache.k, cache.v, cache.prompt_k, cache.prompt_v):
                pool.normal_()
            q = torch.randn(rows, kv_heads * group, dim, device="cuda", dtype=torch.bfloat16)
            t = cache.tables
            response_len = torch.full((rows,), responses, device="cuda")
            nbytes = (prompts * prompt_len + rows * responses) * kv_heads * dim * 2 * 2
            row = dict(shape=name, prompts=prompts, rows=rows, bytes=nbytes)
            if prompts == 32:  # the per-slot kernel over whole sequences, in a cache of that size
                k = torch.randn(rows, kv_heads, prompt_len + room, dim, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                lengths = torch.full((rows,), prompt_len + responses, device="cuda")
                row["slot_ms"] = timeit(lambda: triton_decode_attention(q, k, v, lengths, attend_len=prompt_len + room))
                row["slot_tb_s"] = rows * (prompt_len + responses) * kv_heads * dim * 4 / row["slot_ms"] / 1e9
                del k, v
            for block_n, warps, splits, stages in itertools.product((32, 64, 128), (4, 8), (None, 2, 4, 8), (2, 3)):
                row[f"bn{block_n}_w{warps}_s{splits}_st{stages}"] = timeit(lambda: triton_shared_prompt_attention(
                    q, cache.prompt_k[0], cache.prompt_v[0], cache.k[0], cache.v[0], t.reader_slot, t.reader_len,
                    t.reader_rows, response_len, attend_len=prompt_len + room, block_n=block_n, num_warps=warps,
                    num_stages=stages, splits=None if splits is None else (splits, 1)))
            best = min((v, k) for k, v in row.items() if k.startswith("bn"))
            row.update(best=best, best_tb_s=nbytes / best[0] / 1e9, default_ms=row["bn128_w4_sNone_st2"])
            print(json.dumps({k: row[k] for k in ("shape", "prompts", "slot_ms", "slot_tb_s", "default_ms", "best",
                                                  "best_tb_s") if k in row}), flush=True)
            out.append(row)
            del cache
    with open(path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
