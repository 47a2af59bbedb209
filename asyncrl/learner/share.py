"""A trainer rank's share of a step. In a trainer group each (epoch, mini-batch) of a step's groups is dealt to the
ranks by `balance_groups` (token counts even); the deal (`Deal`) is a pure function of the groups' token and row
counts and the step's seed, so every rank computes the same one from a few numbers. Rank 0 collates the step's
batch and each rank holds only its `Share`: the rows of the groups dealt it in any mini-batch of the step.

    deal = Deal.of_step(config, step, group_tokens, group_rows, ranks)   # Deal.once(...): one mini-batch, one epoch
    share = take_share(batch, deal, rank)       # rank 0, which holds the whole batch, cuts each rank's share
    deal.updates[u][rank]                        # rank's groups in update u (epoch-major, then mini-batch)
    deal.forwarded(rank)                         # the groups whose no-grad forwards rank runs: its first epoch's

A row's no-grad forwards (π_old, π_ref, values) run once in the group, on the rank it is dealt in the first epoch.
Rows then travel in two collectives (`gather_rows`, `scatter_rows`): rank 0 gathers the forwards, computes what
needs the whole batch, and hands each rank back the rows of its share.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.config import TrainerConfig
from asyncrl.learner.batch import RolloutBatch
from asyncrl.learner.layout import balance_groups
from asyncrl.tools.seeding import derive_seed

__all__ = ["Deal", "Share", "take_share", "group_counts", "gather_rows", "scatter_rows"]


def _shuffled(config: TrainerConfig, step: int, epoch: int, num_groups: int) -> list[list[int]]:
    """Group indices per mini-batch for one epoch (shuffled with a seed derived from the step)."""
    order = list(range(num_groups))
    if config.shuffle:
        gen = torch.Generator().manual_seed(derive_seed(config.seed, step, epoch))
        order = torch.randperm(num_groups, generator=gen).tolist()
    size = config.mini_batch_size
    return [order[i:i + size] for i in range(0, num_groups, size)]


@dataclasses.dataclass(frozen=True)
class Deal:
    """Which groups each rank trains in each update of a step, and where each group's rows sit in the step's
    batch (a group's rows are contiguous, groups in order)."""

    updates: list[list[list[int]]]  # [update][rank] → groups, in mini-batch order
    first_epoch: int  # the updates of the first epoch
    group_tokens: list[int]  # [G] prompt + response tokens of each group (what the deal evens out)
    group_rows: list[int]  # [G] rows of each group

    @classmethod
    def of_step(cls, config: TrainerConfig, step: int, group_tokens: list[int], group_rows: list[int],
                ranks: int) -> "Deal":
        """`ppo_epochs` × mini-batches of `mini_batch_size` groups, each dealt over `ranks` by token count."""
        tokens = dict(enumerate(group_tokens))
        epochs = [_shuffled(config, step, epoch, len(group_tokens)) for epoch in range(config.ppo_epochs)]
        updates = [balance_groups(groups, tokens, ranks) for epoch in epochs for groups in epoch]
        return cls(updates, len(epochs[0]), list(group_tokens), list(group_rows))

    @classmethod
    def once(cls, group_tokens: list[int], group_rows: list[int], ranks: int) -> "Deal":
        """Every group in one mini-batch (a gradient of the whole batch)."""
        groups = list(range(len(group_tokens)))
        dealt = balance_groups(groups, dict(enumerate(group_tokens)), ranks)
        return cls([dealt], 1, list(group_tokens), list(group_rows))

    @property
    def ranks(self) -> int:
        return len(self.updates[0])

    def groups(self, rank: int) -> list[int]:
        """Every group `rank` trains in some update, ascending."""
        return sorted({g for update in self.updates for g in update[rank]})

    def forwarded(self, rank: int) -> list[int]:
        """The groups whose no-grad forwards `rank` runs (those of its first epoch: every group once in the group)."""
        return sorted({g for update in self.updates[:self.first_epoch] for g in update[rank]})

    @property
    def stationary(self) -> bool:
        """Each rank trains only rows it ran the forwards of (one epoch): what a forward left on a rank stays there."""
        return all(self.groups(r) == self.forwarded(r) for r in range(self.ranks))

    def held(self, rank: int) -> list[int]:
        """The step's rows `rank` holds: those of its groups, or, when it trains none, the first row (a stand-in for
        the placeholder micro-batches that keep its collectives in step with the others')."""
        return self.rows(self.groups(rank)) or [0]

    def rows(self, groups: list[int]) -> list[int]:
        """The step's rows of `groups` (ascending groups: ascending rows)."""
        starts = [0, *itertools.accumulate(self.group_rows)]
        return [r for g in groups for r in range(starts[g], starts[g + 1])]


def group_counts(batch: RolloutBatch) -> tuple[list[int], list[int]]:
    """(tokens, rows) of each group of a step's batch: the prompt + response tokens over its rows, and its rows."""
    totals = (batch.prompt_lens + batch.response_lens).tolist()
    tokens, rows = [0] * len(batch.prompt_ids), [0] * len(batch.prompt_ids)
    for g, total in zip(batch.group_index.tolist(), totals):
        tokens[g] += total
        rows[g] += 1
    return tokens, rows


@dataclasses.dataclass(frozen=True)
class Share:
    """A rank's part of a step: `batch` holds the step's `rows` (ascending), its tokens at the step's width, its
    `group_index` the step's group numbers and its `prompt_ids` every group's; `deal` is the step's deal."""

    batch: RolloutBatch
    rows: list[int]
    deal: Deal

    def positions(self, rows: list[int]) -> list[int]:
        """Where the step's `rows` (all in this share) sit in `batch`."""
        index = {r: i for i, r in enumerate(self.rows)}
        return [index[r] for r in rows]


def select_rows(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """`batch`'s `rows` as a batch of their own (same widths, group numbers and prompt ids; routes cut with them)."""
    index = torch.tensor(rows, dtype=torch.long, device=batch.tokens.device)
    per_row = {f.name: getattr(batch, f.name)[index] for f in dataclasses.fields(batch)
               if isinstance(getattr(batch, f.name), Tensor) and f.name not in ("rollout_routes", "routed")}
    routes = {}
    if batch.rollout_routes is not None:
        width = batch.tokens.shape[1]
        grid = batch.rollout_routes.view(batch.num_rows, width, *batch.rollout_routes.shape[1:])
        routes = dict(rollout_routes=grid[index.to(grid.device)].flatten(0, 1),
                      routed=batch.routed.view(batch.num_rows, width)[index.to(grid.device)].flatten())
    return dataclasses.replace(batch, **per_row, **routes)


def take_share(batch: RolloutBatch, deal: Deal, rank: int) -> Share:
    """`rank`'s share of the step's whole `batch`."""
    rows = deal.held(rank)
    return Share(select_rows(batch, rows), rows, deal)


# -------------------------------------------------------------------------------------- rows between the ranks
def _wire(group: dist.ProcessGroup, tensor: Tensor, device: torch.device) -> Tensor:
    """`tensor` as the group's backend sends it: NCCL from this rank's accelerator, gloo from the host; int16
    (MoE routes, which NCCL has no type for) as bytes."""
    out = tensor.to(device if dist.get_backend(group) == "nccl" else "cpu")
    return out.view(torch.uint8) if out.dtype == torch.int16 else out


def gather_rows(group: dist.ProcessGroup, rows: Tensor, counts: list[int], device: torch.device) -> Tensor | None:
    """Rank 0: every rank's `rows` ([counts[r], ...] on rank r, the same trailing shape everywhere) concatenated in
    rank order, on `rows`' device; None on the other ranks. One gather, padded to the largest count."""
    width = max(counts)
    padded = torch.zeros(width, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
    padded[:rows.shape[0]] = rows
    mine = _wire(group, padded, device)
    rank = dist.get_rank(group)
    parts = [torch.empty_like(mine) for _ in counts] if rank == 0 else None
    dist.gather(mine, parts, group=group, group_dst=0)
    if rank != 0:
        return None
    parts = [p.view(rows.dtype) if rows.dtype == torch.int16 else p for p in parts]
    return torch.cat([p[:n] for p, n in zip(parts, counts)]).to(rows.device)


def scatter_rows(group: dist.ProcessGroup, parts: list[Tensor] | None, counts: list[int], like: Tensor,
                 device: torch.device) -> Tensor:
    """Rank r's `parts[r]` ([counts[r], ...], given on rank 0 only), on `like`'s device and dtype, whose trailing
    shape they share. One scatter, padded to the largest count."""
    width = max(counts)
    shape = (width, *like.shape[1:])
    rank = dist.get_rank(group)
    out = _wire(group, torch.zeros(shape, dtype=like.dtype, device=like.device), device)
    wires = None
    if rank == 0:
        wires = []
        for part in parts:
            padded = torch.zeros(shape, dtype=like.dtype, device=part.device)
            padded[:part.shape[0]] = part
            wires.append(_wire(group, padded, device))
    dist.scatter(out, wires, group=group, group_src=0)
    out = out.view(like.dtype) if like.dtype == torch.int16 else out
    return out[:counts[rank]].to(like.device)
