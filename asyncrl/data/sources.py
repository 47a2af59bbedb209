"""Prompt sources: an endless, deterministic, checkpointable stream of `Prompt`s.

Epoch e visits every row once in an order shuffled with `seed + e`; `state_dict()` is just the cursor, so
a resumed run continues with exactly the prompt it would have seen next.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from asyncrl.types import Prompt

__all__ = ["PromptSource", "DatasetSource", "GeneratedSource"]


@runtime_checkable
class PromptSource(Protocol):
    def next(self) -> Prompt: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class DatasetSource:
    """Cycle through a fixed list of prompts, reshuffled every epoch."""

    def __init__(self, prompts: Sequence[Prompt], *, seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise ValueError("DatasetSource: the dataset is empty; check the data path and the length filter")
        self.prompts, self.seed, self.shuffle = list(prompts), seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.prompts)))
        return torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def next(self) -> Prompt:
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._make_order()
        prompt = self.prompts[self._order[self.position]]
        self.position += 1
        return prompt

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved cursor; a position past the end (the data shrank: a resume with
        --resume-allow-data-change) is clamped to it, so the next prompt starts the next epoch."""
        self.epoch, self.position = int(state["epoch"]), min(int(state["position"]), len(self.prompts))
        self._order = self._make_order()


class GeneratedSource:
    """Prompts made on demand by `make(index)` (procedural tasks): prompt k is always the same."""

    def __init__(self, make: Callable[[int], Prompt]):
        self.make, self.index = make, 0

    def next(self) -> Prompt:
        prompt = self.make(self.index)
        self.index += 1
        return prompt

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])
