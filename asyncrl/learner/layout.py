"""How the rows of a micro-batch are laid out for one forward pass: packed end to end into one sequence
(document-causal attention, no padding compute) or right-padded to the longest row. Either way only the
positions that predict response tokens go on to the LM head (or value head), and the results land in the
batch's `[m, T]` response layout, so the losses in `asyncrl.algos` see the same tensors on both paths.

Index tensors are built on the host from host-side lengths and reach the device in one non-blocking copy
per list of micro-batches: nothing in the micro-batch loop waits for the device.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from einops import rearrange
from torch import Tensor

from asyncrl.config import TrainerConfig
from asyncrl.policies.attention_layouts import DocumentLayout

__all__ = ["MicroBatch", "RowLengths", "split_rows", "balance_groups", "plan_micro_batches", "BucketedLayout",
           "PACK_MULTIPLE", "DOC_MULTIPLE"]

PACK_MULTIPLE = 512  # bucketed: a packed micro-batch's length is padded up to a multiple of this
DOC_MULTIPLE = 16  # bucketed: its cu_seqlens entries (documents + 1) to a multiple of this


def balance_groups(groups: list[int], tokens: dict[int, int], ranks: int) -> list[list[int]]:
    """Deal a mini-batch's `groups` to `ranks` trainer ranks so their token counts come out even: largest group
    first, each to the rank holding the fewest tokens so far (the lower rank on a tie); `tokens[g]` is group g's
    prompt + response tokens over its rows. A step waits for its slowest rank, so dealing every world-th group
    (equal group counts, ragged token counts) left the others idle; this greedy deal's largest rank exceeds
    the even share by at most one group. A pure function of its inputs: every rank computes the same deal.
    Returns each rank's groups, in mini-batch order."""
    load = [0] * ranks
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    position = {g: i for i, g in enumerate(groups)}
    for g in sorted(groups, key=lambda g: (-tokens[g], position[g])):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        dealt[rank].append(g)
        load[rank] += tokens[g]
    return [sorted(d, key=position.__getitem__) for d in dealt]


@dataclasses.dataclass(frozen=True)
class RowLengths:
    """Host-side lengths of a batch's rows (read back once per step)."""

    prompt: list[int]  # [N] prompt tokens of each row
    response: list[int]  # [N] generated tokens of each row
    width: int  # S: the batch's token tensor is [N, S]

    def total(self, row: int) -> int:
        return self.prompt[row] + self.response[row]


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One forward's rows and where their tokens go (device tensors unless noted).

    tokens [1, L] packed or [m, W] padded; positions [1, L] (None: 0..W−1 per row); documents: the packed
    sequences (None when padded). The n response tokens: `predict_at` [n] indexes the flattened hidden
    states [B·L] at the positions that predict them, `targets` [n] are their ids, and (`out_rows`,
    `out_cols`) [n] place them in the `[m, T]` response layout. `rows` [m] are the batch rows (`row_list`
    on the host); `empty` marks a placeholder that only keeps FSDP2's collectives in step (zero weight).
    `token_index` [B·L] is where each of the forward's tokens sits in the batch's flattened `[N, S]` token grid
    (a padded row's padding: its own cells past its length), so what travels with the tokens (MoE routes) is
    laid out the same way.
    """

    row_list: list[int]
    rows: Tensor
    tokens: Tensor
    positions: Tensor | None
    documents: DocumentLayout | None
    predict_at: Tensor
    targets: Tensor
    out_rows: Tensor
    out_cols: Tensor
    num_targets: int  # n, on the host
    token_index: Tensor | None = None
    empty: bool = False


def split_rows(rows: list[int], lengths: list[int], cfg: TrainerConfig) -> list[list[int]]:
    """Rows per micro-batch: by token budget (`use_dynamic_bsz`) or `micro_batch_size` rows at a time.

    Packed, a micro-batch holds rows whose lengths sum to at most the budget (first-fit over rows sorted
    longest first); padded, rows × the longest row stays within it. A row longer than the budget goes alone.
    `lengths` is indexed by row."""
    if not cfg.use_dynamic_bsz:
        return [rows[i:i + cfg.micro_batch_size] for i in range(0, len(rows), cfg.micro_batch_size)]
    budget = cfg.max_tokens_per_micro_batch
    order = sorted(rows, key=lambda r: -lengths[r])
    if not cfg.pack_sequences:
        out: list[list[int]] = []
        for r in order:
            if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
                out[-1].append(r)
            else:
                out.append([r])
        return out
    bins: list[list[int]] = []
    free: list[int] = []
    for r in order:
        fit = next((b for b, room in enumerate(free) if lengths[r] <= room), None)
        if fit is None:
            bins.append([r])
            free.append(budget - lengths[r])
        else:
            bins[fit].append(r)
            free[fit] -= lengths[r]
    return bins


class BucketedLayout(DocumentLayout):
    """A `DocumentLayout` whose flash-kernel bound `max_len` is the longest document rounded up to a power of
    two (at least 128, at most the packed length): with the packed length and the document count padded to
    buckets (`plan_micro_batches(bucketed=True)`), the compiled layer sees a few integer inputs only, and
    each of its recorded CUDA graphs is replayed by many micro-batches. Documents may be empty (padding)."""

    def __post_init__(self):
        super().__post_init__()
        longest = max(self.lengths)
        object.__setattr__(self, "max_len", min(sum(self.lengths), max(128, 1 << max(longest - 1, 0).bit_length())))


def _pad_packed(out: dict[str, np.ndarray], seq: np.ndarray) -> np.ndarray:
    """Pad a packed micro-batch's index arrays in place to bucketed shapes: one padding document (copies of
    the first token, positions 0, 1, ...) fills the length up to a multiple of `PACK_MULTIPLE`, and
    `cu_seqlens` repeats its end (empty documents) up to a multiple of `DOC_MULTIPLE` entries. Nothing
    predicts from the padding, so losses and gradients are unchanged. Returns the documents' lengths."""
    total = int(seq.sum())
    pad = -total % PACK_MULTIPLE
    lengths = np.concatenate([seq, [pad]]) if pad else seq
    lengths = np.concatenate([lengths, np.zeros(-(len(lengths) + 1) % DOC_MULTIPLE, dtype=np.int64)])
    out["token_index"] = np.concatenate([out["token_index"], np.full(pad, out["token_index"][0])])
    out["positions"] = np.concatenate([out["positions"], np.arange(pad)])
    out["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)])
    return lengths


def _segments(lengths: np.ndarray) -> np.ndarray:
    """0..n−1 for each length n, concatenated: [2, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _host_indices(rows: list[int], lengths: RowLengths, packed: bool, bucketed: bool = False) -> dict[str, Tensor]:
    """The index tensors of one micro-batch, built on the host (int64; numpy: torch's CPU repeat_interleave
    took ~8 ms a call here, longer than the GPU's work on the micro-batch). Packed and `bucketed`: padded
    to bucketed shapes (`_pad_packed`), the documents' lengths under "lengths"."""
    prompt = np.array([lengths.prompt[r] for r in rows], dtype=np.int64)
    response = np.array([lengths.response[r] for r in rows], dtype=np.int64)
    seq = prompt + response
    row_start = np.array(rows, dtype=np.int64) * lengths.width  # each row's offset in the flattened [N, S] tokens
    if packed:
        span = seq
        starts = np.cumsum(seq) - seq  # where each row begins in the packed sequence
    else:
        span = np.full_like(seq, seq.max())
        starts = np.arange(len(rows)) * span[0]
    within = _segments(span)
    response_at = _segments(response)
    out = {
        "token_index": np.repeat(row_start, span) + within,
        "predict_at": np.repeat(starts + prompt - 1, response) + response_at,
        "target_index": np.repeat(row_start + prompt, response) + response_at,
        "out_rows": np.repeat(np.arange(len(rows)), response),
        "out_cols": response_at,
        "rows": np.array(rows, dtype=np.int64),
    }
    if packed:
        out["positions"] = within
        out["cu_seqlens"] = np.concatenate([[0], np.cumsum(seq)])
        out["lengths"] = _pad_packed(out, seq) if bucketed else seq
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)) for k, v in out.items()}


