"""The embedded engine's requests and samples (`asyncrl.policies.engine.Engine` keeps its queue and rows of these)."""

from __future__ import annotations

import dataclasses

from asyncrl.policies.engine_control import Request, Sample

__all__ = ["EngineRequest", "EngineSample"]


@dataclasses.dataclass(eq=False)
class EngineSample(Sample):
    """A sample of a running request: its uniforms (one per token it may draw) and the KV slot it decodes in."""

    _: dataclasses.KW_ONLY
    request: "EngineRequest"
    uniforms: list[float]
    slot: int = -1

    @property
    def cached_len(self) -> int:
        """Positions of this sequence already in the KV cache (all but the newest token)."""
        return len(self.request.prompt_ids) + len(self.completion.token_ids) - 1


@dataclasses.dataclass(eq=False)
class EngineRequest(Request):
    """A request as the embedded engine keeps it: its samples, its sessions and where its K/V lives."""

    samples: list[EngineSample] = dataclasses.field(default_factory=list)
    sessions: tuple[str, ...] | None = None
    """Sample i's K/V is held under sessions[i] when it finishes (and a held one is continued at admission)."""
    cached: int = 0
    """Prompt positions whose K/V a held session already has (set at admission; 0: prefill it whole)."""
    draft_key: int = 0
    """The prompt's pool of drafts (a hash of its tokens; set when the engine speculates)."""
    prompt_slot: int = -1
    """Where its prompt's K/V lives in a `SharedPromptKVCache` (set at admission)."""

    @property
    def cached_prompt_tokens(self) -> int:
        return self.cached
