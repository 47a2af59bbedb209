"""What the rest of asyncrl needs from a generation engine.

The embedded `Engine` implements it; a vLLM backend is a thin adapter mapping these calls onto vLLM's
`add_request` / `step`, `pause_generation` / `resume_generation`, `abort`, native weight transfer (or
`collective_rpc` + `load_weights`) and `sleep` / `wake_up`. Code outside `asyncrl.policies` types its
engine as `RolloutEngine`, never as a concrete class.
"""

from __future__ import annotations

from typing import Iterable, Literal, Protocol, runtime_checkable

from torch import Tensor

from asyncrl.policies.sampling import SamplingParams
from asyncrl.types import GenerationOutput

__all__ = ["RolloutEngine"]


@runtime_checkable
class RolloutEngine(Protocol):
    version: int
    """Weight version of the loaded weights; stamped on every token sampled with them."""

    def add_request(self, prompt_ids: list[int], params: SamplingParams = ..., request_id: str | None = None) -> str:
        """Queue a prompt (n samples per `params.n`); raise ValueError and queue nothing on bad input."""

    def step(self) -> list[GenerationOutput]:
        """Advance generation by one step; return the requests that finished."""

    def has_unfinished(self) -> bool: ...

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = ...
                 ) -> list[GenerationOutput]: ...

    def pause(self, mode: Literal["keep", "abort", "wait"] = "keep") -> list[GenerationOutput]: ...

    def resume(self) -> None: ...

    @property
    def is_paused(self) -> bool: ...

    def abort(self, request_ids: Iterable[str]) -> list[GenerationOutput]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int | None = None, *,
                       kv: Literal["keep", "recompute"] = "keep") -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...
