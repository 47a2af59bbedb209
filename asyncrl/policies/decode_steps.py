"""The embedded engine's decode step over inputs that live on the device (see `asyncrl.policies.engine`).

Row r's newest token and its position are kept in `tokens[r]` / `positions[r]`. A step reads rows [0, n),
samples each row's next token, writes it back as the row's newest token and advances the position. So the next
step can be launched before the host has read this one's tokens: the engine keeps one step in flight and does
its per-token bookkeeping (appending, stop checks, slot moves) while the GPU runs the next one. When the host
changes rows (a prefill adds some, a finished row's slot is filled by the last one), it changes them here too
(`set_rows`, `move_row`), in stream order after the step in flight.

With CUDA graphs the step is captured per (batch bucket, attend length): rows past the real batch decode a dummy
token in free slots at position 0, which is harmless (those slots are rewritten at their next prefill).
Without, the same function runs eagerly on exactly n rows (CPU, or when padding rows would reach held slots).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from asyncrl.policies.kv_cache import KVCache
from asyncrl.policies.model import CausalLM
from asyncrl.policies.sampling import PlainSampler

__all__ = ["DecodeSteps", "Launched", "attend_length"]

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def attend_length(needed: int, bucket: int, max_len: int) -> int:
    """`bucket` × the smallest power of two covering `needed`, capped at `max_len`: the positions a step attends
    over (few graph shapes)."""
    length = bucket
    while length < needed:
        length *= 2
    return min(length, max_len)


@dataclasses.dataclass(eq=False)
class Launched:
    """A decode step on its way: row i decodes `samples[i]`; its tokens and log-probs are read by `results`."""

    samples: list
    logits: Tensor
    """[n, V] in the model's dtype (valid until the next step of a captured graph runs)."""
    tokens: Tensor
    logprobs: Tensor
    ready: torch.cuda.Event | None
    pending: frozenset[int] = frozenset()
    """ids of the samples this step decodes: until it is read, each has one more token than the host knows."""

    def results(self) -> tuple[list[int], list[float]]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens.tolist(), self.logprobs.tolist()


class DecodeSteps:
    """Device-resident decode inputs and the step that reads and advances them (module docstring)."""

    def __init__(self, model: CausalLM, cache: KVCache, num_slots: int, sampler: PlainSampler, *, graphs: bool):
        self.model, self.cache, self.sampler = model, cache, sampler
        device = model.device
        self.tokens = torch.zeros(num_slots, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(num_slots, 1, dtype=torch.long, device=device)
        self.temperature = torch.ones(num_slots, device=device)
        self.uniforms = torch.zeros(num_slots, device=device)
        self.buckets = sorted({b for b in _BUCKETS if b < num_slots} | {num_slots}) if graphs else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[Tensor, Tensor, Tensor]]] = {}
        self.pool = None
        self._pinned = [self._host_buffers(num_slots) for _ in range(2)] if device.type == "cuda" else None
        self._turn = 0

    @staticmethod
    def _host_buffers(n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Pinned (so copies are asynchronous): a step's temperature and uniforms in, its tokens and log-probs out."""
        return (torch.empty(2, n, dtype=torch.float32, pin_memory=True),
                torch.empty(n, dtype=torch.long, pin_memory=True), torch.empty(n, dtype=torch.float32, pin_memory=True))

    def clear(self) -> None:
        """Drop the captured graphs (the KV cache they point into was freed)."""
        self.graphs.clear()
        self.pool = None

    def bucket(self, n: int) -> int | None:
        """The captured batch size that runs n rows (None: no graphs)."""
        return None if self.buckets is None else next(b for b in self.buckets if b >= n)

    # ---------------------------------------------------------------- rows
    def set_rows(self, rows: list[int] | None, tokens: list[int], positions: list[int]) -> None:
        """Rows whose newest token the host knows (after a prefill; None: rows [0, len(tokens)), every row when
        nothing is in flight)."""
        device = self.tokens.device
        index = slice(0, len(tokens)) if rows is None else torch.tensor(rows, device=device)
        self.tokens[index, 0] = torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True)
        self.positions[index, 0] = torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True)

    def move_row(self, src: int, dst: int) -> None:
        """Row `src`'s sequence now lives in row `dst` (its slot was moved there)."""
        self.tokens[dst] = self.tokens[src]
        self.positions[dst] = self.positions[src]

    # ---------------------------------------------------------------- the step
    def _step(self, batch: int) -> tuple[Tensor, Tensor, Tensor]:
        hidden = self.model(self.tokens[:batch], self.positions[:batch], cache=self.cache, decode=True)
        logits = self.model.lm_head(hidden[:, 0])  # the samplers read the model's dtype in fp32
        tokens, logprobs = self.sampler(logits, self.temperature[:batch], self.uniforms[:batch])
        self.tokens[:batch, 0] = tokens
        self.positions[:batch] += 1
        return logits, tokens, logprobs

    def launch(self, samples: list, temperature: Tensor, uniforms: Tensor, attend: int, *,
               graph: bool) -> Launched:
        """Start the step of rows [0, len(samples)) (temperature, uniforms: [n] on the host); `graph`: replay a
        captured graph (padding rows up to the bucket) rather than run eagerly."""
        n = len(samples)
        host = None
        if self._pinned is not None:  # two sets: one step's is read while the next one's fill
            host = self._pinned[self._turn]
            self._turn ^= 1
            host[0][0, :n], host[0][1, :n] = temperature, uniforms
            temperature, uniforms = host[0][0, :n], host[0][1, :n]
        self.temperature[:n].copy_(temperature, non_blocking=True)
        self.uniforms[:n].copy_(uniforms, non_blocking=True)
        self.cache.attend_len = attend
        self.cache.prepare(self.bucket(n) if graph else n)
        if not graph:
            logits, tokens, logprobs = self._step(n)
        else:
            batch = self.bucket(n)
            if batch > n:
                self.tokens[n:batch].zero_()
                self.positions[n:batch].zero_()
            key = (batch, attend)
            if key not in self.graphs:
                self.graphs[key] = self._capture(batch)
            graph_, (logits, tokens, logprobs) = self.graphs[key]
            graph_.replay()
        pending = frozenset(map(id, samples))
        if host is None:
            return Launched(samples, logits[:n], tokens[:n], logprobs[:n], None, pending)
        _, host_tokens, host_logprobs = host
        host_tokens[:n].copy_(tokens[:n], non_blocking=True)
        host_logprobs[:n].copy_(logprobs[:n], non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Launched(samples, logits[:n], host_tokens[:n], host_logprobs[:n], ready, pending)

    def _capture(self, batch: int):
        # streams and graphs belong to the *current* device, which is per thread: make it the engine's
        with torch.cuda.device(self.tokens.device):
            saved = self.tokens[:batch].clone(), self.positions[:batch].clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(batch)  # warm-up: allocations and compilation outside the graph
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread-local capture: in a colocated process the trainer's thread keeps using the GPU (a checkpoint's
            # device-to-host copies, allocations) while this thread captures; the default global mode turns
            # those calls into "operation not permitted when stream is capturing" and invalidates the capture
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._step(batch)
            self.pool = graph.pool()
            self.tokens[:batch], self.positions[:batch] = saved  # the warm-up advanced the rows: undo it
            return graph, out
