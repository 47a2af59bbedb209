"""What both rollout engines share: the request table, the RL controls' states and the version on every token.

`EngineControl` is the base of the embedded `Engine` and of `VLLMEngine`. It owns the state the controls act
on; the engines read the pause and sleep flags and the request table but never write them, and set `version`
only when an update is whole:

  requests   unfinished requests by id ("req-<n>" when the caller gives none), added by add_request() after
             `check_request`, removed when they finish or are aborted
  pause      "keep": step() does nothing; running requests keep their place (and their K/V) until resume().
             "abort": every request ends now and its partial output is returned.
             "wait": drain: nothing new starts, running requests go on, and the step in which the last one
             ends pauses the engine (with nothing running, it pauses at once).
  sleep      step() does nothing from sleep() to wake_up(), whatever the pause state
  versions   `version` is the loaded weights' version; `Sample.append` stamps it on every token it adds
  updates    update_weights() checks the kv mode and every name and shape before taking the lock

Every control takes the lock step() holds, so it acts at a step boundary and may be called from another
thread (an RPC handler) while a driver loop calls step(). An engine says how its generation runs:

  _new_request / _enqueue          build a request of its own type / hand it to its scheduler
  _advance                         one generation step; the requests that finished in it
  num_running                      sequences generating now (a drain ends when it reaches 0)
  _withdraw                        take an aborted request's samples out of generation
  _release_held                    start what was held back while it could not admit (resume, wake-up)
  _load_weights                    apply one checked bucket of an update, setting `version` with the last
  _free_memory / _restore_memory   what sleep() releases and wake_up() brings back
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import threading
from typing import Generic, Iterable, Literal, Mapping, Sequence, TypeVar

from torch import Tensor

from asyncrl.config.run_config import LORA_TARGETS
from asyncrl.policies.engine_adapters import check_named_tensors
from asyncrl.policies.protocol import check_request, run_to_completion
from asyncrl.policies.sampling import SamplingParams
from asyncrl.types import Completion, GenerationOutput

__all__ = ["EngineControl", "PauseMode", "Request", "Sample"]

PauseMode = Literal["keep", "abort", "wait"]
KVMode = Literal["keep", "recompute"]


@dataclasses.dataclass(eq=False)
class Sample:
    """One of a request's n samples: its place among them and what it has generated so far."""

    index: int
    completion: Completion = dataclasses.field(default_factory=lambda: Completion([], [], []))

    def append(self, token_ids: list[int], logprobs: Iterable[float], version: int) -> None:
        """Add sampled tokens with their behaviour log-probs, each stamped with the weight version that sampled it."""
        completion = self.completion
        completion.token_ids.extend(token_ids)
        completion.logprobs.extend(logprobs)
        completion.versions.extend([version] * len(token_ids))


@dataclasses.dataclass(eq=False)
class Request(abc.ABC):
    """A queued prompt and its n samples; each engine's own kind says how much of its prompt came from cache."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    """Tokens a sample may generate: max_new_tokens, capped by what max_len leaves after the prompt."""
    stop_ids: frozenset[int]
    samples: list[Sample] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.completion.finished for s in self.samples)

    @property
    @abc.abstractmethod
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens whose K/V was reused rather than prefilled."""

    def output(self) -> GenerationOutput:
        return GenerationOutput.snapshot(self.request_id, self.prompt_ids, [s.completion for s in self.samples],
                                         cached_prompt_tokens=self.cached_prompt_tokens)


R = TypeVar("R", bound=Request)


