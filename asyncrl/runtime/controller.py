"""The run loop on the trainer: take groups as they stream in, train, publish weights, account, checkpoint.

    parts = RunParts(queue, roster, publisher, trainers, agent_metrics)
    controller = Controller(parts, state, async_cfg, run_log=tracker, checkpoints=CheckpointPolicy(run_dir, every=2),
                            stop=stop_request, evals=EvalSchedule(board, roster), layout=layout)
    end = controller.train()            # agents must be running (they call the roster)
    ...                                 # stop the agents
    summary = controller.summary(end)   # then close the books: the run's one RunSummary

One version window = `trigger_parameter_sync_step` learner steps, each on `require_batches ×
mini_batch_size` groups taken oldest-first from the queue (DAPO's dynamic sampling drops all-equal groups
and takes more), then one publication. With `lag_policy="wait"` the publication is held back (the trainer
keeps training on queued groups) until no queued or in-flight work would exceed `max_version_lag`; a drift budget
(`drift_budget`) holds it the same way at the lag whose predicted KL(μ‖π_θ) fits the budget, learnt from each step.

Agents' health is the roster's business (its own thread); the loop only raises the roster's fatal error (no
agent left) and, when no agent is live but one is waiting for its first weights (a restarted or joining
agent), publishes early so it can start. A stop request (`stop` set by a signal handler, or
`max_run_time_s`) ends the loop at the next step boundary: the step in progress finishes, a step still
waiting for samples is abandoned (its groups go back to the queue), and a checkpoint is written.
Metrics per version use verl's names (`fully_async/*`, `timing_s/*`, `trainer/idle_ratio`, ...) and go to the
run's `RunLog` (`asyncrl.runtime.run_log`). Given the run's `layout`, each version also carries the split
planner's view of it (`asyncrl.runtime.plan_view.PlanAdvisor`): `plan/trainer_idle_predicted` and
`plan/rollout_idle_predicted` beside the measured idle ratios, and now and then a log line when another split of
the GPUs is predicted to train faster. Held-out evaluations are scheduled by `evals`
(`asyncrl.runtime.eval_schedule`); their metrics join the row of the version at which they ended.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import pathlib
import time
from typing import Callable, NamedTuple, Protocol

from asyncrl.algos.drift import DriftRate, drift_lag_cap, drift_rate_update
from asyncrl.algos.staleness import lag_by_length
from asyncrl.config import AsyncConfig
from asyncrl.learner import LearnerState, filter_groups
from asyncrl.planning import Layout
from asyncrl.runtime.eval_schedule import EvalSchedule
from asyncrl.runtime.lifecycle import RunFailed, StopRequest
from asyncrl.runtime.plan_view import PlanAdvisor
from asyncrl.runtime.queue import QueueTimeout, SampleQueue
from asyncrl.runtime.roster import Roster
from asyncrl.runtime.run_log import QuietLog, RunLog
from asyncrl.types import Group

LAG_BY_LENGTH = "training/version_lag/by_length/"
"""Per response-length bucket (`asyncrl.algos.length_bucket`), `<bucket>/count` trained samples, `<bucket>/lag_sum`
their summed version lag (oldest token), `<bucket>/length_sum` their summed response lengths and
`<bucket>/group_length_sum` the summed longest response of each one's group: summed over a window, so a run's mean
at a length is sum / count."""

__all__ = ["LAG_BY_LENGTH", "Controller", "RunParts", "CheckpointPolicy", "RunSummary", "TrainingEnd", "Interrupted",
           "WeightPublisher", "Trainers", "BatchTimeout", "batch_timeout_message"]

log = logging.getLogger(__name__)


class WeightPublisher(Protocol):
    """Hands the learner's weights to every live agent as `version` (`asyncrl.rpc.param_server`); returns the
    publication's metrics."""

    def publish(self, state: LearnerState, version: int) -> dict: ...


