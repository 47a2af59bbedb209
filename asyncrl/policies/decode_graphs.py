"""CUDA graphs of the embedded engine's decode step (see `asyncrl.policies.engine`)."""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.policies.kv_cache import KVCache
from asyncrl.policies.model import CausalLM
from asyncrl.policies.sampling import PlainSampler

__all__ = ["DecodeGraphs"]


class DecodeGraphs:
    """CUDA graphs of the decode step — forward, logits (in the model's dtype: the samplers read them in fp32)
    and the unfiltered sampler — keyed by (batch bucket, attend length).

    Static input buffers are filled before each replay; rows past the real batch decode a dummy token in
    free slots at position 0, which is harmless (those slots are rewritten at their next prefill).
    """

    def __init__(self, model: CausalLM, cache: KVCache, num_slots: int, sampler: PlainSampler):
        self.model, self.cache, self.sampler = model, cache, sampler
        n = num_slots
        device = model.device
        self.tokens = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, 1, dtype=torch.long, device=device)
        self.temperature = torch.ones(n, device=device)
        self.uniforms = torch.zeros(n, device=device)
        self.buckets = sorted({b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384,
                                           448, 512) if b < n} | {n})
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor, Tensor]]] = {}
        self.pool = None

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    def _capture(self, batch: int):
        # streams and graphs belong to the *current* device, which is per thread: make it the engine's
        with torch.cuda.device(self.tokens.device):
            return self._capture_on_device(batch)

    def _capture_on_device(self, batch: int):
        model, cache = self.model, self.cache

        def run() -> tuple[Tensor, Tensor, Tensor]:
            hidden = model(self.tokens[:batch], self.positions[:batch], cache=cache, decode=True)
            logits = model.lm_head(hidden[:, 0])
            tokens, logprobs = self.sampler(logits, self.temperature[:batch], self.uniforms[:batch])
            return logits, tokens, logprobs

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm-up: allocations and compilation outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread-local capture: in a colocated process the trainer's thread keeps using the GPU (a checkpoint's
        # device-to-host copies, allocations) while this thread captures; the default global mode turns those
        # calls into "operation not permitted when stream is capturing" and invalidates the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = run()
        self.pool = graph.pool()
        return graph, out

    def bucket(self, n: int) -> int:
        """The captured batch size that runs n rows."""
        return next(b for b in self.buckets if b >= n)

    def run(self, tokens: Tensor, positions: Tensor, temperature: Tensor, uniforms: Tensor,
            attend: int) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        n = tokens.shape[0]
        batch = self.bucket(n)
        self.tokens[:n, 0].copy_(tokens, non_blocking=True)
        self.positions[:n, 0].copy_(positions, non_blocking=True)
        self.temperature[:n].copy_(temperature, non_blocking=True)
        self.uniforms[:n].copy_(uniforms, non_blocking=True)
        if batch > n:
            self.tokens[n:batch].zero_()
            self.positions[n:batch].zero_()
        key = (batch, attend)
        self.cache.attend_len = attend
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch)
        graph, (logits, tokens_out, logprobs) = self.graphs[key]
        graph.replay()
        return logits[:n], (tokens_out[:n], logprobs[:n])
