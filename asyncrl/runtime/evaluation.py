"""The evaluation board: held-out evaluations pinned to weight versions, handed out to the rollout agents a
prompt at a time beside the training prompts.

    board = EvalBoard(prompts, EvalConfig(every_versions=4, n=4, temperature=0.6), seed=0, max_new_tokens=64)
    board.schedule(version)                           # the controller, after publishing a version it is due at
    tasks = board.lease("agent0", agent_version, 2)   # the roster, beside the agent's training prompts
    board.submit("agent0", task, completions, rewards)
    for outcome in board.finished(): log(outcome.metrics())

Pinning: an evaluation of version v gives its prompts only to agents that hold version v, and a result is
accepted only when every token of it carries version v (an agent finishes its evaluation prompts before it takes
new weights; a result that still mixes versions is refused and its prompt handed out again). An agent that dies
gives its prompts back to the evaluation; once no live agent holds v while prompts are left, the evaluation ends
*incomplete*: it is reported with the prompts it has, and says so (`val/complete` 0).

One evaluation is one pass over the held-out prompts; its metrics use verl's names:
`val-core/<data_source>/reward/mean@<n>`, `val-aux/<data_source>/reward/pass@<k>`,
`val-aux/<data_source>/response_length/mean`, and `val/version`, `val/complete`, `val/prompts`, `val/seconds`.
Thread-safe: the roster calls it from RPC threads, the controller from its own.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Sequence

from asyncrl.config.evaluation import EvalConfig
from asyncrl.policies.sampling import SamplingParams
from asyncrl.tools.seeding import derive_seed
from asyncrl.types import Completion, Prompt

__all__ = ["EvalBoard", "EvalTask", "EvalOutcome", "pass_at_k"]

EVAL_STREAM = 7_919
"""The seed coordinate of evaluation sampling: prompt u of every evaluation samples with derive_seed(seed,
EVAL_STREAM, u), so two versions are compared on the same random numbers."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 − C(n−c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0  # C(n−c, k) / C(n, k) = Π_{i=n−c+1}^{n} (1 − k / i), stable for large n
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


@dataclasses.dataclass(frozen=True)
class EvalTask:
    """One held-out prompt of one evaluation, as handed to an agent."""

    eval_id: int
    version: int
    unit: int
    prompt: Prompt
    params: SamplingParams

    @property
    def key(self) -> str:
        return f"e{self.eval_id}:{self.unit}"


@dataclasses.dataclass(frozen=True)
class _Result:
    rewards: tuple[float, ...]
    lengths: tuple[int, ...]
    data_source: str


@dataclasses.dataclass
class _Evaluation:
    eval_id: int
    version: int
    reason: str
    started: float
    pending: collections.deque[int]
    leased: dict[int, str] = dataclasses.field(default_factory=dict)
    results: dict[int, _Result] = dataclasses.field(default_factory=dict)
    refused: int = 0  # results refused for carrying another version (their prompts were handed out again)


@dataclasses.dataclass(frozen=True)
class EvalOutcome:
    """A finished evaluation: its version, whether every prompt was evaluated, and its per-prompt results."""

    eval_id: int
    version: int
    reason: str
    complete: bool
    prompts: int
    seconds: float
    refused: int
    results: tuple[_Result, ...]
    n: int
    ks: tuple[int, ...]
    success_threshold: float

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"val/version": self.version, "val/complete": float(self.complete),
                                 "val/prompts": len(self.results), "val/prompts_planned": self.prompts,
                                 "val/seconds": self.seconds, "val/refused_results": self.refused}
        by_source: dict[str, list[_Result]] = collections.defaultdict(list)
        for r in self.results:
            by_source[r.data_source or "unknown"].append(r)
        for source, rows in sorted(by_source.items()):
            rewards = [x for r in rows for x in r.rewards]
            out[f"val-core/{source}/reward/mean@{self.n}"] = sum(rewards) / len(rewards)
            for k in self.ks:
                out[f"val-aux/{source}/reward/pass@{k}"] = sum(
                    pass_at_k(len(r.rewards), sum(x >= self.success_threshold for x in r.rewards), k)
                    for r in rows) / len(rows)
            lengths = [x for r in rows for x in r.lengths]
            out[f"val-aux/{source}/response_length/mean"] = sum(lengths) / len(lengths)
        return out

    def line(self) -> str:
        """The console's line for this evaluation."""
        core = [f"{k.split('/')[1]} {v:.3f}" for k, v in self.metrics().items() if k.startswith("val-core/")]
        state = "" if self.complete else f", INCOMPLETE ({len(self.results)} of {self.prompts} prompts)"
        return (f"eval v{self.version}: {', '.join(core) or 'no prompt evaluated'} (mean@{self.n} over "
                f"{len(self.results)} prompts, {self.seconds:.1f} s{state})")


