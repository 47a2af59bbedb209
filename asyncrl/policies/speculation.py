"""Lossless speculative decoding for the embedded engine: check every row's draft in one forward.

Row b's newest token sits at position p_b (its K/V not yet cached) and a draft d_1..d_k proposes what follows
(`asyncrl.policies.drafts`). One forward over [newest, d_1 .. d_k] at positions p_b .. p_b + k continues the slot's
cached sequence (`CacheExtension`) and writes those K/V; position i's logits are the model's distribution after
the newest token and d_1..d_i. Each is sampled exactly as a plain decode step would sample the row's token number
j + i (the request's own uniform number for that token, its temperature, top-k and top-p; `sample_tokens`), so
the sampled token s_i is the token the row would have drawn had its earlier tokens been newest, d_1..d_i. The step
keeps s_0 always, and s_i while d_i == s_{i-1} (`accepted_length`): every kept token is the one plain decoding
would have produced, with the verifying forward's log-prob. A seeded request's tokens are therefore the same with
and without speculation (up to the rounding of a different attention path: in fp32 their log-probs agree to
~1e-6), and a token is stamped with the weight version that verified it.

K/V written past a row's kept tokens (rejected drafts, padding of shorter drafts) lie beyond its sequence and are
written again before any step reads them, as with right-padded extends.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from asyncrl.policies.attention_layouts import CacheExtension
from asyncrl.policies.kv_cache import KVCache
from asyncrl.policies.model import CausalLM
from asyncrl.policies.sampling import PlainSampler, sample_tokens

__all__ = ["accepted_length", "Verified", "verify_drafts", "verify_samples", "draft_room"]


def accepted_length(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many of `sampled` (len(draft) + 1 tokens: the row's draw after its newest token and after each drafted
    token) plain decoding would have produced: sampled[0], then sampled[i] while draft[i-1] == sampled[i-1]."""
    if len(sampled) != len(draft) + 1:
        raise ValueError(f"accepted_length: {len(sampled)} sampled tokens for a draft of {len(draft)}; need one more")
    kept = 1
    while kept <= len(draft) and draft[kept - 1] == sampled[kept - 1]:
        kept += 1
    return kept


@dataclasses.dataclass(frozen=True)
class Verified:
    """Per row: the len(draft) + 1 sampled tokens and their log-probs, and how many of them to keep."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    kept: list[int]

    def runs(self, stop_ids: Sequence[frozenset[int]]) -> list[tuple[list[int], list[float]]]:
        """Each row's tokens to append and their log-probs: the kept ones, up to and including the first of the
        row's stop tokens (a stop inside a kept draft ends the sample there)."""
        out = []
        for tokens, logprobs, kept, stops in zip(self.tokens, self.logprobs, self.kept, stop_ids):
            end = next((i + 1 for i, t in enumerate(tokens[:kept]) if t in stops), kept)
            out.append((tokens[:end], logprobs[:end]))
        return out


@torch.inference_mode()
def verify_drafts(model: CausalLM, cache: KVCache, *, slots: Sequence[int], newest: Sequence[int],
                  positions: Sequence[int], drafts: Sequence[Sequence[int]], temperature: Sequence[float],
                  uniforms: Sequence[Sequence[float]], top_k: Sequence[int] | None = None,
                  top_p: Sequence[float] | None = None, plain: PlainSampler | None = None) -> Verified:
    """One forward over every row's newest token and draft, each position sampled (module docstring).

    Args (one entry per row b):
      slots, newest, positions: the row's KV slot, its newest token and that token's position p_b (= tokens cached).
      drafts: d_1..d_k (k may be 0, and differ between rows); p_b + k must lie below the cache's last position.
      temperature: the row's; uniforms: its k + 1 uniform numbers for tokens j .. j + k (j: tokens it has).
      top_k, top_p: the rows' filters (None when no row filters).
    """
    device = model.device
    widths = [len(d) + 1 for d in drafts]
    width = max(widths)
    if any(p + w > cache.max_len - 1 for p, w in zip(positions, widths)):
        raise ValueError("verify_drafts: a draft reaches the slot's last position (kept free for padding's writes)")
    ids = torch.tensor([[t, *d] + [0] * (width - 1 - len(d)) for t, d in zip(newest, drafts)], dtype=torch.long)
    starts = torch.tensor(list(positions), dtype=torch.long, device=device)
    # a short draft's padding may run past its slot's end (its writes clamp to the last position): attend no further
    extension = CacheExtension(starts, min(max(p + width for p in positions), cache.max_len))
    hidden = model(ids.to(device), cache=cache, cache_slots=torch.tensor(list(slots), device=device),
                   extension=extension)
    rows = torch.tensor([b for b, w in enumerate(widths) for _ in range(w)], device=device)
    cols = torch.tensor([i for w in widths for i in range(w)], device=device)
    logits = model.logits(hidden[rows, cols])
    per_row = lambda values, dtype: torch.tensor([v for v, w in zip(values, widths) for _ in range(w)],  # noqa: E731
                                                 dtype=dtype).to(device)
    flat_uniforms = torch.tensor([u for row in uniforms for u in row], dtype=torch.float32).to(device)
    if flat_uniforms.numel() != rows.numel():
        raise ValueError("verify_drafts: each row needs len(draft) + 1 uniform numbers")
    tokens, logprobs = sample_tokens(
        logits, per_row(temperature, torch.float32), flat_uniforms,
        top_k=None if top_k is None else per_row(top_k, torch.long),
        top_p=None if top_p is None else per_row(top_p, torch.float32), plain=plain)
    tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
    out_tokens, out_logprobs, kept, at = [], [], [], 0
    for draft, w in zip(drafts, widths):
        out_tokens.append(tokens_l[at:at + w])
        out_logprobs.append(logprobs_l[at:at + w])
        kept.append(accepted_length(draft, out_tokens[-1]))
        at += w
    return Verified(out_tokens, out_logprobs, kept)


def verify_samples(model: CausalLM, cache: KVCache, samples: Sequence, drafts: Sequence[Sequence[int]], *,
                   plain: PlainSampler | None = None) -> Verified:
    """`verify_drafts` for the engine's running samples (each with `slot`, `cached_len`, `uniforms`, `completion`
    and `request.params`): their slots, newest tokens and positions, sampling parameters and uniform numbers."""
    params = [s.request.params for s in samples]
    filtered = any(p.filtered for p in params)
    done = [len(s.completion.token_ids) for s in samples]
    return verify_drafts(
        model, cache, slots=[s.slot for s in samples], newest=[s.completion.token_ids[-1] for s in samples],
        positions=[s.cached_len for s in samples], drafts=drafts, temperature=[p.temperature for p in params],
        uniforms=[s.uniforms[n:n + len(d) + 1] for s, n, d in zip(samples, done, drafts)],
        top_k=[p.top_k for p in params] if filtered else None,
        top_p=[p.top_p for p in params] if filtered else None, plain=plain)


def draft_room(position: int, generated: int, max_new: int, max_len: int, tokens: int) -> int:
    """The longest draft a row may check: `tokens`, fewer near its budget (a step keeps at most draft + 1 tokens,
    and the row has max_new - generated left) or near its slot's end (position + draft < max_len - 1)."""
    return max(0, min(tokens, max_new - generated - 1, max_len - 2 - position))
