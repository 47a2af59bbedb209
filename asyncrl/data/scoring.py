"""Scoring completions: the reward function of each prompt's data source, sync or async, with failures counted.

    scorer = Scorer(RewardTable.from_specs(["my_reward.py:score"]), tokenizer=tok)
    group = scorer.score_group(prompt, completions)        # ScoredGroup: rewards, texts, extras, errors, timeouts
    future = scorer.submit_group(prompt, completions)      # at once for async rewards; poll future.done()
    reward, text = scorer.score(prompt, completion)        # one completion

`rewards` is a `RewardTable` (plug-ins over the built-ins, `asyncrl.rewards.plugin`) or a plain mapping
from `data_source` to a `(response_text, ground_truth) -> float` function. Without a tokenizer the
response text is the token ids joined by spaces ("5 17 2"), which is what token-level toy tasks score.

Async rewards run on one event loop in a daemon thread of the scorer (started on first use, stopped by
`close()`): a group's completions are scored concurrently, at most `max_concurrency` calls at once over all
groups, each call cut off after `timeout_s` seconds (it then scores 0 and counts in `timeouts`); a coroutine
that blocks the loop is named in the log (`BackgroundLoop`). Sync rewards loaded from a `--reward.fn` spec
run in worker processes when the scorer is given `workers` (a run's agents are): a call past `timeout_s` is
cut off by killing its worker, scores 0, counts in `timeouts`, and is named once in the log, while the agent
goes on. Built-in rewards (bounded, eval-free) and functions passed as Python objects run in the calling
thread.

A reward that raises, or returns NaN, inf or something that is not a number, scores 0 and counts in
`errors` (the run logs `reward/errors`; `error_examples` keeps the first few distinct messages); with
`strict=True` it raises `RewardError` instead, which stops the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import logging
from typing import Any, Callable, Mapping, Protocol, Sequence

from asyncrl.tools.background_loop import BackgroundLoop
from asyncrl.rewards.plugin import (
    RewardFunction, RewardTable, RewardValueError, load_reward, normalize_result, parse_reward_spec,
)
from asyncrl.types import Completion, Prompt

__all__ = ["RewardFn", "RewardError", "ScoredGroup", "Scorer", "Workers", "decode_ids", "call_reward"]

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
MAX_ERROR_EXAMPLES = 5


class Workers(Protocol):
    """Where calls that may hang run (`asyncrl.rpc.worker_pool.WorkerPool`): `fn(state, *args)` in another
    process, cut off after `timeout_s` (the future then raises a TimeoutError)."""

    def submit(self, fn: Callable, args: tuple, *, timeout_s: float, pin: str | None = None
               ) -> concurrent.futures.Future: ...


def call_reward(state: dict, spec: str, text: str, prompt: Prompt) -> Any:
    """In a worker process: the raw result of the `--reward.fn` item `spec` for `text` (loaded once per worker)."""
    loaded = state.setdefault("rewards", {})
    if spec not in loaded:
        loaded[spec] = load_reward(parse_reward_spec(spec)[1])
    return loaded[spec].call(text, prompt)


def decode_ids(token_ids: list[int]) -> str:
    """Token ids as the text that token-level rewards score: the ids joined by spaces."""
    return " ".join(str(t) for t in token_ids)


class RewardError(RuntimeError):
    """A reward function raised or returned no finite number while the scorer is strict (one-line message
    naming the function, data_source, row and the original error)."""


@dataclasses.dataclass
class ScoredGroup:
    """The scores of one prompt's completions."""

    rewards: list[float]
    """One per completion; 0 where the reward failed or timed out."""
    texts: list[str]
    """The decoded responses that were scored."""
    extras: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    """Extra numeric entries of dict results: per key, the values of the completions that returned it."""
    errors: int = 0
    """Completions whose reward raised or returned no finite number."""
    timeouts: int = 0
    """Completions whose (async) reward took longer than `timeout_s`."""


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What one reward call gave: its raw result, the exception it raised, or a timeout."""

    raw: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _failure(fn: RewardFunction, prompt: Prompt, error: BaseException) -> str:
    if isinstance(error, RewardValueError):
        return _one_line(str(error))
    kind = getattr(error, "type_name", type(error).__name__)  # raised in a worker process: its own type's name
    return _one_line(f"{fn.name} raised {kind}: {error} for data_source={prompt.data_source!r}, row {prompt.index}")


def _outcome_of(future: concurrent.futures.Future) -> _Outcome:
    """A worker call's outcome (its future is done)."""
    error = future.exception()
    if isinstance(error, TimeoutError):
        return _Outcome(timed_out=True)
    return _Outcome(error=error) if error is not None else _Outcome(raw=future.result())