class EngineControl(abc.ABC, Generic[R]):
    """Requests, pause / resume / abort, sleep / wake_up and weight-update checks of a `RolloutEngine`."""

    def __init__(self, *, version: int, vocab_size: int, max_len: int, max_slots: int,
                 eos_token_ids: Iterable[int], weight_shapes: Mapping[str, tuple[int, ...]], lora_rank: int,
                 lora_targets: Sequence[str] = LORA_TARGETS):
        self.version = version
        """Weight version of the loaded weights; stamped on every token sampled with them."""
        self.vocab_size, self.max_len, self.max_slots = vocab_size, max_len, max_slots
        self.eos_token_ids = frozenset(eos_token_ids)
        self._weight_shapes = dict(weight_shapes)
        self._lora_rank = lora_rank
        self._lora_targets = tuple(lora_targets)
        self._requests: dict[str, R] = {}
        self._lock = threading.RLock()
        self._paused = self._draining = self._asleep = False
        self._ids = itertools.count()

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None, *, sessions: Sequence[str] | None = None) -> str:
        """Queue a prompt (n samples per `params.n`); returns its request id. Raises ValueError (and queues
        nothing) on bad input. sessions: one name per sample (`RolloutEngine.add_request`)."""
        check_request(prompt_ids, params, vocab_size=self.vocab_size, max_len=self.max_len,
                      max_slots=self.max_slots, sessions=sessions)
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests:
                raise ValueError(f"add_request: request_id {rid!r} is already in use")
            max_new = min(params.max_new_tokens, self.max_len - len(prompt_ids))
            request = self._new_request(rid, list(prompt_ids), params, max_new, params.stop_ids(self.eos_token_ids),
                                        sessions)
            self._requests[rid] = request
            self._enqueue(request)
            return rid

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams()
                 ) -> list[GenerationOutput]:
        """Run prompts to completion and return their outputs in order (blocking convenience)."""
        return run_to_completion(self, prompts, params)

    # ---------------------------------------------------------------- the step
    @property
    def _admitting(self) -> bool:
        """New work may start: not paused, draining or asleep."""
        return not (self._paused or self._draining or self._asleep)

    def step(self) -> list[GenerationOutput]:
        """Advance generation by one step (none while paused or asleep); return the requests that finished."""
        with self._lock:
            if self._paused or self._asleep:
                return []
            finished = self._advance()
            if self._draining and not self.num_running:
                self._paused, self._draining = True, False
            return [self._pop(r) for r in finished]

    def _pop(self, request: R) -> GenerationOutput:
        del self._requests[request.request_id]
        return request.output()

    # ---------------------------------------------------------------- RL controls
    def abort(self, request_ids: Iterable[str]) -> list[GenerationOutput]:
        """End these requests now; return their partial outputs (unknown ids are ignored)."""
        with self._lock:
            outs = []
            for rid in request_ids:
                request = self._requests.get(rid)
                if request is None:
                    continue
                self._withdraw(request)
                for sample in request.samples:
                    if not sample.completion.finished:
                        sample.completion.finish_reason = "abort"
                outs.append(self._pop(request))
            return outs

    @property
    def is_paused(self) -> bool:
        return self._paused

    def pause(self, mode: PauseMode = "keep") -> list[GenerationOutput]:
        """Pause at a step boundary (the modes: module docstring). Returns the partial outputs for mode="abort",
        else []."""
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause: mode={mode!r} is not 'keep', 'abort' or 'wait'")
        with self._lock:
            if mode == "wait":
                self._draining = bool(self.num_running)
                self._paused = not self.num_running
                return []
            outs = self.abort(list(self._requests)) if mode == "abort" else []
            self._paused, self._draining = True, False
            return outs

    def resume(self) -> None:
        with self._lock:
            self._paused = self._draining = False
            if self._admitting:
                self._release_held()

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int | None = None, *,
                       kv: KVMode = "keep") -> None:
        """Load weights by Hugging Face name (all names and shapes are checked before anything is loaded).

        `version=None` loads a partial bucket without changing the version; pass the new version with the last
        bucket: tokens sampled afterwards carry it. kv="recompute" recomputes the running sequences' K/V under the
        new weights; "keep" lets them go on over K/V computed with older weights. An engine built with
        lora_rank > 0 also takes LoRA adapters (`asyncrl.policies.engine_adapters`)."""
        if kv not in ("keep", "recompute"):
            raise ValueError(f"update_weights: kv={kv!r} is not 'keep' or 'recompute'")
        items = list(named_tensors)
        check_named_tensors(items, self._weight_shapes, lora_rank=self._lora_rank, lora_targets=self._lora_targets)
        with self._lock:
            self._load_weights(items, version, kv)

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    def sleep(self) -> None:
        """Free the memory generation holds (the KV cache at least) until wake_up(); running requests keep their
        tokens."""
        with self._lock:
            self._free_memory()
            self._asleep = True

    def wake_up(self) -> None:
        """Bring back what sleep() freed; running requests go on once their K/V is recomputed."""
        with self._lock:
            self._restore_memory()
            self._asleep = False
            if self._admitting:
                self._release_held()

    # ---------------------------------------------------------------- what each engine supplies
    @property
    @abc.abstractmethod
    def num_running(self) -> int:
        """Sequences generating now (a drain ends when none are left)."""

    @abc.abstractmethod
    def _new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_new: int,
                     stop_ids: frozenset[int], sessions: Sequence[str] | None) -> R:
        """A checked request with its n samples, in the engine's own request type."""

    @abc.abstractmethod
    def _enqueue(self, request: R) -> None:
        """Hand a new request to the scheduler (or hold it back while not `_admitting`)."""

    @abc.abstractmethod
    def _advance(self) -> list[R]:
        """One generation step; the requests all of whose samples finished in it."""

    @abc.abstractmethod
    def _withdraw(self, request: R) -> None:
        """Take an aborted request's samples out of generation (their tokens so far stay with them)."""

    def _release_held(self) -> None:
        """Start what was held back while not `_admitting` (nothing here: an engine that admits waiting
        requests in `_advance` holds nothing back)."""

    @abc.abstractmethod
    def _load_weights(self, items: list[tuple[str, Tensor]], version: int | None, kv: KVMode) -> None:
        """Apply one checked bucket of an update; with a version, the update is whole: set `self.version`."""

    @abc.abstractmethod
    def _free_memory(self) -> None:
        """What sleep() releases."""

    @abc.abstractmethod
    def _restore_memory(self) -> None:
        """What wake_up() brings back, the running sequences' K/V included."""
