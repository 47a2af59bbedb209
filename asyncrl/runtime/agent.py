"""RolloutAgent: wraps an engine, asks the roster for prompts, pushes scored groups as they finish.

    agent = RolloutAgent("agent0", engine, scorer, rollout_cfg, roster)
    agent.start()                      # the generation loop runs in its own thread

The loop: keep up to `concurrent_prompts` prompts in flight (asking the roster, whose queue admits within
the staleness budget), step the engine, score every finished group and submit it at once (streaming).
A weight update happens at a decode-step boundary, because the engine's controls take its step lock:
  partial rollout:  `pause_for_sync(partial=True)` freezes running sequences ("keep"); `load_weights`
                    copies the new weights in place; `resume` continues them — later tokens carry the new
                    version;
  no partial:       `pause_for_sync(partial=False)` stops asking for prompts and lets the running ones
                    finish ("wait"); weights are swapped when the engine is empty.
`roster` is anything with `request(agent, n) -> list[Task]`, `submit(agent, group)`, `heartbeat(agent)`
and `agent_failed(agent, why)`: the run's `Roster` itself in-process, an RPC proxy of it across processes.
The loop heartbeats every `heartbeat_s` whatever it is doing (generating, paused for a weight update, idle),
so only a stuck loop or a stopped process falls silent.

With an environment (`env`, multi-turn episodes) a prompt's n samples are episodes driven by an
`EpisodeRunner`: the loop hands it every finished turn and polls it for environment steps that came back
(the next turns are queued then) and for prompts whose episodes have all ended, which are scored and
submitted like single-turn groups. Without partial rollout, a weight update waits for running episodes to
end, so every episode is sampled by one version.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterable, Protocol

import torch
from torch import Tensor

from asyncrl.config import RolloutConfig
from asyncrl.data.scoring import RewardError, Scorer
from asyncrl.envs import EnvRuntime, EpisodeGroup, EpisodeRunner
from asyncrl.policies.protocol import RolloutEngine
from asyncrl.policies.sampling import SamplingParams
from asyncrl.runtime.evaluation import EvalTask
from asyncrl.runtime.queue import Task
from asyncrl.runtime.reward_tally import group_reward_info
from asyncrl.runtime.roster import Fenced
from asyncrl.types import Completion, GenerationOutput, Group, GroupInfo

__all__ = ["RolloutAgent", "RosterHandle", "heartbeat_period", "mean_windows"]

log = logging.getLogger(__name__)


def heartbeat_period(agent_timeout_s: float) -> float:
    """Agents beat five times per timeout (at most once a second): a busy machine gives no false alarm."""
    return min(1.0, agent_timeout_s / 5)


def mean_windows(windows: list[dict]) -> dict:
    """The agents' window metrics (`RolloutAgent.window_metrics`, one dict per live agent) averaged key by key
    over the agents ({} without one): what each version's row says of the rollout side."""
    return {k: sum(w[k] for w in windows) / len(windows) for k in windows[0]} if windows else {}


class RosterHandle(Protocol):
    """What an agent calls on the run's roster (rank 0): the `Roster`, or an RPC proxy of it."""

    def request(self, agent: str, n: int) -> list[Task | EvalTask]: ...

    def submit(self, agent: str, group: Group) -> None: ...

    def submit_eval(self, agent: str, task: EvalTask, completions: list[Completion], rewards: list[float]) -> None: ...

    def heartbeat(self, agent: str) -> None: ...

    def evaluating(self, agent: str) -> bool: ...

    def agent_failed(self, agent: str, why: str) -> None: ...