def _when_all(futures: Sequence[concurrent.futures.Future], then: Callable[[], None]) -> None:
    """Call `then()` once, when every one of `futures` is done (on the thread that completes the last)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for future in futures:
        future.add_done_callback(one_done)


def _fold_outcomes(fn: RewardFunction, prompt: Prompt, texts: list[str],
                   outcomes: Sequence[_Outcome]) -> tuple[ScoredGroup, list[tuple[str, str, BaseException]]]:
    """The ScoredGroup of one prompt's reward calls, and its failures as (dedup key, message, exception)."""
    group = ScoredGroup(rewards=[], texts=texts)
    failures = []
    for outcome in outcomes:
        error = outcome.error
        if outcome.timed_out:
            group.timeouts += 1
            group.rewards.append(0.0)
            continue
        if error is None:
            try:
                result = normalize_result(outcome.raw, fn_name=fn.name, data_source=prompt.data_source,
                                          index=prompt.index)
            except RewardValueError as err:
                error = err
        if error is not None:
            group.errors += 1
            group.rewards.append(0.0)
            message = _failure(fn, prompt, error)
            key = f"{fn.name}|{type(error).__name__}|{error}".replace(f", row {prompt.index}", "")  # one per kind
            failures.append((key, message, error))
            continue
        group.rewards.append(result.score)
        for name, value in result.extras.items():
            group.extras.setdefault(name, []).append(value)
    return group, failures