def _to_device(host: list[dict[str, Tensor]], device: torch.device) -> list[dict[str, Tensor]]:
    """Every tensor of every dict to `device` in one copy (pinned and non-blocking on CUDA)."""
    flat = [t for d in host for t in d.values()]
    if not flat:
        return []
    joined = torch.cat(flat)
    if device.type == "cuda":
        joined = joined.pin_memory().to(device, non_blocking=True)
    else:
        joined = joined.to(device)
    parts = iter(joined.split([t.numel() for t in flat]))
    return [{k: next(parts) for k in d} for d in host]


def plan_micro_batches(tokens: Tensor, micro_rows: list[list[int]], lengths: RowLengths, *,
                       packed: bool, bucketed: bool = False) -> list[MicroBatch]:
    """Lay out each list of rows of `micro_rows` for a forward over `tokens` [N, S] (an empty list gives
    an `empty` placeholder over row 0). `packed`: one sequence with document-causal attention; `bucketed`
    (packed only): padded to bucketed shapes for replayed CUDA graphs (`BucketedLayout`)."""
    chosen = [rows or [0] for rows in micro_rows]
    host = [_host_indices(rows, lengths, packed, bucketed and packed) for rows in chosen]
    docs = [tuple(int(n) for n in idx.pop("lengths")) for idx in host] if packed else [None] * len(host)
    layout = BucketedLayout if bucketed else DocumentLayout
    flat_tokens = rearrange(tokens, "n s -> (n s)")  # what "token_index" and "target_index" index
    out = []
    for rows, given, idx, seq in zip(chosen, micro_rows, _to_device(host, tokens.device), docs):
        # packed: the rows' sequences end to end, one row of L tokens; else m rows padded to the longest
        rows_of, axes = ("l -> 1 l", {"l": sum(seq)}) if packed else (
            "(m s) -> m s", {"m": len(rows), "s": max(lengths.total(r) for r in rows)})
        out.append(MicroBatch(
            row_list=rows, rows=idx["rows"], tokens=rearrange(flat_tokens[idx["token_index"]], rows_of, **axes),
            positions=rearrange(idx["positions"], rows_of, **axes) if packed else None,
            documents=layout(seq, idx["cu_seqlens"].to(torch.int32)) if packed else None,
            predict_at=idx["predict_at"], targets=flat_tokens[idx["target_index"]], out_rows=idx["out_rows"],
            out_cols=idx["out_cols"], num_targets=sum(lengths.response[r] for r in rows),
            token_index=idx["token_index"], empty=not given))
    return out
