"""What the rest of asyncrl needs from a generation engine.

Two engines implement it: the embedded `Engine` and `VLLMEngine` (`asyncrl.policies.vllm_engine`, vLLM's
`LLMEngine` driven step by step). Code that is handed an engine (the rollout agent, the run's assembly, an
`EngineFactory`) types it as `RolloutEngine`, so either backend serves; only code that builds the embedded
engine itself names `Engine` (`asyncrl.evaluate`). `check_request` is the input check both make before
queueing anything.
"""

from __future__ import annotations

from typing import Iterable, Literal, Protocol, Sequence, runtime_checkable

from torch import Tensor

from asyncrl.policies.sampling import SamplingParams
from asyncrl.types import GenerationOutput

__all__ = ["RolloutEngine", "check_request", "run_to_completion"]


@runtime_checkable
class RolloutEngine(Protocol):
    version: int
    """Weight version of the loaded weights; stamped on every token sampled with them."""
    backend: str
    """Which engine this is, for logs ('asyncrl', 'vLLM')."""

    def add_request(self, prompt_ids: list[int], params: SamplingParams = ..., request_id: str | None = None, *,
                    sessions: Sequence[str] | None = None) -> str:
        """Queue a prompt (n samples per `params.n`); raise ValueError and queue nothing on bad input.

        sessions: a name per sample for multi-turn episodes: a later request of the same session whose prompt
        extends the sample's sequence reuses its K/V (the embedded engine holds its slot; vLLM's prefix
        cache finds it), so a turn prefills only its new tokens."""

    def end_sessions(self, names: Iterable[str]) -> None:
        """The episodes of these sessions are over: free what is kept for them."""

    def step(self) -> list[GenerationOutput]:
        """Advance generation by one step; return the requests that finished."""

    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int:
        """Sequences generating now."""

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = ...
                 ) -> list[GenerationOutput]: ...

    def pause(self, mode: Literal["keep", "abort", "wait"] = "keep") -> list[GenerationOutput]: ...

    def resume(self) -> None: ...

    @property
    def is_paused(self) -> bool: ...

    @property
    def is_sleeping(self) -> bool: ...

    def abort(self, request_ids: Iterable[str]) -> list[GenerationOutput]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int | None = None, *,
                       kv: Literal["keep", "recompute"] = "keep") -> None:
        """Load weights by Hugging Face name (names and shapes checked before anything is loaded); tokens sampled
        afterwards carry `version` (None: a partial bucket; the version comes with the last one). kv: keep the
        running sequences' K/V or recompute it under the new weights.

        An engine built for LoRA (EngineConfig.lora_rank > 0) also takes adapter names,
        `model.layers.0.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] (fp32, as the
        learner trains them), and serves each adapted layer as W_base + s·B·A, s = lora_alpha / lora_rank,
        recomputed from the base on every update; `<layer>.weight` is that layer's new base. A layer's two
        factors may come in different buckets; a version given while one waits for its pair is refused. An
        engine without adapters refuses adapter names (`asyncrl.policies.engine_adapters`)."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


def check_request(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_len: int,
                  max_slots: int, sessions: Sequence[str] | None = None) -> None:
    """Raise ValueError naming what is wrong with a request an engine of this capacity was asked to queue."""
    if sessions is not None and len(sessions) != params.n:
        raise ValueError(f"add_request: {len(sessions)} session names for n={params.n} samples; give one per sample")
    if len(prompt_ids) == 0:
        raise ValueError("add_request: the prompt is empty; pass at least one token id")
    if len(prompt_ids) >= max_len:
        raise ValueError(f"add_request: the prompt has {len(prompt_ids)} tokens but the engine's max_len is "
                         f"{max_len}; shorten the prompt or raise max_len")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"add_request: prompt token ids must lie in [0, {vocab_size}), got "
                         f"[{min(prompt_ids)}, {max(prompt_ids)}]")
    params.validate(vocab_size)
    if params.n > max_slots:
        raise ValueError(f"add_request: n={params.n} samples exceed the engine's max_slots={max_slots}; they "
                         "could never run together")


def run_to_completion(engine: RolloutEngine, prompts: list[list[int]],
                      params: SamplingParams | list[SamplingParams]) -> list[GenerationOutput]:
    """Queue the prompts, step until all have finished, return their outputs in order (`generate`)."""
    if engine.is_paused or engine.is_sleeping:
        raise ValueError("generate: the engine is paused or asleep; call resume() / wake_up() first")
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    done: dict[str, GenerationOutput] = {}
    while len(done) < len(ids):
        for out in engine.step():
            done[out.request_id] = out
    return [done[i] for i in ids]