class EvalBoard:
    def __init__(self, prompts: Sequence[Prompt], config: EvalConfig, *, seed: int, max_new_tokens: int,
                 clock: Callable[[], float] = time.monotonic):
        if not prompts:
            raise ValueError("the evaluation has no prompts (--eval.data or --eval.max-prompts)")
        config.validate()
        self.prompts, self.config, self.seed, self.clock = list(prompts), config, seed, clock
        self.max_new_tokens = config.max_new_tokens or max_new_tokens
        self._lock = threading.Lock()
        self._open: dict[int, _Evaluation] = {}  # by eval id, oldest first
        self._done: collections.deque[EvalOutcome] = collections.deque()
        self.scheduled: list[int] = []  # the versions evaluated or being evaluated
        self.reported: list[int] = []  # the versions whose evaluation ended (what a checkpoint keeps)
        self._next_id = 0
        self._timer: float | None = None  # --eval.every-seconds: from the first publication, then each opening

    # ------------------------------------------------------------------------------------ scheduling
    def due(self, version: int) -> bool:
        """Is an evaluation due at the publication of `version`: every `--eval.every-versions` K versions, or
        `--eval.every-seconds` S after the last evaluation opened (after the first publication, at first)."""
        if version <= 0:
            return False
        k, seconds = self.config.every_versions, self.config.every_seconds
        if seconds > 0 and self._timer is None:
            self._timer = self.clock()
        return (bool(k) and version % k == 0) or (seconds > 0 and self.clock() - self._timer >= seconds)

    def schedule(self, version: int, reason: str = "every") -> bool:
        """Open an evaluation of `version` (once per version: False if it was scheduled already)."""
        with self._lock:
            if version in self.scheduled:
                return False
            self.scheduled.append(version)
            now = self.clock()
            self._timer = now
            self._open[self._next_id] = _Evaluation(self._next_id, version, reason, now,
                                                    collections.deque(range(len(self.prompts))))
            self._next_id += 1
            return True

    def busy(self) -> bool:
        """An evaluation is open (pending, leased or unreported)."""
        with self._lock:
            return bool(self._open)

    # --------------------------------------------------------------------------------------- agents
    def lease(self, agent: str, agent_version: int | None, n: int) -> list[EvalTask]:
        """Up to n prompts of the open evaluations of `agent_version`, oldest evaluation first."""
        out: list[EvalTask] = []
        with self._lock:
            for ev in self._open.values():
                while ev.version == agent_version and ev.pending and len(out) < n:
                    unit = ev.pending.popleft()
                    ev.leased[unit] = agent
                    out.append(self._task(ev, unit))
        return out

    def _task(self, ev: _Evaluation, unit: int) -> EvalTask:
        cfg = self.config
        params = SamplingParams(n=cfg.n, temperature=cfg.temperature, max_new_tokens=self.max_new_tokens,
                                seed=derive_seed(self.seed, EVAL_STREAM, unit))
        return EvalTask(ev.eval_id, ev.version, unit, self.prompts[unit], params)

    def open_for(self, version: int | None) -> bool:
        """An evaluation of `version` still has prompts to generate (pending or leased): an agent holding that
        version keeps it until then."""
        with self._lock:
            return any(ev.version == version and (ev.pending or ev.leased) for ev in self._open.values())

    def holds(self, agent: str) -> int:
        """Evaluation prompts `agent` holds now."""
        with self._lock:
            return sum(a == agent for ev in self._open.values() for a in ev.leased.values())

    def submit(self, agent: str, task: EvalTask, completions: Sequence[Completion], rewards: Sequence[float]) -> bool:
        """Record a prompt's samples; False (and the prompt handed out again) when a token carries another
        version than the evaluation's, or the lease is no longer the agent's (it was declared dead)."""
        with self._lock:
            ev = self._open.get(task.eval_id)
            if ev is None or ev.leased.get(task.unit) != agent:
                return False
            del ev.leased[task.unit]
            if any(v != ev.version for c in completions for v in c.versions):
                ev.refused += 1
                ev.pending.appendleft(task.unit)
                return False
            ev.results[task.unit] = _Result(tuple(float(r) for r in rewards),
                                            tuple(len(c.token_ids) for c in completions), task.prompt.data_source)
            return True

    def agent_failed(self, agent: str) -> int:
        """Give the prompts `agent` held back to their evaluations; how many."""
        with self._lock:
            back = 0
            for ev in self._open.values():
                for unit in [u for u, a in ev.leased.items() if a == agent]:
                    del ev.leased[unit]
                    ev.pending.appendleft(unit)
                    back += 1
            return back

    # ---------------------------------------------------------------------------------------- results
    def settle(self, live_versions: set[int]) -> list[EvalOutcome]:
        """Close every evaluation that is done (all prompts evaluated), and every one that cannot go on (prompts
        left, none leased, and every live agent holds a later version: incomplete); return them, oldest first."""
        with self._lock:
            for eval_id, ev in list(self._open.items()):
                complete = len(ev.results) == len(self.prompts)
                stuck = not ev.leased and bool(live_versions) and min(live_versions) > ev.version
                if complete or stuck:
                    del self._open[eval_id]
                    self._done.append(self._outcome(ev, complete))
                    self.reported.append(ev.version)
            out = list(self._done)
            self._done.clear()
            return out

    def _outcome(self, ev: _Evaluation, complete: bool) -> EvalOutcome:
        return EvalOutcome(ev.eval_id, ev.version, ev.reason, complete, len(self.prompts), self.clock() - ev.started,
                           ev.refused, tuple(ev.results[u] for u in sorted(ev.results)), self.config.n,
                           tuple(self.config.k_values()), self.config.success_threshold)

    def state_dict(self) -> dict:
        """The versions whose evaluation ended, and the open ones. A resume at version v evaluates v again if
        its evaluation had not ended (its weights are the checkpoint's); an open one of an older version cannot
        be re-run (those weights are gone) and is reported as lost."""
        with self._lock:
            return {"reported": list(self.reported), "open": sorted({ev.version for ev in self._open.values()})}

    def load_state_dict(self, state: dict) -> list[int]:
        """Restore the schedule; returns the versions whose evaluation was open (the caller re-runs the one at
        the resumed version)."""
        with self._lock:
            self.reported = [int(v) for v in state.get("reported", [])]
            self.scheduled = list(self.reported)
            return [int(v) for v in state.get("open", [])]