@dataclasses.dataclass
class _Scoring:
    """A prompt's finished completions on their way to the queue: their reward function's scores (a future,
    done at once for sync rewards) and, for episodes, the environment's rewards."""

    task: Task | EvalTask
    completions: list[Completion]
    future: Future | None
    """Scores of the completions the reward function scores (all, or the episodes whose env gave none)."""
    env_rewards: list[float | None] | None = None
    env_stats: dict[str, int] = dataclasses.field(default_factory=dict)

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def rewards(self, scorer: Scorer) -> tuple[list[float], list[str], dict]:
        """(one reward per completion, the decoded texts, the reward part of the group's info)."""
        scored = self.future.result() if self.future is not None else None
        if self.env_rewards is None:
            return scored.rewards, scored.texts, group_reward_info(scored, scorer.error_examples)
        from_fn = iter(scored.rewards if scored is not None else ())
        rewards = [r if r is not None else next(from_fn) for r in self.env_rewards]
        texts = [scorer.text(c) for c in self.completions]
        info = group_reward_info(scored, scorer.error_examples) if scored is not None else {}
        return rewards, texts, info


class RolloutAgent:
    def __init__(self, name: str, engine: RolloutEngine, scorer: Scorer, rollout: RolloutConfig,
                 roster: RosterHandle, *, colocated: bool = False, idle_sleep_s: float = 0.01,
                 heartbeat_s: float = 1.0, on_exit: Callable[[BaseException | None], None] | None = None,
                 env: EnvRuntime | None = None, device: torch.device | str | None = None):
        self.name, self.engine, self.scorer, self.rollout = name, engine, scorer, rollout
        self.device = torch.device(device) if device is not None else getattr(getattr(engine, "model", None),
                                                                                "device", None)
        """The engine's device (the generation thread makes it current): given, or its model's."""
        self.roster, self.colocated = roster, colocated
        self.idle_sleep_s, self.heartbeat_s = idle_sleep_s, heartbeat_s
        self.on_exit = on_exit
        self.tasks: dict[str, Task | EvalTask] = {}  # engine request id -> task
        self.evaluating = 0  # evaluation prompts generating now
        self.scoring: list[_Scoring] = []  # finished generations being scored, in the order they finished
        self.episodes = EpisodeRunner(engine, env) if env is not None else None
        self.accepting = True
        self._admission = threading.Lock()  # a drain's `accepting = False` never lands in the middle of a _fill
        self.versions_seen: list[int] = [engine.version]
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._pause_wanted = threading.Event()  # a weight sync waits for the engine: the loop takes no step
        self._thread: threading.Thread | None = None
        self._busy_s = 0.0
        self._steps = self._rows = 0  # engine steps and their running rows in this window
        self._window_start = time.monotonic()
        self._last_beat = 0.0
        self.submitted = 0

    # ------------------------------------------------------------------------------------ the loop
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"agent-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"agent {self.name}: the generation loop did not stop within {timeout} s")
        if self.episodes is not None:
            self.episodes.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread; this one works on the engine's
            while not self._stop.is_set():
                self._tick()
        except Fenced as err:  # declared dead while stuck (or stopped): nothing of ours is accepted any more
            self.error = err
            log.error("agent %s was fenced out of the run: %s", self.name, err)
        except BaseException as err:  # surface it: tell the roster at once (else it sees the agent fall silent)
            self.error = err
            if isinstance(err, RewardError):  # the user's reward, named in the message: no traceback of ours
                why = f"its reward failed under --strict-rewards: {err}"
                log.error("agent %s stopped: %s", self.name, why)
            else:
                why = f"its generation loop raised {err!r}"
                log.exception("agent %s stopped on an error", self.name)
            try:
                self.roster.agent_failed(self.name, why)
            except Exception:  # noqa: BLE001 - the roster may be gone too; the timeout still catches it
                log.warning("agent %s could not report its failure", self.name)
        finally:
            if self.on_exit is not None:
                self.on_exit(self.error)

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._last_beat > self.heartbeat_s:
            self.roster.heartbeat(self.name)
            self._last_beat = now
        if self.episodes is not None:
            for group in self.episodes.poll():
                self._submit_episodes(group)
        if self.scoring:
            self._deliver()
        if self.accepting and not self.engine.is_paused:
            self._fill()
        episodes_running = self.episodes is not None and self.episodes.busy
        if self.engine.is_sleeping and self.engine.has_unfinished():
            self.engine.wake_up()  # an episode's next turn arrived while the engine slept
        if not self.engine.has_unfinished() or self.engine.is_paused:
            if (self.colocated and not self.engine.has_unfinished() and not episodes_running
                    and not self.engine.is_sleeping):
                self.engine.sleep()  # free the KV cache while the learner trains on this device
            time.sleep(self.idle_sleep_s)
            return
        if self._pause_wanted.is_set():  # a sync waits for the engine's lock; stepping on would keep winning it
            time.sleep(0.001)
            return
        start = time.monotonic()
        outputs = self.engine.step()
        self._busy_s += time.monotonic() - start
        self._steps += 1
        self._rows += self.engine.num_running
        for out in outputs:
            if self.episodes is not None and self.episodes.owns(out.request_id):
                self.episodes.on_output(out)
            else:
                self._submit(out)

    def _fill(self) -> None:
        with self._admission:
            if self.accepting:
                self._admit()

    def _admit(self) -> None:
        want = self.rollout.concurrent_prompts - len(self.tasks)
        if want <= 0:
            return
        tasks = self.roster.request(self.name, want)
        if tasks and getattr(self.engine, "is_sleeping", False):
            self.engine.wake_up()
        for task in tasks:
            if isinstance(task, EvalTask):  # pinned to the version this engine holds: see begin_sync
                if self.episodes is not None:
                    self.episodes.start(task.key, task.prompt, task.params)
                    key = task.key
                else:
                    key = self.engine.add_request(task.prompt.prompt_ids, task.params, request_id=task.key)
                self.tasks[key] = task
                self.evaluating += 1
                continue
            params = SamplingParams(n=self.rollout.n, temperature=self.rollout.temperature, top_p=self.rollout.top_p,
                                    top_k=self.rollout.top_k, max_new_tokens=self.rollout.max_new_tokens,
                                    seed=task.seed)
            key = f"p{task.prompt_id}"
            if self.episodes is not None:
                self.episodes.start(key, task.prompt, params)
            else:
                key = self.engine.add_request(task.prompt.prompt_ids, params, request_id=key)
            self.tasks[key] = task

    def _submit(self, out: GenerationOutput) -> None:
        """Start scoring a finished generation; sync rewards are done at once, async ones (judges, sandboxes)
        run on the scorer's event loop while the engine goes on generating."""
        task = self.tasks.pop(out.request_id)
        self.evaluating -= isinstance(task, EvalTask)
        future = self.scorer.submit_group(task.prompt, out.completions)
        self.scoring.append(_Scoring(task, out.completions, future))
        self._deliver()

    def _submit_episodes(self, episodes: EpisodeGroup) -> None:
        """Score a prompt's ended episodes: the environment's rewards, the reward function where it gave none."""
        task = self.tasks.pop(episodes.key)
        self.evaluating -= isinstance(task, EvalTask)
        unscored = [c for c, r in zip(episodes.completions, episodes.env_rewards) if r is None]
        future = self.scorer.submit_group(task.prompt, unscored) if unscored else None
        self.scoring.append(_Scoring(task, episodes.completions, future, episodes.env_rewards, episodes.env_stats))
        self._deliver()

    def _deliver(self) -> None:
        """Push every group whose scoring is done, in the order they finished generating."""
        while self.scoring and self.scoring[0].done():
            entry = self.scoring.pop(0)
            task = entry.task
            rewards, texts, reward_info = entry.rewards(self.scorer)  # a strict scorer's RewardError ends the loop
            if isinstance(task, EvalTask):
                self.roster.submit_eval(self.name, task, entry.completions, rewards)
                continue
            group = Group(prompt_id=task.prompt_id, prompt_ids=list(task.prompt.prompt_ids),
                          completions=entry.completions, rewards=rewards, data_source=task.prompt.data_source,
                          admitted_version=task.admitted_version,
                          info=GroupInfo(index=task.prompt.index, agent=self.name, prompt_text=task.prompt.text,
                                         texts=texts, rewards=reward_info, env=entry.env_stats))
            self.roster.submit(self.name, group)
            self.submitted += 1

    # ------------------------------------------------------------------------------ weight updates
    def begin_sync(self, partial: bool) -> None:
        """Start freezing (partial) or draining (not partial) now, so that every agent of a publication drains
        at once; `pause_for_sync` then waits for it. With episodes the engine is paused only once they have
        ended: their later turns must still run. While an evaluation of the version this agent holds is open,
        nothing happens here: `pause_for_sync` first lets it end (evaluations are pinned to a version)."""
        if self.evaluating or self.roster.evaluating(self.name):
            return
        if partial:
            self._pause_engine("keep")
            return
        with self._admission:
            self.accepting = False
        if self.episodes is None:
            self._pause_engine("wait")

    def pause_for_sync(self, partial: bool, timeout: float) -> None:
        """Reach a state where weights can be swapped: frozen (partial) or drained (not partial). An open
        evaluation of the version this agent holds ends first: the loop goes on generating (its evaluation
        prompts and training prompts, all under these weights) until no prompt of it is left to generate. The
        publication does not wait for this agent meanwhile (`SyncRunner`)."""
        deadline = time.monotonic() + timeout
        while self.evaluating or self.roster.evaluating(self.name):
            self._check_drain(deadline, timeout, "evaluation prompts")
            time.sleep(0.05)
        if partial:
            self._pause_engine("keep")
            return
        with self._admission:
            self.accepting = False
        while self.episodes is not None and self.episodes.busy:  # whole episodes, so one version samples each
            self._check_drain(deadline, timeout, "episodes")
            time.sleep(0.002)
        self._pause_engine("wait")
        while not self.engine.is_paused:
            self._check_drain(deadline, timeout, "generations")
            time.sleep(0.002)

    def _pause_engine(self, mode: str) -> None:
        """`engine.pause(mode)` at the next step boundary. The engine pauses under the lock its steps hold; a loop
        that went on stepping would take that lock again and again before this thread got it (seen on a GPU:
        42 decode steps, 170 ms, before a sync could pause), so the loop takes no step until the pause is in."""
        self._pause_wanted.set()
        try:
            self.engine.pause(mode)
        finally:
            self._pause_wanted.clear()

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int | None) -> None:
        """Copy (a bucket of) weights into the paused engine; `version` on the last bucket. A last bucket whose
        version is older than the agent's is refused before it is copied (an agent's versions only go forward)."""
        if version is not None and version < self.versions_seen[-1]:
            raise RuntimeError(f"agent {self.name}: version went backwards {self.versions_seen[-1]} -> {version}")
        self.engine.update_weights(named_tensors, version, kv=self.rollout.kv_on_update)
        if version is not None:
            self.versions_seen.append(version)

    def _check_drain(self, deadline: float, timeout: float, what: str) -> None:
        if self.error is not None:
            raise RuntimeError(f"agent {self.name} failed while draining: {self.error!r}") from self.error
        if time.monotonic() > deadline:
            raise TimeoutError(f"agent {self.name}: running {what} did not finish within {timeout} s")

    def resume(self) -> None:
        self.accepting = True
        self.engine.resume()

    def window_metrics(self) -> dict:
        """Idle ratio and throughput since the last call (one version window)."""
        now = time.monotonic()
        span = max(now - self._window_start, 1e-9)
        out = {"rollouter/idle_ratio": 1.0 - min(self._busy_s / span, 1.0), "rollouter/active_time": self._busy_s,
               "rollouter/version_time": span,
               # rows still generating after each engine step, on average (0 without a step): how full the slots are
               "rollouter/running_rows": self._rows / self._steps if self._steps else 0.0}
        self._busy_s, self._window_start, self._steps, self._rows = 0.0, now, 0, 0
        return out
