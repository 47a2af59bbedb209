"""The learner's view of a batch: groups stacked into padded `[N, T]` response tensors (`collate`) and DAPO's
filter of all-equal groups. How rows are cut into micro-batches and laid out is `asyncrl.learner.layout`."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from asyncrl.rewards import overlong_penalty
from asyncrl.types import Group

__all__ = ["RolloutBatch", "collate", "filter_groups"]


@dataclasses.dataclass
class RolloutBatch:
    """Groups as tensors. Row i is prompt + response, right-padded; response token j of row i sits at
    `tokens[i, prompt_lens[i] + j]` and is predicted by position `prompt_lens[i] + j − 1`."""

    tokens: Tensor  # [N, S] int64
    prompt_lens: Tensor  # [N] int64
    response_mask: Tensor  # [N, T] bool
    logp_behaviour: Tensor  # [N, T] fp32
    token_versions: Tensor  # [N, T] int64
    rewards: Tensor  # [N] fp32, shaped
    group_index: Tensor  # [N] int64: position of the row's group in the batch
    prompt_ids: list[int]  # [G] prompt id of each group
    response_lens: Tensor  # [N] int64: response tokens, environment tokens included (the mask leaves those out)
    nonfinite_logprobs: int = 0  # generated tokens left out of the mask: their behaviour log-prob was NaN or ±inf
    rollout_routes: Tensor | None = None
    """MoE routes the engine returned (`Completion.routes`), in the token grid: [N·S, layers, top_k] int16, cell
    i·S + t the experts each of the engine's layers chose for token t of row i. None: no sample brought any."""
    routed: Tensor | None = None  # [N·S] bool: the cells `rollout_routes` holds the engine's routes for

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def to(self, device: torch.device | str) -> "RolloutBatch":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), Tensor)})


def collate(groups: list[Group], *, pad_id: int = 0, max_response_length: int | None = None,
            overlong_buffer_len: int = 0, overlong_penalty_factor: float = 1.0) -> RolloutBatch:
    """Stack groups into a `RolloutBatch`; add DAPO's overlong penalty to the rewards if a buffer is set. Tokens
    whose behaviour log-prob is not finite are left out of the response mask and counted."""
    if not groups:
        raise ValueError("collate: no groups; the learner needs at least one group per step")
    rows = [(g, c) for g in groups for c in g.completions]
    for g, c in rows:
        if not (len(c.token_ids) == len(c.logprobs) == len(c.versions)):
            raise ValueError(f"collate: group {g.prompt_id} has a completion with {len(c.token_ids)} tokens, "
                             f"{len(c.logprobs)} logprobs and {len(c.versions)} versions; they must match")
        if c.loss_mask is not None and len(c.loss_mask) != len(c.token_ids):
            raise ValueError(f"collate: group {g.prompt_id} has a completion with {len(c.token_ids)} tokens and a "
                             f"loss mask of {len(c.loss_mask)}; they must match")
    n, t = len(rows), max(max(len(c.token_ids) for _, c in rows), 1)
    s = max(len(g.prompt_ids) + len(c.token_ids) for g, c in rows)
    tokens = torch.full((n, s), pad_id, dtype=torch.long)
    mask = torch.zeros(n, t, dtype=torch.bool)
    logp = torch.zeros(n, t)
    versions = torch.zeros(n, t, dtype=torch.long)
    for i, (g, c) in enumerate(rows):
        p, r = len(g.prompt_ids), len(c.token_ids)
        tokens[i, :p + r] = torch.tensor(g.prompt_ids + c.token_ids)
        mask[i, :r] = True if c.loss_mask is None else torch.tensor(c.loss_mask, dtype=torch.bool)
        logp[i, :r] = torch.tensor(c.logprobs)
        versions[i, :r] = torch.tensor(c.versions)
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    lengths = torch.tensor([len(c.token_ids) for _, c in rows])  # environment tokens included
    if overlong_buffer_len > 0:
        if max_response_length is None:
            raise ValueError("collate: overlong shaping needs max_response_length (the rollout's max_new_tokens)")
        rewards = rewards + overlong_penalty(lengths, max_response_length=max_response_length,
                                             buffer_length=overlong_buffer_len, penalty_factor=overlong_penalty_factor)
    group_index = torch.tensor([k for k, g in enumerate(groups) for _ in g.completions])
    prompt_lens = torch.tensor([len(g.prompt_ids) for g, _ in rows])
    bad = mask & ~torch.isfinite(logp)  # an engine or transport fault: never trained on, counted in the metrics
    if bad.any():
        mask, logp = mask & ~bad, torch.where(bad, torch.zeros_like(logp), logp)
    routes, routed = _route_grid([c.routes for _, c in rows], [len(g.prompt_ids) + len(c.token_ids) for g, c in rows],
                                 width=s)
    return RolloutBatch(tokens, prompt_lens, mask, logp, versions, rewards, group_index, [g.prompt_id for g in groups],
                        response_lens=lengths, nonfinite_logprobs=int(bad.sum()), rollout_routes=routes, routed=routed)


def _route_grid(routes: list, totals: list[int], *, width: int) -> tuple[Tensor | None, Tensor | None]:
    """The rows' engine routes in the token grid (see `RolloutBatch.rollout_routes`) and which cells they fill:
    a row's first min(len(routes), total − 1) positions (the engine never runs a row's last token); a row whose
    routes are not [positions, layers, top_k] like the others' raises."""
    given = [(i, torch.as_tensor(r)) for i, r in enumerate(routes) if r is not None]
    if not given:
        return None, None
    shapes = {tuple(r.shape[1:]) for _, r in given}
    if len(shapes) != 1 or any(r.dim() != 3 for _, r in given):
        seen = sorted({tuple(r.shape[1:]) for _, r in given})[:3]
        raise ValueError(f"collate: the samples' MoE routes disagree in shape (per position: {seen}); each must be "
                         "[positions, layers, top_k] of one model")
    layers, top_k = shapes.pop()
    grid = torch.zeros(len(routes) * width, layers, top_k, dtype=torch.int16)
    routed = torch.zeros(len(routes) * width, dtype=torch.bool)
    for i, r in given:
        known = min(r.shape[0], totals[i] - 1)
        grid[i * width:i * width + known] = r[:known].to(torch.int16)
        routed[i * width:i * width + known] = True
    return grid, routed


def filter_groups(groups: list[Group]) -> tuple[list[Group], list[Group]]:
    """DAPO dynamic sampling (arXiv:2503.14476): keep groups whose rewards differ (or of size 1); the
    all-equal ones carry zero advantage and zero gradient. Returns (kept, dropped)."""
    kept, dropped = [], []
    for g in groups:
        (kept if len(g.rewards) == 1 or max(g.rewards) != min(g.rewards) else dropped).append(g)
    return kept, dropped