class Trainers(Protocol):
    """The trainer ranks as one (`asyncrl.rpc.commands.TrainerGroup`; one process: `asyncrl.rpc.local`)."""

    def step(self, state: LearnerState, groups: list[Group]) -> tuple[LearnerState, dict]:
        """One learner step on `groups` (every rank on its share); the new state and the step's metrics."""

    def checkpoint(self, run_dir: str, state: LearnerState, extra: dict, keep: int) -> pathlib.Path:
        """Write a checkpoint of every rank's shard (and `extra`, rank 0's books); keep the newest `keep`."""

    def keep_books(self, state: LearnerState, books: Callable[[], dict]) -> float | None:
        """At a version boundary: where the trainer ranks keep restore points, keep `books()` (a checkpoint's extra)
        beside this step's, for a restart after rank 0's death (`asyncrl.rpc.restart`), and return the seconds it
        took; elsewhere nothing (None)."""


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What the loop drives, built by a launcher (`asyncrl.rpc.local`, `asyncrl.rpc.head`)."""

    queue: SampleQueue
    roster: Roster
    publisher: WeightPublisher
    trainers: Trainers
    agent_metrics: Callable[[], dict] = dict
    """The live agents' metrics of the version window that ends (idle ratio, busy seconds), averaged."""


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """Where and when the run checkpoints: into `run_dir` every `every` versions (0: only at the end of a run
    that ends normally, and when it is stopped), keeping the newest `keep`. No `run_dir`: never."""

    run_dir: str | pathlib.Path | None = None
    every: int = 0
    keep: int = 3

    def due(self, version: int) -> bool:
        return bool(self.every and self.run_dir and version % self.every == 0)


class TrainingEnd(NamedTuple):
    """How the training loop ended."""

    interrupted: str | None
    """Why it stopped early (a signal's name, or the wall-clock cap), None when it ran to its end."""
    checkpoint: str | None
    """The checkpoint written last."""


class Interrupted(Exception):
    """A stop was requested while the trainer waited for samples."""


class BatchTimeout(RunFailed):
    """The trainer waited --async-training.take-timeout-s for a learner step's groups and did not get them: a run
    failure its message explains in full (`batch_timeout_message`), reported as one line without a traceback."""


def batch_timeout_message(*, waited_s: float, want: int, have: int, in_flight: int, mini_batch_size: int,
                          require_batches: int, take_timeout_s: float) -> str:
    """Why the trainer gave up on a learner step of `want` groups: how long it really waited, the `have` groups it
    had (taken or queued) and the prompts agents still held, and the flags to change."""
    step = f"--trainer.mini-batch-size {mini_batch_size}" + (
        f" × --async-training.require-batches {require_batches}" if require_batches != 1 else "")
    return (f"the trainer waited {waited_s:.0f} s for a learner step's {want} groups ({step}) and got {have} "
            f"({in_flight} prompts still in flight), past --async-training.take-timeout-s {take_timeout_s:g}; the "
            "rollout agents may be dead, idle or slower than that: raise --async-training.take-timeout-s, or lower "
            "--trainer.mini-batch-size")


