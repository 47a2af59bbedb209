"""EpisodeRunner: drives multi-turn episodes through a rollout engine, with environment steps off the decode loop.

    runner = EpisodeRunner(engine, runtime)
    runner.start("p17", prompt, params)       # the prompt's n episodes; their first turns share one prefill
    runner.on_output(output)                  # a turn finished (every engine output whose id runner.owns)
    for group in runner.poll():               # environment steps that came back: next turns queued,
        ...                                   # EpisodeGroup of every prompt whose n episodes all ended

After each model turn the environment's `step` runs on a background event loop, cut off after
`step_timeout_s`; the observation is rendered there too. An environment of your own with a sync `step` lives
in a worker process (`runtime.workers`, see `asyncrl.envs.isolated`): a step past its timeout is cut off by
killing that process. A built-in environment's sync `step` runs in a thread (they are bounded). The generation loop only
polls finished futures, so a slow tool never stalls the other episodes' decoding. The next turn is queued
as a request of the episode's session: the embedded engine continues from the held K/V, vLLM from its
prefix cache, and the turn prefills only its new tokens. A weight update may land between turns or within
one (partial rollout): each model token carries the version that sampled it.

An environment that raises, times out or answers with something that is not a valid StepResult ends its
episode: counted (env_errors, env_timeouts), scored 0, none of its tokens trained; the run goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import math
import time
from typing import Any, Callable

from asyncrl.tools.background_loop import BackgroundLoop
from asyncrl.envs.episode import Episode, EpisodeStats
from asyncrl.envs.isolated import close_env, open_env, step_env
from asyncrl.envs.protocol import EnvFactory, StepResult, Turn
from asyncrl.policies.protocol import RolloutEngine
from asyncrl.policies.sampling import SamplingParams
from asyncrl.tools.seeding import derive_seed
from asyncrl.types import Completion, GenerationOutput, Prompt

__all__ = ["EnvRuntime", "EpisodeGroup", "EpisodeRunner"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EnvRuntime:
    """What the runner needs, built in the rollout process: the environment factory, the renderer and limits."""

    factory: EnvFactory
    renderer: Any
    """`ChatRenderer` or `TokenRenderer`."""
    decode: Callable[[list[int]], str]
    """A model turn's text (its trailing stop token left out)."""
    max_turns: int = 4
    max_turn_tokens: int | None = None
    step_timeout_s: float = 30.0
    max_concurrency: int = 64
    observation_role: str = "user"
    isolated_spec: str | None = None
    """The `--env.fn` whose episodes live in `workers` (`asyncrl.envs.isolated.runs_isolated`); None: here."""
    workers: Any = None
    """Worker processes (`asyncrl.data.scoring.Workers`) for `isolated_spec`."""

    @property
    def isolated(self) -> bool:
        return self.isolated_spec is not None and self.workers is not None


@dataclasses.dataclass
class EpisodeGroup:
    """A prompt's n finished episodes."""

    key: str
    prompt: Prompt
    completions: list[Completion]
    env_rewards: list[float | None]
    """Per episode: the environment's reward, or None where the reward function should score it."""
    env_stats: dict[str, int]
    """Summed EpisodeStats of the n episodes (the group's `info.env`)."""


@dataclasses.dataclass(frozen=True)
class _Outcome:
    result: StepResult | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    """The observation's tokens, the closing tokens of the model's turn first."""
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0


@dataclasses.dataclass(eq=False)
class _Task:
    prompt: Prompt
    params: SamplingParams
    episodes: list[Episode]


