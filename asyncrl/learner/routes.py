"""MoE routes that travel with their tokens: a batch's routes live in the batch's token grid, one `[routers, top_k]`
cell per token of the flattened `[N, S]` tokens, so any micro-batch layout (packed or padded, any split of rows,
any rank's share) reads and writes them through its `token_index`, exactly as it gathers its tokens.

    grid = empty_routes(num_rows, width, routers=2, top_k=2, device)     # [N·S, routers, top_k] int16
    store_routes(grid, micro, recorded)                                  # a forward's routes [B·L, routers, k]
    routes = micro_routes(grid, micro)                                   # the same tokens' routes, another layout

Cells no forward wrote (padding) hold experts 0..k−1: any valid choice, for tokens no loss reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.learner.layout import MicroBatch, RowLengths

__all__ = ["empty_routes", "store_routes", "micro_routes", "real_tokens"]


def empty_routes(num_rows: int, width: int, *, routers: int, top_k: int, device: torch.device | str) -> Tensor:
    """A batch's route grid: [num_rows · width, routers, top_k] int16 (expert ids; a quarter of int64's memory),
    every cell experts 0..top_k−1."""
    return torch.arange(top_k, device=device, dtype=torch.int16).expand(num_rows * width, routers, top_k).clone()


def store_routes(grid: Tensor, micro: MicroBatch, routes: Tensor) -> None:
    """Write a forward's routes [B·L, routers, top_k] (the micro-batch's tokens in the order it ran them) into
    `grid` at the tokens' cells. Padded rows' padding lands in their own cells past each row's length."""
    if micro.token_index is None or routes.shape[0] != micro.token_index.numel():
        raise ValueError(f"routes for {routes.shape[0]} tokens, but the micro-batch ran "
                         f"{None if micro.token_index is None else micro.token_index.numel()}")
    grid[micro.token_index.to(grid.device)] = routes.to(grid.device, grid.dtype)


def micro_routes(grid: Tensor, micro: MicroBatch) -> Tensor:
    """The routes of a micro-batch's tokens [B·L, routers, top_k], in the order its forward runs them (of any
    per-token grid [N·S, ...]: the same cells)."""
    if micro.token_index is None:
        raise ValueError("the micro-batch has no token_index (a layout that cannot carry routes)")
    return grid[micro.token_index.to(grid.device)]


def real_tokens(micro: MicroBatch, lengths: RowLengths) -> Tensor:
    """Which of a micro-batch's forward tokens are a row's own (bool [B·L]): not a padded row's padding."""
    if micro.token_index is None:
        raise ValueError("the micro-batch has no token_index (a layout that cannot carry routes)")
    totals = torch.tensor([lengths.total(r) for r in range(len(lengths.prompt))], device=micro.token_index.device)
    return micro.token_index % lengths.width < totals[micro.token_index // lengths.width]