@dataclasses.dataclass
class RunSummary:
    versions: int
    steps: int
    ledger: dict
    dead_agents: list[str]
    history: list[dict]
    interrupted: str | None = None
    """Why the run stopped early (a signal's name, or the wall-clock cap), None when it ran to its end."""
    checkpoint: str | None = None
    """The checkpoint written last (at the end, or when interrupted)."""
    agents: dict = dataclasses.field(default_factory=dict)
    """Every agent that took part: status, why it left, first and last weight version, groups delivered."""
    rewards: dict = dataclasses.field(default_factory=dict)
    """Reward calls of the run: {"calls", "errors", "timeouts", "examples": first distinct error messages}."""
    trainer_recoveries: list = dataclasses.field(default_factory=list)
    """Trainer-group faults recovered from (`asyncrl.rpc.failover`): {"generation", "why", "step", "version",
    "seconds"} each."""

    def done_lines(self, warn_share: float = 0.5) -> str:
        """What the console prints at the end: versions, the prompt ledger with drop reasons, reward failures."""
        ledger = self.ledger
        reasons = ", ".join(f"{k.split('/', 1)[1]} {v}" for k, v in ledger.items() if k.startswith("dropped/"))
        lines = [f"done: {self.versions} versions, {self.steps} learner steps",
                 f"prompts: {ledger.get('admitted', 0)} admitted, {ledger.get('trained', 0)} trained, "
                 f"{ledger.get('dropped', 0)} dropped" + (f" ({reasons})" if reasons else "")
                 + (f", {ledger['carried']} carried to the checkpoint" if ledger.get("carried") else "")]
        if self.rewards.get("calls"):
            r = self.rewards
            lines.append(f"rewards: {r['calls']} scored, {r.get('errors', 0)} errors, {r.get('timeouts', 0)} timeouts")
            lines += [f"  {example}" for example in r.get("examples", [])]
        failed = [row["version"] for row in self.history
                  if isinstance(row.get("reward/error_share"), (int, float)) and row["reward/error_share"] > warn_share]
        if failed:
            shown = ", ".join(map(str, failed[:10])) + (" …" if len(failed) > 10 else "")
            lines.append(f"! more than {warn_share:.0%} of the rewards failed in {len(failed)} versions ({shown}); "
                         "see reward/errors and reward/timeouts in metrics.jsonl")
        if self.dead_agents:
            lines.append(f"dead agents: {', '.join(self.dead_agents)}")
        for r in self.trainer_recoveries:
            how = "run's processes started again" if r.get("restarted") else "trainer group re-formed"
            lines.append(f"{how} at version {r['version']} (step {r['step']}) in {r['seconds']:.1f} s: {r['why']}")
        return "\n".join(lines)

    def interrupted_line(self) -> str:
        written = (f"checkpoint {pathlib.Path(self.checkpoint).name} written; resume with --resume"
                   if self.checkpoint else "no new checkpoint (nothing trained since the start, or no run directory)")
        return f"interrupted ({self.interrupted}) at version {self.versions}; {written}"