class EpisodeRunner:
    def __init__(self, engine: RolloutEngine, runtime: EnvRuntime):
        self.engine, self.runtime = engine, runtime
        self._loop = BackgroundLoop(runtime.max_concurrency, name="asyncrl-env")
        self._tasks: dict[str, _Task] = {}
        self._requests: dict[str, tuple[_Task, list[Episode]]] = {}  # engine request id -> its episodes
        self._stepping: list[tuple[_Task, Episode, concurrent.futures.Future]] = []
        self._ready: list[EpisodeGroup] = []  # prompts whose episodes have all ended, for the next poll
        self._timeout_named = False

    @property
    def busy(self) -> bool:
        """Some episode has not ended."""
        return bool(self._tasks)

    def owns(self, request_id: str) -> bool:
        return request_id in self._requests

    def start(self, key: str, prompt: Prompt, params: SamplingParams) -> None:
        """Start a prompt's `params.n` episodes (`params.max_new_tokens` is each episode's token budget)."""
        if key in self._tasks:
            raise ValueError(f"EpisodeRunner.start: {key!r} is already running")
        episodes = [Episode(f"{key}.e{i}", list(prompt.prompt_ids), params.max_new_tokens) for i in range(params.n)]
        task = _Task(prompt, params, episodes)
        first = dataclasses.replace(params, max_new_tokens=self._turn_budget(episodes[0]))
        request_id = self.engine.add_request(prompt.prompt_ids, first, request_id=f"{key}.t0",
                                             sessions=[e.key for e in episodes])
        self._tasks[key] = task
        self._requests[request_id] = (task, episodes)

    def _turn_budget(self, episode: Episode) -> int:
        cap = self.runtime.max_turn_tokens
        return episode.remaining if cap is None else min(cap, episode.remaining)

    def on_output(self, output: GenerationOutput) -> None:
        """A turn request finished: record each episode's turn and start its environment step."""
        task, episodes = self._requests.pop(output.request_id)
        if len(episodes) == 1 and episodes[0].stats.turns:  # a later turn: what its prefill could skip
            episodes[0].stats.later_turn_prompt_tokens += len(output.prompt_ids)
            episodes[0].stats.reused_prompt_tokens += output.cached_prompt_tokens
        for episode, completion in zip(episodes, output.completions):
            ids = completion.token_ids
            stopped = completion.finish_reason == "stop"
            turn = episode.add_model_turn(completion, self.runtime.decode(ids[:-1] if stopped else ids))
            if completion.finish_reason == "abort":
                episode.stats.truncated += 1
                self._end(task, episode)
                continue
            future = self._loop.submit(self._step(task.prompt, episode, turn))
            self._stepping.append((task, episode, future))

    async def _step(self, prompt: Prompt, episode: Episode, turn: Turn) -> _Outcome:
        start = time.monotonic()
        try:
            async with self._loop.semaphore:
                if self.runtime.isolated:  # the pool times each call from when a worker takes it (start-up excluded)
                    result = await self._call_isolated(prompt, episode, turn)
                else:
                    result = await asyncio.wait_for(self._call(prompt, episode, turn), self.runtime.step_timeout_s)
            problem = _invalid(result)
            if problem is not None:
                return _Outcome(error=problem, seconds=time.monotonic() - start)
            tokens: list[int] = []
            if not result.done and result.observation is not None:
                tokens = self.runtime.renderer.after_turn(turn.token_ids) + self.runtime.renderer.observation(
                    result.observation if not isinstance(result.observation, str) else
                    [{"role": self.runtime.observation_role, "content": result.observation}])
            return _Outcome(result=result, tokens=tokens, seconds=time.monotonic() - start)
        except (asyncio.TimeoutError, TimeoutError):  # TimeoutError: a worker's call past its deadline
            return _Outcome(timed_out=True, seconds=time.monotonic() - start)
        except Exception as err:  # noqa: BLE001 - an environment's failure ends its episode, not the run
            kind = getattr(err, "type_name", type(err).__name__)  # raised in a worker process: its own type's name
            return _Outcome(error=f"{kind}: {err}", seconds=time.monotonic() - start)

    async def _call(self, prompt: Prompt, episode: Episode, turn: Turn) -> Any:
        if episode.env is None:  # made here, off the decode loop: a constructor may load data or start a sandbox
            episode.env = await asyncio.to_thread(self.runtime.factory, prompt)
        step = episode.env.step
        if inspect.iscoroutinefunction(step):
            return await step(turn)
        result = await asyncio.to_thread(step, turn)
        return await result if inspect.isawaitable(result) else result

    async def _call_isolated(self, prompt: Prompt, episode: Episode, turn: Turn) -> Any:
        workers, timeout, key = self.runtime.workers, self.runtime.step_timeout_s, episode.key
        if episode.env is None:
            episode.env = _Isolated(key)  # before the call: an episode ended mid-open still closes its worker state
            await asyncio.wrap_future(workers.submit(open_env, (self.runtime.isolated_spec, key, prompt),
                                                     timeout_s=timeout, pin=key))
        return await asyncio.wrap_future(workers.submit(step_env, (key, turn), timeout_s=timeout, pin=key))

    def poll(self) -> list[EpisodeGroup]:
        """Apply the environment steps that came back; return the prompts whose episodes have all ended."""
        stepping, self._stepping = self._stepping, []
        for task, episode, future in stepping:
            if future.done():
                self._apply(task, episode, future.result())
            else:
                self._stepping.append((task, episode, future))
        ready, self._ready = self._ready, []
        return ready

    def _apply(self, task: _Task, episode: Episode, outcome: _Outcome) -> None:
        stats = episode.stats
        stats.env_steps += 1
        stats.env_time_s += outcome.seconds
        if outcome.timed_out or outcome.error is not None:
            if outcome.timed_out and not self._timeout_named:
                self._timeout_named = True
                log.warning("an environment step did not return within %g s (data_source=%r, row %d): the episode "
                            "ends untrained, %s; the run goes on (counted in env/timeouts, not shown again)",
                            self.runtime.step_timeout_s, task.prompt.data_source, task.prompt.index,
                            "its worker process was killed and replaced" if self.runtime.isolated
                            else "its thread cannot be stopped and runs on")
            stats.env_timeouts += outcome.timed_out
            stats.env_errors += outcome.error is not None
            episode.failed = True
            return self._end(task, episode, outcome.error or f"timed out after {self.runtime.step_timeout_s} s")
        result = outcome.result
        stats.tool_calls += result.tool_calls
        stats.tool_errors += result.tool_errors
        if result.reward is not None:
            episode.rewards.append(float(result.reward))
        if result.done:
            return self._end(task, episode)
        if stats.turns >= self.runtime.max_turns or episode.remaining - len(outcome.tokens) < 1:
            stats.truncated += 1
            return self._end(task, episode)
        episode.add_env_tokens(outcome.tokens)
        params = dataclasses.replace(task.params, n=1, max_new_tokens=self._turn_budget(episode),
                                     seed=_turn_seed(task.params.seed, episode.key, stats.turns))
        request_id = self.engine.add_request(episode.sequence, params, request_id=f"{episode.key}.t{stats.turns}",
                                             sessions=[episode.key])
        self._requests[request_id] = (task, [episode])

    def _end(self, task: _Task, episode: Episode, why: str | None = None) -> None:
        episode.done = True
        if why is not None:
            episode.finish_reason = "abort"
        self.engine.end_sessions([episode.key])
        close = getattr(episode.env, "close", None)
        if isinstance(episode.env, _Isolated):
            self._close_isolated(episode.key)
        elif callable(close):
            try:
                close()
            except Exception:  # noqa: BLE001 - the episode is over; a failing close must not end the run
                episode.stats.env_errors += 1
        if all(e.done for e in task.episodes):
            self._ready.append(self._collect(task))

    def _close_isolated(self, key: str) -> None:
        """Close the episode's environment in its worker, then forget where it lived (a failed close is logged:
        the episode is over)."""
        workers = self.runtime.workers
        try:
            closing = workers.submit(close_env, (key,), timeout_s=self.runtime.step_timeout_s, pin=key)
        except RuntimeError:  # the pool is closed: the run is ending
            return

        def forget(future: concurrent.futures.Future) -> None:
            if future.exception() is not None:
                log.debug("closing the environment of %s failed: %r", key, future.exception())
            workers.release(key)

        closing.add_done_callback(forget)

    def _collect(self, task: _Task) -> EpisodeGroup:
        key = next(k for k, t in self._tasks.items() if t is task)
        del self._tasks[key]
        total = EpisodeStats(episodes=0)
        for episode in task.episodes:
            for field in dataclasses.fields(EpisodeStats):
                setattr(total, field.name, getattr(total, field.name) + getattr(episode.stats, field.name))
        return EpisodeGroup(key, task.prompt, [e.completion() for e in task.episodes],
                            [e.env_reward for e in task.episodes], total.as_dict())

    def close(self) -> None:
        """Stop the environment loop (cancelling steps still running)."""
        self._loop.stop()


@dataclasses.dataclass(frozen=True)
class _Isolated:
    """Stands in an Episode for an environment that lives in a worker process, under the episode's key."""

    key: str


def _invalid(result: Any) -> str | None:
    """Why an environment's answer is not usable, or None."""
    if not isinstance(result, StepResult):
        return f"step returned {type(result).__name__}, not a StepResult"
    if result.reward is not None:
        if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
            return f"reward {result.reward!r} is not a number"
        if not math.isfinite(result.reward):
            return f"reward {result.reward} is not finite"
    observation = result.observation
    if not (observation is None or isinstance(observation, (str, list, tuple))):
        return f"observation of type {type(observation).__name__}; give a string, messages or token ids"
    return None


def _turn_seed(seed: int | None, key: str, turn: int) -> int | None:
    """A per-episode, per-turn sampling seed from the prompt's (reproducible runs stay reproducible)."""
    if seed is None:
        return None
    index = int(key.rpartition(".e")[2]) if ".e" in key else 0
    return derive_seed(seed, index, turn)
