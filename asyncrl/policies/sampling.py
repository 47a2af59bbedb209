"""The fp32 sampler: temperature, top-k, top-p; returns each token with its behaviour log-prob.

Sampling is inverse-CDF with one uniform number per token, drawn ahead of time from the request's own
generator. So a request with a seed produces the same tokens whatever else is in the batch, and a paused
request resumes exactly where it would have been (no RNG state lives in the engine's step).

The behaviour log-prob is log p(token) under the distribution actually sampled from: softmax(logits / T),
renormalised over the top-k / top-p set when those are on. The learner recomputes log-probs with logits
divided by the same T and no truncation, so keep `top_k=-1, top_p=1` for RL (or let importance weights
absorb the difference). Greedy rows (`temperature=0`) report the log-prob under softmax(logits).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from typing import Callable

import torch
from torch import Tensor

__all__ = ["SamplingParams", "PlainSampler", "sample_tokens", "sample_plain", "plain_sampler", "use_compiled_sampler"]

PlainSampler = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""(logits [B, V], temperature [B], uniforms [B]) -> (tokens [B] int64, behaviour log-probs [B] fp32)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (names follow vLLM's `SamplingParams`)."""

    n: int = 1
    """Samples per prompt; they share one prefill."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 keeps all."""
    max_new_tokens: int = 256
    """Generate at most this many tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Finish when one of these is sampled (it is kept in the output), besides the model's EOS."""
    ignore_eos: bool = False
    """Do not stop at EOS (benchmarks with forced lengths)."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens regardless of the rest of the batch."""

    def stop_ids(self, eos_token_ids) -> frozenset[int]:
        """The tokens that finish a sample: `stop_token_ids`, and the model's EOS unless `ignore_eos`."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first bad field."""
        checks = [
            (self.n >= 1, "n", self.n, "an integer >= 1"),
            (self.temperature >= 0 and self.temperature == self.temperature, "temperature", self.temperature,
             ">= 0 (0 = greedy)"),
            (self.top_k == -1 or self.top_k >= 0, "top_k", self.top_k, "-1 (off) or >= 1"),
            (0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]"),
            (self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1"),
            (all(0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
             f"token ids in [0, {vocab_size})"),
        ]
        for ok, name, value, want in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={value!r} is invalid: must be {want}")

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def sample_tokens(logits: Tensor, temperature: Tensor, uniforms: Tensor, *, top_k: Tensor | None = None,
                  top_p: Tensor | None = None, plain: PlainSampler | None = None) -> tuple[Tensor, Tensor]:
    """Sample one token per row by inverse CDF.

    Args:
      logits: [B, V] (cast to fp32).
      temperature: [B]; rows with 0 are greedy.
      uniforms: [B] in [0, 1).
      top_k: optional [B] int (<= 0: off); top_p: optional [B] float (1: off). Pass both as None when no
        row filters, which avoids sorting the vocabulary.
      plain: the sampler of unfiltered batches (`plain_sampler`); None: torch's.
    Returns:
      tokens [B] int64 and their behaviour log-probs [B] fp32.
    """
    if top_k is None and top_p is None:
        return (plain or _Samplers.plain)(logits, temperature, uniforms)
    logits = logits.float()
    greedy = temperature <= 0
    z = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    tokens, logp = _sample_filtered(z, greedy, uniforms, top_k, top_p)
    # Rows that do not filter must not depend on whether another row of the batch does: the filtered path
    # walks the CDF in sorted order, so give them the unfiltered (vocabulary-order) result.
    off = torch.ones_like(greedy)
    if top_k is not None:
        off &= top_k <= 0
    if top_p is not None:
        off &= top_p >= 1.0
    full_tokens, full_logp = _sample_full(z, greedy, uniforms)
    return torch.where(off, full_tokens, tokens), torch.where(off, full_logp, logp)


def _sample_full(z: Tensor, greedy: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Three passes over [B, V]: softmax, cumsum, search (+ argmax for greedy rows)."""
    probs = torch.softmax(z, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    sampled = torch.searchsorted(cdf, _targets(uniforms, cdf), right=True).squeeze(-1)
    tokens = torch.where(greedy, z.argmax(dim=-1), sampled)
    return tokens, _log_prob(probs.gather(-1, tokens[:, None]).squeeze(-1), z, tokens[:, None], None)


def _log_prob(p: Tensor, z: Tensor, index: Tensor, keep: Tensor | None) -> Tensor:
    """log p of the picked tokens ([B]): of the fp32 probability where it is a normal number (exact to its rounding
    there), else z_t − logsumexp(z over the kept tokens): a token of probability below 1e-38 (drawn where the
    uniform is 0) would lose its log-prob to a denormal's few bits, and z_t − logsumexp loses digits where logits
    are large, so each form serves where it is exact. No host synchronisation: it runs inside captured graphs."""
    tiny = torch.finfo(p.dtype).tiny
    masked = z if keep is None else torch.where(keep, z, torch.full_like(z, float("-inf")))
    return torch.where(p >= tiny, torch.log(p.clamp(min=tiny)),
                       z.gather(-1, index).squeeze(-1) - torch.logsumexp(masked, dim=-1))


def _sample_plain(logits: Tensor, temperature: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor]:
    """Temperature sampling over the whole vocabulary (no sort)."""
    greedy = temperature <= 0
    # dividing by the fp32 temperature also promotes bf16 logits to fp32, in the same pass
    z = logits / torch.where(greedy, torch.ones_like(temperature), temperature).float()[:, None]
    return _sample_full(z, greedy, uniforms)


sample_plain: PlainSampler = _sample_plain
"""Unfiltered temperature sampling in torch (any device)."""


class _Samplers:
    plain = staticmethod(_sample_plain)


def plain_sampler(fused: bool, device: torch.device) -> PlainSampler:
    """The engine's sampler of unfiltered batches: on CUDA with `fused`, the two-pass Triton kernels of
    `asyncrl.policies.triton_sampler` once a probe agrees with torch's; otherwise `sample_plain`."""
    device = torch.device(device)
    if not fused or device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return sample_plain
    return _probed_triton_sampler(device) or sample_plain


@functools.cache
def _probed_triton_sampler(device: torch.device) -> PlainSampler | None:
    """The Triton sampler if it compiles on `device` and picks torch's tokens on a probe (None: it does not)."""
    try:
        from asyncrl.policies.triton_sampler import triton_sample
        gen = torch.Generator().manual_seed(0)
        logits = (torch.randn(5, 20_000, generator=gen) * 4).to(device)
        temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0], device=device)
        uniforms = torch.tensor([0.0, 0.5, 0.25, 0.75, 0.999], device=device)
        logits = logits.bfloat16()  # the engine's graphs hand it logits in the model's dtype
        want, got = _sample_plain(logits, temperature, uniforms), triton_sample(logits, temperature, uniforms)
        if not torch.equal(got[0], want[0]):
            raise ValueError(f"tokens {got[0].tolist()} where torch picks {want[0].tolist()}")
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    except Exception as err:  # noqa: BLE001 - a compiler problem must not take the engine down
        warnings.warn(f"sampler: the Triton kernels are not used ({type(err).__name__}: {str(err)[:200]})")
        return None
    return triton_sample


def use_compiled_sampler(enabled: bool = True, device: torch.device | str | None = None) -> bool:
    """Compile (True) or restore (False) the unfiltered sampler (fewer passes over [B, V] logits on GPU).

    The compiled sampler is checked against the eager one on `device` first (same tokens and log-probs on
    random logits); if it fails to compile or disagrees, the eager sampler stays. Returns whether it is
    compiled.
    """
    _Samplers.plain = staticmethod(_sample_plain)
    if not enabled:
        return False
    compiled = torch.compile(_sample_plain, dynamic=True)
    try:
        for batch in (3, 17):
            gen = torch.Generator().manual_seed(batch)
            logits = (torch.randn(batch, 1000, generator=gen) * 3).to(device or "cpu")
            temperature = torch.rand(batch, generator=gen).to(device or "cpu") + 0.5
            temperature[0] = 0.0
            uniforms = torch.rand(batch, generator=gen).to(device or "cpu")
            want, got = _sample_plain(logits, temperature, uniforms), compiled(logits, temperature, uniforms)
            if not torch.equal(want[0], got[0]):
                raise ValueError("compiled sampler picked different tokens")
            torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    except Exception as err:
        warnings.warn(f"use_compiled_sampler: staying eager ({type(err).__name__}: {str(err)[:200]})")
        return False
    _Samplers.plain = staticmethod(compiled)
    return True


def _targets(uniforms: Tensor, cdf: Tensor) -> Tensor:
    """u·total, kept strictly below the total so the search lands on a token of positive probability."""
    total = cdf[:, -1:]
    return torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))


def _sample_filtered(z: Tensor, greedy: Tensor, uniforms: Tensor, top_k: Tensor | None,
                     top_p: Tensor | None) -> tuple[Tensor, Tensor]:
    vocab = z.shape[-1]
    sorted_z, order = torch.sort(z, dim=-1, descending=True)
    probs = torch.softmax(sorted_z, dim=-1)
    rank = torch.arange(vocab, device=z.device)[None, :]
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        keep &= rank < k[:, None]
    if top_p is not None:
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep &= mass_before < top_p[:, None]
    keep[:, 0] = True
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    kept = kept / kept.sum(dim=-1, keepdim=True)
    cdf = torch.cumsum(kept, dim=-1)
    pick = torch.searchsorted(cdf, _targets(uniforms, cdf), right=True)
    pick = torch.where(greedy[:, None], torch.zeros_like(pick), pick)
    tokens = order.gather(-1, pick).squeeze(-1)
    logp = _log_prob(kept.gather(-1, pick).squeeze(-1), sorted_z, pick, keep)
    greedy_logp = torch.log_softmax(z, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, torch.where(greedy, greedy_logp, logp)
