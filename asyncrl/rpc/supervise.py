"""The launcher of a run on one machine and its supervision: `launch(spec)` spawns every rank (their bodies are in
`asyncrl.rpc.roles`), forwards signals, restarts dead agents, enforces the optional wall-clock cap, never leaves
a process behind, and returns rank 0's summary.

* Signals: the first SIGTERM / SIGINT / SIGHUP is forwarded to every rank (each runs in a process group of its
  own, so a terminal's Ctrl-C reaches it once, through here); rank 0 finishes or abandons the current step,
  writes a checkpoint and reports; the others follow its shutdown. A second signal kills everything at once.
* No orphans: every rank dies with the launcher, even on kill -9 of the launcher (`die_with_parent`); at the
  end, a rank that does not exit by itself (stopped, hung) is killed — SIGKILL ends a stopped process too.
* Restarts: an agent process that exits, or that rank 0 declares dead while its process still exists (a hung
  one), is ended and started again after a back-off (`restart_backoff_s`, doubling per slot), up to
  `restart_agents` restarts in all; the new process joins the running job under the next incarnation name.
  An agent that had joined the run is restarted only once rank 0 has declared it dead (and so evicts it from
  the RPC group): a replacement that joined before would wait on the dead member.
* A trainer follower that exits, or whose heartbeat (through the store) stops for `agent_timeout_s` (stopped,
  hung), is named. With `--trainer.max-recoveries N` the launcher then ends every follower, posts the fault to the
  store and starts followers 1..T−1 as the trainer group's next generation, which rank 0 re-forms and restores
  (`asyncrl.rpc.failover`), up to N times; otherwise the run ends: resume from the last checkpoint.
* Trainer rank 0 that exits without a result, or stays stopped (SIGSTOP) for `agent_timeout_s`: with
  `--trainer.max-recoveries N` every other process is ended and the run's processes start again from the newest
  version boundary every trainer rank holds a restore point of (`asyncrl.rpc.restart`); otherwise the run ends.
* `max_run_time_s`: when it passes, the run is stopped as by a SIGTERM (checkpoint, then exit).
* `run_dir/processes.json` lists every process of the run (role, pid), for operators.
* Start method (`--placement.start-method`): forkserver (the default) forks every rank, restarted agents
  included, from one server process that imported torch and the role modules once per launch; spawn starts a
  fresh interpreter per process (`asyncrl.rpc.forkserver`: what each way keeps, and how the guarantees above
  hold for forks).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import pathlib
import pickle
import queue as queue_mod
import secrets
import shutil
import signal
import time

from asyncrl.checkpoint.snapshot_files import snapshot_directory
from asyncrl.rpc.assembly import resolve_resume
from asyncrl.runtime.controller import RunSummary
from asyncrl.rpc.exposure import TOKEN_ENV, RunToken, bind_address, is_loopback, new_token, read_token
from asyncrl.rpc.failover import Silence
from asyncrl.rpc.forkserver import RoleProcess, process_starter
from asyncrl.rpc.restart import Restart, StoppedWatch, newest_restorable, restart_refusal
from asyncrl.rpc.roles import reserve_port, run_agent_process, run_trainer
from asyncrl.runtime.kill_points import check_kill_point_env
from asyncrl.runtime.lifecycle import RunFailed, is_stopped, on_signals
from asyncrl.runtime.run_log import RunLog
from asyncrl.rpc.spec import RunSpec
from asyncrl.rpc.store import RunStore, is_serving

__all__ = ["launch", "Supervisor", "RunKilled"]

log = logging.getLogger(__name__)


class RunKilled(RuntimeError):
    """A second signal ended the run at once (every process killed, no checkpoint)."""

    def __init__(self, signal_name: str):
        super().__init__(f"second signal ({signal_name}): the run was killed without a checkpoint")
        self.signal_name = signal_name


def _agent_entry(host: str, port: int, device: str, slot: int, parent_pid: int, token: RunToken,
                 interface: str) -> None:
    os.setpgid(0, 0)  # terminal signals reach the launcher only, which forwards them once
    run_agent_process(host, port, device=device, slot=slot, parent_pid=parent_pid, token=token, interface=interface)


END_LINGER_S = 1.0
"""Seconds trainer rank 0 keeps its process, and with it the run's store, after the run has ended: an agent
reads the store every 0.2 s and ends when it finds the end marked there, or when rank 0's request to exit ends
it 0.2 s after it was asked; a store that vanished first would have it report the run's store gone (exit 1). A
fork ends at once when its body returns (a fresh interpreter's teardown used to take about this long)."""


def _trainer_entry(rank: int, spec: RunSpec, host: str, store_port: int, rpc_port: int, results,
                   parent_pid: int, token: RunToken, run_log: RunLog | None, generation: int,
                   restore_points: str | None, restart: Restart | None) -> None:
    os.setpgid(0, 0)
    run_trainer(rank, spec, host, store_port, rpc_port, results, parent_pid=parent_pid, token=token, run_log=run_log,
                generation=generation, restore_points=restore_points, restart=restart)
    if rank == 0:
        time.sleep(END_LINGER_S)


@dataclasses.dataclass
class _Child:
    role: str
    slot: int
    process: RoleProcess
    restarts: int = 0


class Supervisor:
    def __init__(self, spec: RunSpec, *, run_log: RunLog | None = None, poll_s: float = 0.2,
                 exit_grace_s: float = 15.0):
        self.spec, self.poll_s, self.exit_grace_s = spec, poll_s, exit_grace_s
        self.run_log = run_log  # travels to trainer rank 0, the process that logs
        self.ctx = multiprocessing.get_context("spawn")
        self.results = self.ctx.Queue()
        self.host = spec.placement.master_addr
        self.token = read_token(spec.placement.token_file, flag="--placement.token-file")
        if self.token is None and not is_loopback(self.host):
            raise ValueError(f"--placement.master-addr {self.host} is not loopback: a run other hosts can reach needs "
                             f"a token you give ({TOKEN_ENV} or --placement.token-file)")
        self.token = self.token or new_token()
        # held until the run ends, so that no other run on this host is given them (a --placement.join-port
        # the user chose is theirs to keep free)
        self.reserved = [reserve_port(bind_address(self.host)) for _ in range(1 if spec.placement.join_port else 2)]
        ports = [s.getsockname()[1] for s in self.reserved]
        self.store_port = spec.placement.join_port or ports.pop()
        self.rpc_port = ports.pop()
        self.children: list[_Child] = []
        self.restarts_left = spec.placement.restart_agents
        # (when, slot, restarts so far, the pid rank 0 must declare dead first or None)
        self.pending_restarts: list[tuple[float, int, int, int | None]] = []
        self._declared: set[int] = set()  # pids of agents rank 0 declared dead
        self.signals: list[str] = []
        self.store: RunStore | None = None
        self._dead_seen = 0
        self._beats: dict[int, Silence] = {}  # trainer follower -> its heartbeat as watched
        self._rank0_watch = StoppedWatch(spec.async_.agent_timeout_s)  # trainer rank 0 stopped as a whole
        self.generation = 0  # the trainer group's: one more after each recovered fault
        self.recoveries_left = spec.trainer.max_recoveries
        self.restore_points = str(snapshot_directory(secrets.token_hex(8))) if spec.trainer.max_recoveries else None
        self._stopping = False
        self.stop_reason: str | None = None  # a limit the launcher enforced (max_run_time_s)
        # last: a fork server is a process, ended by run(); it imports this module (and the role bodies) once and
        # holds the results queue the ranks report on
        self.starter = process_starter(spec.placement.start_method, preload=(__name__,), inherited=(self.results,),
                                       start_timeout_s=spec.startup_timeout_s)

    # ------------------------------------------------------------------------------------ processes
    def _spawn_trainer(self, rank: int, restart: Restart | None = None) -> None:
        p = self.starter.start(_trainer_entry, (rank, self.spec, self.host, self.store_port, self.rpc_port,
                                                self.results if rank == 0 else None, self.starter.parent_pid,
                                                self.token, self.run_log if rank == 0 else None, self.generation,
                                                self.restore_points, restart),
                               name=f"asyncrl-trainer{rank}")
        self.children.append(_Child(f"trainer{rank}", rank, p))

    def _spawn_agent(self, slot: int, restarts: int = 0) -> None:
        device = self.spec.agent_spec(slot).device
        p = self.starter.start(_agent_entry, (self.host, self.store_port, device, slot, self.starter.parent_pid,
                                              self.token, self.spec.placement.interface), name=f"asyncrl-agent{slot}")
        self.children.append(_Child(f"agent{slot}", slot, p, restarts))
        self._write_processes()

    def _write_processes(self) -> None:
        if self.spec.run_dir is None:
            return
        path = pathlib.Path(self.spec.run_dir)
        path.mkdir(parents=True, exist_ok=True)
        rows = [{"role": c.role, "slot": c.slot, "pid": c.process.pid, "restarts": c.restarts,
                 "alive": c.process.is_alive()} for c in self.children]
        (path / "processes.json").write_text(json.dumps({"launcher": os.getpid(), "forkserver": self.starter.server_pid,
                                                         "restore_points": self.restore_points, "processes": rows},
                                                        indent=2))

    def _signal_all(self, sig: int) -> None:
        for c in self.children:
            if c.process.is_alive():
                try:
                    os.kill(c.process.pid, sig)
                except ProcessLookupError:
                    pass

    # --------------------------------------------------------------------------------- signals, limits
    def _on_signal(self, name: str) -> None:
        self.signals.append(name)
        log.warning("%s received: stopping the run (rank 0 writes a checkpoint); a second signal kills it now", name)
        self._signal_all(signal.Signals[name])

    def _stop_for(self, reason: str) -> None:
        if not self._stopping:
            self._stopping = True
            self.stop_reason = reason
            log.warning("%s: stopping the run like a SIGTERM (checkpoint, then exit)", reason)
            self._signal_all(signal.SIGTERM)

    # ----------------------------------------------------------------------------------------- run
    def run(self) -> RunSummary:
        installed = on_signals(self._on_signal, second_exit=False)
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)} \
            if installed else {}
        start = time.monotonic()
        try:
            for rank in range(self.spec.num_trainers):
                self._spawn_trainer(rank)
            for slot in range(self.spec.num_agent_processes):
                self._spawn_agent(slot)
            outcome = self._supervise(start)
        except BaseException:
            self._kill_all()
            raise
        finally:
            self._finish()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if isinstance(outcome, BaseException):
            raise outcome
        if self.signals:  # the launcher knows the signal: rank 0 saw only the SIGTERM it sent on
            return dataclasses.replace(outcome, interrupted=self.signals[0])
        if self.stop_reason is not None and outcome.interrupted is not None:
            return dataclasses.replace(outcome, interrupted=self.stop_reason)  # a stop the launcher decided
        return outcome

    def _rank0(self) -> RoleProcess:
        return next(c.process for c in self.children if c.role == "trainer0")

    def _supervise(self, start: float):
        while True:
            if len(self.signals) > 1:
                raise RunKilled(self.signals[-1])
            try:
                return self._blamed(pickle.loads(self.results.get(timeout=self.poll_s)))
            except queue_mod.Empty:
                pass
            rank0 = self._rank0()
            if rank0.is_alive() and (stopped := self._rank0_watch.why(rank0.pid)) is not None:
                rank0.kill()  # SIGKILL ends a stopped process too
                rank0.join(5.0)
                refused = self._restart_run(stopped, time.monotonic())
                if refused is not None:
                    raise RuntimeError(f"{stopped} ({refused})")
                continue
            if not rank0.is_alive():
                found = time.monotonic()
                try:  # its last message may still be in the pipe
                    return pickle.loads(self.results.get(timeout=2.0))
                except queue_mod.Empty:
                    pass
                why = f"trainer rank 0 exited with code {rank0.exitcode}"
                refused = self._restart_run(why, found)
                if refused is not None:
                    raise RuntimeError(f"{why} before reporting a result ({refused}); see its log above")
                continue
            cap = self.spec.placement.max_run_time_s
            if cap is not None and time.monotonic() - start > cap:
                self._stop_for(f"max_run_time_s={cap:g} reached")
            self._check_children()
            self._check_trainer_beats()
            self._restart_due()

    def _follower_exit(self) -> tuple[int, str] | None:
        """The trainer follower that exited with an error first, and what to say of it and the others, if any did.
        A follower whose collective a dead peer broke exits with code 1 right after it: the others are named first."""
        exited = sorted((c.process.exitcode == 1, c.slot, c.process.exitcode) for c in self.children
                        if c.role.startswith("trainer") and c.slot > 0 and c.process.exitcode not in (None, 0))
        if not exited:
            return None
        (_, slot, code), *others = exited
        also = "".join(f"; rank {s} then exited with code {c}" for _, s, c in others)
        return slot, f"trainer rank {slot} exited with code {code}{also}"

    def _ended(self, why: str) -> str:
        spent = self.spec.trainer.max_recoveries
        hint = f" (--trainer.max-recoveries {spent} spent)" if spent else ""
        return f"{why}; the run cannot go on without it{hint} (resume from its last checkpoint with --resume)"

    def _restart_run(self, why: str, detected_at: float) -> str | None:
        """Trainer rank 0 died (`why`) without a result: with a recovery left and a version boundary every rank holds
        a restore point of, end every other process and start the run's processes again from it (`asyncrl.rpc.restart`).
        Returns why not (the run then ends), or None."""
        point = newest_restorable(self.restore_points, self.spec.num_trainers) if self.restore_points else None
        refused = restart_refusal(max_recoveries=self.spec.trainer.max_recoveries, recoveries_left=self.recoveries_left,
                                  stopping=self._stopping or bool(self.signals), point=point)
        if refused is not None:
            return refused
        for c in self.children:
            if c.process.is_alive():
                c.process.kill()
        for c in self.children:
            c.process.join(5.0)
        self.children = []
        self.recoveries_left -= 1
        self.generation += 1
        self.store, self._dead_seen, self._declared, self.pending_restarts = None, 0, set(), []
        self._rank0_watch.reset()
        self._beats.clear()
        log.warning("%s: starting the run's processes again as generation %d from step %d (%d recoveries left)", why,
                    self.generation, point.step, self.recoveries_left)
        restart = Restart(self.generation, why, point.step, str(point.books), detected_at)
        for rank in range(self.spec.num_trainers):
            self._spawn_trainer(rank, restart if rank == 0 else None)
        for slot in range(self.spec.num_agent_processes):
            self._spawn_agent(slot)
        return None

    def _trainer_fault(self, slot: int, why: str) -> None:
        """Follower `slot` died or hangs (`why`): with a recovery left, end every follower and start the trainer
        group's next generation (rank 0 re-forms the group with it and restores the committed step), without `slot`'s
        device under --trainer.failover shrink; else end the run. While rank 0 is dead, its death is what the
        launcher acts on (`_restart_run`): a follower's collective with it broke."""
        if not self._rank0().is_alive():
            return
        store = self._store()
        if self.recoveries_left <= 0 or self._stopping or self.signals or store is None:
            raise RuntimeError(self._ended(why))
        self.recoveries_left -= 1
        self.generation += 1
        if self.spec.trainer.failover == "shrink":
            devices = [d for rank, d in enumerate(self.spec.trainer_devices) if rank != slot]
            self.spec = dataclasses.replace(self.spec, trainer_devices=devices)
        for c in [c for c in self.children if c.role.startswith("trainer") and c.slot > 0]:
            if c.process.is_alive():
                c.process.kill()  # on gloo only a peer's exit frees a survivor blocked on it
            c.process.join(5.0)
            self.children.remove(c)
        self._beats.clear()
        try:
            store.post_trainer_fault(self.generation, why, self.spec.trainer_devices)
        except Exception as err:  # noqa: BLE001 - rank 0 (the store) is gone: so is the run
            raise RuntimeError(self._ended(why)) from err
        log.warning("%s: starting trainer ranks 1..%d as generation %d of the trainer group (%d recoveries left)", why,
                    self.spec.num_trainers - 1, self.generation, self.recoveries_left)
        for rank in range(1, self.spec.num_trainers):
            self._spawn_trainer(rank)
        self._write_processes()

    def _blamed(self, outcome):
        """Rank 0's outcome; when it is a failure caused by a follower's death (rank 0's collective with it broke
        first), the follower's exit is what the run reports."""
        if not isinstance(outcome, BaseException) or isinstance(outcome, RunFailed) or self.spec.num_trainers == 1:
            return outcome  # a RunFailed says why in full (a fault that was not recovered from, among others)
        deadline = time.monotonic() + 2.0  # the follower's exit can reach this process after rank 0's report
        while (exited := self._follower_exit()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if exited is None:
            return outcome
        why = exited[1]
        first = (str(outcome).splitlines() or [type(outcome).__name__])[0][:200]
        err = RuntimeError(f"{self._ended(why)} (trainer rank 0 then failed: {first})")
        err.__cause__ = outcome
        return err

    def _check_children(self) -> None:
        if not self._rank0().is_alive():
            return  # the processes exiting now follow rank 0's death, which the next check acts on
        if (exited := self._follower_exit()) is not None:
            self._trainer_fault(*exited)
        self._end_dead_agents()
        for c in list(self.children):
            if c.role.startswith("agent") and not c.process.is_alive() and not self._stopping:
                self.children.remove(c)
                self._write_processes()
                self._tell_exit(c)
                if self.restarts_left > 0 and not self.signals:
                    self.restarts_left -= 1
                    delay = self.spec.placement.restart_backoff_s * 2 ** c.restarts
                    waits_for = c.process.pid if self._joined(c.process.pid) else None
                    self.pending_restarts.append((time.monotonic() + delay, c.slot, c.restarts + 1, waits_for))
                    log.warning("agent slot %d (pid %d) exited with code %s; restarting it in %.1f s (%d restarts "
                                "left)", c.slot, c.process.pid, c.process.exitcode, delay, self.restarts_left)
                    self._tell_restarts_left()

    def _check_trainer_beats(self) -> None:
        """A trainer follower whose heartbeat stopped for `--async-training.agent-timeout-s` (stopped, or hung with
        its whole process) is named now, rather than by rank 0's collective at the sync timeout."""
        store = None if self._stopping or self.spec.num_trainers == 1 else self._store()
        if store is None:
            return
        for c in self.children:
            if not c.role.startswith("trainer") or c.slot == 0 or not c.process.is_alive():
                continue
            try:
                count = store.trainer_beats(c.slot, self.generation)
            except Exception:  # noqa: BLE001 - rank 0 (the store) is going away
                return
            watch = self._beats.setdefault(c.slot, Silence(self.spec.async_.agent_timeout_s))
            if (silent := watch.past_timeout(count)) is not None:
                self._trainer_fault(c.slot, watch.why(c.slot, c.process.pid, silent))
                return

    def _end_dead_agents(self) -> None:
        """Rank 0 declared these agents dead: with restarts on, end a process that still exists (hung), so it
        can be restarted."""
        if self.spec.placement.restart_agents == 0:
            return
        store = self._store()
        if store is None:
            return
        try:
            reports = store.dead_reports(self._dead_seen)
        except Exception:  # noqa: BLE001 - rank 0 (the store) is going away
            return
        self._dead_seen += reports.consumed
        self._declared.update(report.get("pid") for report in reports)
        pids = {c.process.pid: c for c in self.children}
        for report in reports:
            child = pids.get(report.get("pid"))
            if child is not None and child.process.is_alive():
                log.warning("%s was declared dead (%s); ending its process %d", report["name"], report["why"],
                            child.process.pid)
                child.process.kill()

    def _restart_due(self) -> None:
        now = time.monotonic()
        for entry in list(self.pending_restarts):
            when, slot, restarts, waits_for = entry
            if now >= when and waits_for in (None, *self._declared) and not self.signals and not self._stopping:
                self.pending_restarts.remove(entry)
                self._spawn_agent(slot, restarts)

    def _store(self) -> RunStore | None:
        """A client of the run's store, or None while rank 0 does not serve it (not yet, no longer, or stopped: a
        client call to a store that went away retries its connection for about 15 s, and one to a stopped store
        waits out its timeout, which would hold up the launcher's loop, and with it the restart, that long)."""
        rank0 = self._rank0()
        if not rank0.is_alive() or is_stopped(rank0.pid):
            return None
        if self.store is None:
            if not is_serving(self.host, self.store_port):
                return None  # rank 0 has not served it yet (a failed client connect logs a C++ traceback)
            try:
                self.store = RunStore(self.host, self.store_port, serve=False, timeout_s=5.0)
                self.store.authenticate(self.token)
            except Exception:  # noqa: BLE001 - rank 0 has not served it yet
                return None
        return self.store

    def _joined(self, pid: int) -> bool:
        """Whether the agent process `pid` joined the run (announced itself to rank 0)."""
        store = self._store()
        try:
            return store is not None and any(a.get("pid") == pid for a in store.announcements(0))
        except Exception:  # noqa: BLE001 - rank 0 (the store) is going away
            return False

    def _tell_exit(self, child: _Child) -> None:
        """Rank 0 declares the agent dead at once, instead of after agent_timeout_s of silence."""
        store = self._store()
        if store is not None:
            try:
                store.report_exit(child.process.pid, child.process.exitcode)
            except Exception:  # noqa: BLE001 - rank 0 is going away
                pass

    def _tell_restarts_left(self) -> None:
        store = self._store()
        if store is not None:
            try:
                store.set_restarts_left(self.restarts_left + len(self.pending_restarts))
            except Exception:  # noqa: BLE001
                pass

    # ------------------------------------------------------------------------------------------ end
    def _finish(self) -> None:
        """Wait for every rank to exit by itself (they follow rank 0's shutdown), then kill what is left; a
        stopped process (SIGSTOP) cannot exit by itself and is killed at once."""
        self._stopping = True
        for c in self.children:
            if c.process.is_alive() and is_stopped(c.process.pid):
                log.warning("%s (pid %d) is stopped; killing it", c.role, c.process.pid)
                c.process.kill()
        deadline = time.monotonic() + self.exit_grace_s
        for c in self.children:
            c.process.join(max(0.1, deadline - time.monotonic()))
        self._kill_all()
        self._write_processes()
        if self.restore_points is not None:
            shutil.rmtree(self.restore_points, ignore_errors=True)
        self.starter.close()
        for s in self.reserved:
            s.close()

    def _kill_all(self) -> None:
        for c in self.children:
            if c.process.is_alive():
                log.warning("%s (pid %d) did not exit; killing it", c.role, c.process.pid)
                c.process.kill()  # SIGKILL: ends a stopped or hung process too
        for c in self.children:
            c.process.join(5.0)


def launch(spec: RunSpec, *, run_log: RunLog | None = None) -> RunSummary:
    """Spawn one process per role on this machine, supervise them (signals, restarts, the wall-clock cap) and
    return rank 0's summary. Agents that die are tolerated (their work is re-admitted; with `restart_agents`
    they are restarted); any other failure raises. `run_log` (pickled before it opens anything) logs the
    metrics in trainer rank 0, which closes its copy at the end."""
    # torch's C++ warnings (RRef leaks at exit, closed pipes of agents that ended) are noise in a run's log: the
    # run names its faults itself. Set TORCH_CPP_LOG_LEVEL=INFO (or WARNING) to see them. Set before the fork
    # server starts: torch reads it when it loads.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    check_kill_point_env(spec.num_trainers)  # a failover drill's kill point, refused before any spawn if malformed
    return Supervisor(resolve_resume(spec), run_log=run_log).run()  # a resume without a checkpoint is refused before any spawn
