"""The embedded engine's speculative step in fixed shapes, so that on CUDA it replays as a captured graph.

A speculative step (`asyncrl.policies.speculation`) is a forward over each row's newest token and its draft. Run
eagerly it costs a host-bound forward: 27 ms a step for a Qwen3-1.7B shape at 8 rows on an H200, against 2.3 ms
for a graph-replayed decode step, which no draft could pay back. Here every row checks `width` positions (its draft
padded; the padding's outputs are ignored and its K/V writes lie past the row's sequence), rows are the running
slots 0..n−1 as in a decode step, and the keys span an attention bucket: the shapes depend only on (batch bucket,
attend length), and each pair is captured once, as `DecodeSteps` does for decode steps. The rows being the slots,
the keys are read in place: on CUDA by the Triton decode kernel in its several-queries-a-slot form
(`KVCache.attend_in_order`), elsewhere by SDPA masked over the span. The logits are the LM head's in the model's
dtype and the sampler the decode step's, so a verified token is computed as a decoded one is. Rows that filter
(top-k / top-p), and rows whose fixed width would run past their slot's end, take the eager `verify_drafts`.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch
from torch import Tensor

from asyncrl.policies.attention_layouts import CacheExtension
from asyncrl.policies.kv_cache import KVCache
from asyncrl.policies.model import CausalLM
from asyncrl.policies.sampling import PlainSampler
from asyncrl.policies.speculation import Verified, accepted_length

__all__ = ["VerifySteps"]


class VerifySteps:
    """Device-resident inputs of a speculative step and its captured graphs (module docstring)."""

    def __init__(self, model: CausalLM, cache: KVCache, num_slots: int, width: int, sampler: PlainSampler, *,
                 buckets: Sequence[int] | None):
        self.model, self.cache, self.sampler, self.width = model, cache, sampler, width
        device = model.device
        self.ids = torch.zeros(num_slots, width, dtype=torch.long, device=device)
        self.starts = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.slots = torch.arange(num_slots, device=device)
        self.temperature = torch.ones(num_slots * width, device=device)
        self.uniforms = torch.zeros(num_slots * width, device=device)
        self.buckets = sorted(buckets) if buckets else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor]]] = {}
        self.pool = None
        self.capturable = True  # False once a capture failed: every shape then runs eagerly

    def clear(self) -> None:
        """Drop the captured graphs (the KV cache they point into was freed)."""
        self.graphs.clear()
        self.pool = None

    def bucket(self, n: int) -> int:
        return n if self.buckets is None else next((b for b in self.buckets if b >= n), n)

    def _step(self, batch: int, span: int) -> tuple[Tensor, Tensor]:
        extension = CacheExtension(self.starts[:batch], span, in_order=True)  # rows are slots 0..batch−1
        hidden = self.model(self.ids[:batch], cache=self.cache, cache_slots=self.slots[:batch], extension=extension)
        logits = self.model.lm_head(hidden.reshape(batch * self.width, -1))  # the samplers read it in fp32
        n = batch * self.width
        return self.sampler(logits, self.temperature[:n], self.uniforms[:n])

    @torch.inference_mode()
    def verify(self, samples: Sequence, drafts: Sequence[Sequence[int]], span: int, *, held_from: int) -> Verified:
        """Check `drafts` (one per running sample, rows 0..n−1 in order; each at most width − 1 tokens) over keys
        [0, span) (a bucket covering every row's newest position + width, at most the cache's length). With graphs,
        replay the captured graph of the batch's bucket (padding rows decode a dummy draft at position 0 of free
        slots) unless the bucket reaches `held_from`, the first slot of held sessions; else run eagerly."""
        n, width = len(samples), self.width
        graph = self.buckets is not None and self.bucket(n) <= held_from
        batch = self.bucket(n) if graph else n
        done = [len(s.completion.token_ids) for s in samples]
        ids = torch.zeros(batch, width, dtype=torch.long)
        uniforms = torch.zeros(batch, width)
        starts = torch.zeros(batch, dtype=torch.long)
        for b, (s, d, j) in enumerate(zip(samples, drafts, done)):
            row = [s.completion.token_ids[-1], *d]
            ids[b, :len(row)] = torch.tensor(row)
            draws = s.uniforms[j:j + width]
            uniforms[b, :len(draws)] = torch.tensor(draws)
            starts[b] = s.cached_len
        temperature = torch.tensor([s.request.params.temperature for s in samples] + [1.0] * (batch - n))
        device = self.ids.device
        self.ids[:batch].copy_(ids.to(device, non_blocking=True))
        self.starts[:batch].copy_(starts.to(device, non_blocking=True))
        self.uniforms[:batch * width].copy_(uniforms.reshape(-1).to(device, non_blocking=True))
        self.temperature[:batch * width].copy_(temperature.repeat_interleave(width).to(device, non_blocking=True))
        if graph and self.capturable:
            tokens, logprobs = self._replay(batch, span)
        else:
            tokens, logprobs = self._step(batch, span)
        tokens_l = tokens.view(batch, width).tolist()
        logprobs_l = logprobs.view(batch, width).tolist()
        out_tokens = [tokens_l[b][:len(d) + 1] for b, d in enumerate(drafts)]
        out_logprobs = [logprobs_l[b][:len(d) + 1] for b, d in enumerate(drafts)]
        return Verified(out_tokens, out_logprobs, [accepted_length(d, t) for d, t in zip(drafts, out_tokens)])

    def _replay(self, batch: int, span: int) -> tuple[Tensor, Tensor]:
        key = (batch, span)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(batch, span)
            except RuntimeError as err:  # a kernel that refuses capture: run every shape eagerly from now on
                warnings.warn(f"speculation: the verifying step runs eagerly ({str(err)[:200]})")
                self.capturable = False
                return self._step(batch, span)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, batch: int, span: int):
        # as DecodeSteps._capture: the engine's device current, a warm-up outside the graph, thread-local capture
        with torch.cuda.device(self.ids.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(batch, span)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._step(batch, span)
            self.pool = graph.pool()
            return graph, out