class Controller:
    def __init__(self, parts: RunParts, state: LearnerState, config: AsyncConfig, *, run_log: RunLog | None = None,
                 checkpoints: CheckpointPolicy = CheckpointPolicy(), stop: StopRequest | None = None,
                 window_steps: int = 0, evals: EvalSchedule | None = None, layout: Layout | None = None,
                 history_limit: int = 1000):
        """`run_log`: where each version's metrics go, and the run's wall clock (None: nowhere; the clock starts
        now). `window_steps`: learner steps since the last publication (a resume restores it). `evals`: the
        held-out evaluations (None: --eval.* off). `layout`: the run's devices, for the planner's view (None:
        none). `history_limit`: the versions' metrics the summary keeps (every one is in the log)."""
        config.validate()
        self.queue, self.roster, self.publisher = parts.queue, parts.roster, parts.publisher
        self.trainers, self.agent_metrics = parts.trainers, parts.agent_metrics
        self.state, self.config = state, config
        self.run_log: RunLog = run_log if run_log is not None else QuietLog()
        self.checkpoints = checkpoints
        self.stop = stop if stop is not None else StopRequest()
        self.window_steps = window_steps
        self.evals = evals
        self.plan = None if layout is None else PlanAdvisor(
            layout, compiled=state.config.compile_layers and state.device.type == "cuda")
        self.history: collections.deque[dict] = collections.deque(maxlen=history_limit)
        self.final_books: dict | None = None  # the ledger as the last checkpoint wrote it
        self.saved_at_step = -1  # the learner step of the last checkpoint this run wrote
        self.started_at_step = state.step
        self.drift = DriftRate()  # the drift budget's estimate (re-learnt after a resume)
        self.kept_books_s: float | None = None  # the last version boundary's restart point, when the ranks keep one

    def request_stop(self, reason: str) -> None:
        self.stop.set(reason)

    # -------------------------------------------------------------------------------- the loop
    def _check(self) -> None:
        if self.roster.fatal is not None:
            raise self.roster.fatal

    def _take(self, n: int) -> tuple[list[Group], float] | None:
        """n groups (after dynamic sampling) and the seconds spent waiting for them; None when the window must
        end now (no live agent, one waiting for its first weights)."""
        start, out, dropped_total = time.monotonic(), [], 0
        deadline = start + self.config.take_timeout_s
        while len(out) < n:
            self._check()
            if self.stop.is_set():
                self.queue.put_back(out)
                raise Interrupted(self.stop.reason)
            if not self.roster.live() and self.roster.joining():
                self.queue.put_back(out)
                log.warning("no live rollout agent; publishing early to start %s", ", ".join(self.roster.joining()))
                return None
            try:
                groups = self.queue.take(n - len(out), timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
            except QueueTimeout as err:
                if time.monotonic() > deadline:
                    self.queue.put_back(out)
                    raise BatchTimeout(batch_timeout_message(
                        waited_s=time.monotonic() - start, want=n, have=len(out) + err.have,
                        in_flight=err.in_flight, mini_batch_size=self.state.config.mini_batch_size,
                        require_batches=self.config.require_batches,
                        take_timeout_s=self.config.take_timeout_s)) from None
                continue
            algo = self.state.algorithm
            if algo.filter_groups:
                groups, dropped = filter_groups(groups)
                for g in dropped:
                    self.queue.drop(g, "filtered")
                dropped_total += len(dropped)
                if algo.max_num_gen_batches and dropped_total >= algo.max_num_gen_batches * n:
                    self.queue.put_back(out + groups)
                    raise RuntimeError(
                        f"dynamic sampling (--algorithm.filter-groups) dropped {dropped_total} groups whose samples all "
                        f"scored alike while filling one step of {n} groups ({len(out) + len(groups)} kept): check "
                        "the reward function and the data's difficulty, or raise --algorithm.max-num-gen-batches "
                        f"{algo.max_num_gen_batches} (0: no limit)")
            out += groups
        return out, time.monotonic() - start

    def _learner_step(self) -> dict | None:
        n = self.config.require_batches * self.state.config.mini_batch_size
        taken = self._take(n)
        if taken is None:
            return None
        groups, waited = taken
        start = time.monotonic()
        self.state, metrics = self.trainers.step(self.state, groups)
        self.queue.trained(groups)
        self.window_steps += 1
        self.run_log.log_samples(groups, metrics)
        versions = [(g.min_version, g.max_version) for g in groups]
        lags = [self.state.version - lo for lo, _ in versions]
        for lag in set(lags):  # histogram of trained groups' version lag (summed over a window, then a run)
            metrics[f"training/version_lag/hist/{lag}"] = lags.count(lag)
        by_length = lag_by_length((len(c.token_ids), longest, self.state.version - c.min_version)
                                  for g in groups for longest in [max(len(c.token_ids) for c in g.completions)]
                                  for c in g.completions if c.versions)
        for bucket, sums in by_length.items():  # samples' lag by response length (summed likewise)
            for field, value in sums._asdict().items():
                metrics[f"{LAG_BY_LENGTH}{bucket}/{field}"] = value
        metrics.update({
            "timing_s/gen": waited, "timing_s/update_actor": time.monotonic() - start,
            "fully_async/partial/partial_ratio": sum(lo != hi for lo, hi in versions) / len(versions),
            "fully_async/partial/max_partial_span": max(hi - lo for lo, hi in versions),
            "training/version_lag/max_group": max(self.state.version - lo for lo, _ in versions),
            "perf/response_tokens": sum(len(c.token_ids) for g in groups for c in g.completions),
        })
        if self.config.drift_budget is not None:
            metrics.update(self._bound_drift(metrics))
        return metrics

    def _bound_drift(self, metrics: dict) -> dict:
        """The drift budget: learn the drift a version of lag adds from this step, and hold the next publications
        to the lag that fits the budget (`asyncrl.algos.drift_lag_cap`)."""
        kl, lag = metrics.get("actor/behaviour_kl"), metrics.get("training/version_lag/mean")
        if kl is not None and lag is not None:
            self.drift = drift_rate_update(self.drift, kl=float(kl), mean_lag=float(lag))
        cap = drift_lag_cap(self.config.drift_budget, self.drift)
        self.queue.set_drift_cap(cap)
        out = {"fully_async/drift/kl_per_version": self.drift.per_version}
        if cap is not None:  # none until a lagged step was seen
            out["fully_async/drift/lag_cap"] = cap
        return out

    def _window(self) -> dict:
        """One version window: the rest of `trigger` learner steps (more while the lag gate is closed), then
        publish."""
        start = time.monotonic()
        steps: list[dict] = []
        while self.window_steps < self.config.trigger_parameter_sync_step:
            metrics = self._learner_step()
            if metrics is None:
                break
            steps.append(metrics)
        else:
            while not self.queue.lag_gate_open(self.state.version + 1):
                # hold the publication back; open a new admission window at the same version so the
                # trainer stays fed while the old work finishes and is consumed
                self.queue.new_version(self.state.version)
                metrics = self._learner_step()
                if metrics is None:
                    break
                steps.append(metrics)
        sync_start = time.monotonic()
        sync = self.publish(self.state.version + 1)
        evaluated = self._evaluated(self.evals.after_publication(self.state.version)) if self.evals else {}
        metrics = _merge(steps)
        total = time.monotonic() - start
        tokens = sum(m["perf/total_num_tokens"] for m in steps)
        for extra in (sync, self.queue.metrics(), self.roster.metrics(), self.agent_metrics()):
            metrics.update(extra)
        metrics.update({"timing_s/step": total, "perf/time_per_step": total, "perf/throughput": tokens / total,
                        "trainer/idle_ratio": sum(m["timing_s/gen"] for m in steps) / total,
                        "timing_s/param_sync_total": time.monotonic() - sync_start,
                        "time/wall_s": self.run_log.wall_s()})
        if self.kept_books_s is not None:  # the boundary before this window's (`_keep_books`)
            metrics["timing_s/restart_point"] = self.kept_books_s
        if self.plan is not None:
            metrics.update(self.plan.view(metrics, self.state.version))
        metrics.update(evaluated)
        return metrics

    def _evaluated(self, rows: list[dict]) -> dict:
        """The metrics of evaluations that ended, stamped with the wall clock: the newest one's for this
        version's row (returned), an earlier one that ended in the same window logged as a row of its own."""
        rows = [{**row, "val/wall_s": self.run_log.wall_s()} for row in rows]
        for row in rows[:-1]:
            self.run_log(row, self.state.version)
        return rows[-1] if rows else {}

    def _record_evaluations(self, rows: list[dict]) -> None:
        """Evaluations that ended after the last version: a row of their own (and in the summary's history)."""
        metrics = self._evaluated(rows)
        if metrics:
            self.run_log(metrics, self.state.version)
            self.history.append({"version": self.state.version, **metrics})

    def publish(self, version: int) -> dict:
        metrics = self.publisher.publish(self.state, version)
        self.state.version = version
        self.queue.new_version(version)
        self.window_steps = 0
        return metrics

    def train(self) -> TrainingEnd:
        """Train until `total_versions` publications (or `time_budget_s`, or a stop request); then admit nothing
        more."""
        start, budget = time.monotonic(), self.config.time_budget_s
        interrupted = checkpoint = None
        if self.evals is not None:
            self.evals.start(self.state.version)
        self._keep_books()
        while self.state.version < self.config.total_versions:
            if self.stop.is_set():
                interrupted = self.stop.reason
                break
            if budget is not None and time.monotonic() - start >= budget:
                log.info("time budget of %.0f s spent after version %d", budget, self.state.version)
                break
            try:
                metrics = self._window()
            except Interrupted as stop:
                interrupted = str(stop)
                break
            self.history.append({"version": self.state.version, **metrics})
            self.run_log(metrics, self.state.version)
            self._keep_books()
            if self.checkpoints.due(self.state.version):
                if self.state.version >= self.config.total_versions:
                    self.queue.close()  # the last checkpoint is the end of admissions: it carries what is left
                checkpoint = self.checkpoint()
        self.queue.close()
        if interrupted is None and self._trained_unsaved():
            checkpoint = self.checkpoint()  # a run that ends normally keeps what it trained, whatever checkpoint_every
        if interrupted is None and self.evals is not None:
            self.evals.finish(self.state.version, publish=lambda version: self.publisher.publish(self.state, version),
                              stop=self.stop, timeout_s=self.config.sync_timeout_s, record=self._record_evaluations)
        if interrupted is not None:
            log.warning("stopping: %s; finishing at version %d (step %d)", interrupted, self.state.version,
                        self.state.step)
            if self._trained_unsaved():
                checkpoint = self.checkpoint()  # nothing trained since the start (or the resume): nothing to save
        return TrainingEnd(interrupted, str(checkpoint) if checkpoint else None)

    def _trained_unsaved(self) -> bool:
        """Whether the run has a directory and trained since the start (or the resume) without a checkpoint of
        its current state: the last checkpoint written is of an earlier step."""
        return self.checkpoints.run_dir is not None and self.state.step > max(self.started_at_step,
                                                                              self.saved_at_step)

    def _keep_books(self) -> None:
        """A version boundary's restart point (`Trainers.keep_books`); its seconds go into the next version's row."""
        self.kept_books_s = self.trainers.keep_books(self.state, self._books)

    def _books(self) -> dict:
        """What a checkpoint keeps beside the learner (JSON-able): the queue and its ledger, the run's counters and
        clock, the evaluations' state."""
        extra = {"queue": self.queue.state_dict(),
                 "run": {"window_steps": self.window_steps, "wall_s": self.run_log.wall_s()}}
        if self.evals is not None:
            extra["evals"] = self.evals.state_dict()
        return extra

    def checkpoint(self) -> pathlib.Path:
        extra = self._books()
        queue = extra["queue"]
        path = self.trainers.checkpoint(str(self.checkpoints.run_dir), self.state, extra, self.checkpoints.keep)
        self.final_books, self.saved_at_step = queue, self.state.step
        log.info("checkpoint %s written (version %d, step %d, %d queued, %d in flight)", pathlib.Path(path).name,
                 self.state.version, self.state.step, len(queue["queue"]), len(queue["unfinished"]))
        return path

    def summary(self, end: TrainingEnd) -> RunSummary:
        """The run's summary, once the agents have stopped (nothing more can arrive). A stop requested after
        the loop ended (during the shutdown) still counts as an interruption."""
        interrupted = end.interrupted or (self.stop.reason if self.stop.is_set() else None)
        return RunSummary(self.state.version, self.state.step, self._close_books(end), self.roster.dead(),
                          list(self.history), interrupted=interrupted, checkpoint=end.checkpoint,
                          agents=self.roster.report(), rewards=self.roster.rewards.totals())

    def _close_books(self, end: TrainingEnd) -> dict:
        """When the run ended on a checkpoint, the prompts it holds (queued or unfinished) are *carried*: a
        resume re-admits exactly these. Otherwise each unfinished prompt is dropped with reason "run_end".
        Returns the ledger summary."""
        if end.checkpoint is not None and self.final_books is not None and \
                self.final_books["version"] == self.state.version:
            books = self.final_books
            states = collections.Counter(books["ledger"]["state"].values())
            return {"admitted": len(books["ledger"]["state"]), "trained": states["trained"],
                    "dropped": states["dropped"], "carried": len(books["queue"]) + len(books["unfinished"]),
                    "in_flight": 0, "pending": 0, "queued": 0, "carried_to_checkpoint": True}
        return self.queue.drop_unfinished("run_end")


def _merge(steps: list[dict]) -> dict:
    """Average per-step metrics over the window; sum timings and counts; keep the last of counters."""
    out: dict = {}
    for key in dict.fromkeys(k for m in steps for k in m):
        values = [m[key] for m in steps if key in m]
        if key.startswith(("timing_s/", "training/version_lag/hist/", LAG_BY_LENGTH)) or key in ("perf/total_num_tokens",
                                                                                   "perf/response_tokens"):
            out[key] = sum(values)
        elif key.endswith(("/max", "max_partial_span", "max_group")):
            out[key] = max(values)
        elif key in ("training/global_step", "actor/skipped_updates", "actor/lr", "reward/errors",
                     "fully_async/drift/kl_per_version", "fully_async/drift/lag_cap"):
            out[key] = values[-1]
        else:
            out[key] = sum(values) / len(values)
    return out