class Scorer:
    """Scores completions with the reward function of their prompt's data source (see the module docstring).

    Args:
      rewards: a RewardTable, or data_source -> `(response_text, ground_truth)` function (or RewardFunction).
      tokenizer: decodes completions (None: token ids joined by spaces).
      default: the data source whose reward scores data sources that have none.
      strict: a failing reward raises RewardError instead of scoring 0.
      timeout_s: longest a reward call may take (async, or sync in `workers`; it then scores 0 and counts as
        a timeout).
      max_concurrency: async reward calls in flight at once, over all groups.
      workers: where sync `--reward.fn` plug-ins run (None: in the calling thread, where they cannot be cut off).
    """

    def __init__(self, rewards: RewardTable | Mapping[str, RewardFn | RewardFunction], *, tokenizer=None,
                 default: str | None = None, strict: bool = False, timeout_s: float = 60.0,
                 max_concurrency: int = 16, workers: Workers | None = None):
        table = rewards if isinstance(rewards, RewardTable) else RewardTable.from_specs((), builtins=rewards)
        if not (table.plugins or table.default_plugin or table.builtins):
            raise ValueError("Scorer: no reward functions given; map each data_source to a reward function")
        if not timeout_s > 0:
            raise ValueError(f"Scorer: timeout_s={timeout_s} must be > 0 seconds")
        if max_concurrency < 1:
            raise ValueError(f"Scorer: max_concurrency={max_concurrency} must be >= 1")
        self.table, self.tokenizer, self.default, self.strict = table, tokenizer, default, strict
        self.timeout_s, self.max_concurrency, self.workers = timeout_s, max_concurrency, workers
        self._named_timeouts: set[str] = set()  # reward functions whose timeout the log has named
        self._lock = threading.Lock()
        self._loop: BackgroundLoop | None = None
        self._errors = self._timeouts = self._calls = 0
        self._examples: dict[str, str] = {}

    # ------------------------------------------------------------------------------------------- counters
    @property
    def errors(self) -> int:
        """Reward calls so far that raised or returned no finite number."""
        return self._errors

    @property
    def timeouts(self) -> int:
        """Async reward calls so far that took longer than `timeout_s`."""
        return self._timeouts

    @property
    def calls(self) -> int:
        """Reward calls so far (one per scored completion)."""
        return self._calls

    @property
    def error_examples(self) -> list[str]:
        """The first few distinct error messages (at most MAX_ERROR_EXAMPLES; `errors` is the total)."""
        with self._lock:
            return list(self._examples.values())

    # ------------------------------------------------------------------------------------------- scoring
    def text(self, completion: Completion) -> str:
        """The response text the reward sees."""
        if self.tokenizer is None:
            return decode_ids(completion.token_ids)
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    def reward_for(self, prompt: Prompt) -> RewardFunction:
        """The reward function of `prompt`'s data source (or of `default`); ValueError when there is none."""
        fn = self.table.get(prompt.data_source)
        if fn is None and self.default is not None:
            fn = self.table.get(self.default)
        return fn if fn is not None else self.table.resolve(prompt.data_source, row=prompt.index)

    def submit_group(self, prompt: Prompt, completions: Sequence[Completion]
                     ) -> concurrent.futures.Future[ScoredGroup]:
        """Start scoring one prompt's completions: a future of the ScoredGroup, already done for sync rewards
        (its `.result()` raises RewardError on a failure when strict).

        Raises:
          ValueError: no reward function for the prompt's data source.
        """
        fn = self.reward_for(prompt)
        texts = [self.text(c) for c in completions]
        if fn.is_async:
            loop = self._async_loop()
            return loop.submit(self._score_async(fn, prompt, texts, loop.semaphore))
        if self.workers is not None and fn.spec:
            return self._score_in_workers(fn, prompt, texts)
        future: concurrent.futures.Future[ScoredGroup] = concurrent.futures.Future()
        try:
            future.set_result(self._finish(fn, prompt, texts, [_call(fn, t, prompt) for t in texts]))
        except RewardError as err:
            future.set_exception(err)
        return future

    def score_group(self, prompt: Prompt, completions: Sequence[Completion]) -> ScoredGroup:
        """Score one prompt's completions (waiting for async rewards).

        Raises:
          ValueError: no reward function for the prompt's data source.
          RewardError: a reward failed and the scorer is strict.
        """
        return self.submit_group(prompt, completions).result()

    def score(self, prompt: Prompt, completion: Completion) -> tuple[float, str]:
        """(reward, decoded response text) of one completion."""
        group = self.score_group(prompt, [completion])
        return group.rewards[0], group.texts[0]

    def __call__(self, prompt: Prompt, completion: Completion) -> float:
        return self.score(prompt, completion)[0]

    def close(self) -> None:
        """Stop the event loop of async rewards (cancelling calls still running); a later async call starts a
        new one."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.stop()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- internals
    def _async_loop(self) -> BackgroundLoop:
        with self._lock:
            if self._loop is None:
                self._loop = BackgroundLoop(self.max_concurrency, name="asyncrl-rewards")
            return self._loop

    def _score_in_workers(self, fn: RewardFunction, prompt: Prompt, texts: list[str]
                          ) -> concurrent.futures.Future[ScoredGroup]:
        calls = [self.workers.submit(call_reward, (fn.spec, text, prompt), timeout_s=self.timeout_s)
                 for text in texts]
        group: concurrent.futures.Future[ScoredGroup] = concurrent.futures.Future()

        def finish() -> None:
            try:
                group.set_result(self._finish(fn, prompt, texts, [_outcome_of(c) for c in calls]))
            except RewardError as err:
                group.set_exception(err)

        _when_all(calls, finish)
        return group

    async def _score_async(self, fn: RewardFunction, prompt: Prompt, texts: list[str],
                           semaphore: asyncio.Semaphore) -> ScoredGroup:
        outcomes = await asyncio.gather(*(self._call_async(fn, t, prompt, semaphore) for t in texts))
        return self._finish(fn, prompt, texts, outcomes)

    async def _call_async(self, fn: RewardFunction, text: str, prompt: Prompt,
                          semaphore: asyncio.Semaphore) -> _Outcome:
        async with semaphore:
            try:
                return _Outcome(raw=await asyncio.wait_for(fn.call(text, prompt), self.timeout_s))
            except asyncio.TimeoutError:
                return _Outcome(timed_out=True)
            except Exception as err:  # noqa: BLE001 - a reward's failure is counted (or raised when strict)
                return _Outcome(error=err)

    def _finish(self, fn: RewardFunction, prompt: Prompt, texts: list[str], outcomes: Sequence[_Outcome]
                ) -> ScoredGroup:
        group, failures = _fold_outcomes(fn, prompt, texts, outcomes)
        with self._lock:
            self._calls += len(outcomes)
            self._errors += group.errors
            self._timeouts += group.timeouts
            for key, message, _ in failures:
                if len(self._examples) < MAX_ERROR_EXAMPLES:
                    self._examples.setdefault(key, message)
            first_timeout = group.timeouts > 0 and fn.name not in self._named_timeouts
            if first_timeout:
                self._named_timeouts.add(fn.name)
        if first_timeout:
            cut = "its worker process was killed and replaced" if self.workers is not None and not fn.is_async \
                else "the call was cancelled"
            log.warning("reward %s did not return within %g s for data_source=%r, row %d: scored 0, %s; the run "
                        "goes on (timeouts are counted in reward/timeouts, not shown again)", fn.name, self.timeout_s,
                        prompt.data_source, prompt.index, cut)
        if failures and self.strict:
            _, message, error = failures[0]
            raise RewardError(message) from error
        return group


def _call(fn: RewardFunction, text: str, prompt: Prompt) -> _Outcome:
    """One sync reward call."""
    try:
        return _Outcome(raw=fn.call(text, prompt))
    except Exception as err:  # noqa: BLE001 - a reward's failure is counted (or raised when strict)
        return _Outcome(error=err)
