"""Rank 0, the head of a multi-process run: it serves the run's store, holds the controller, the queue, the
roster and the parameter server, creates the other ranks' role objects with `rpc.remote`, admits agents, and
shuts the run down.

    # in trainer rank 0, once the trainer group and RPC are up:
    summary = run_head(spec, store, stop, token, nonce, run_log=tracker)
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from asyncrl.tracking.console import phase
from asyncrl.planning import layout_of
from asyncrl.rpc.agent_server import AgentServer
from asyncrl.rpc.assembly import (build_evals, build_learner_state, build_queue, checkpoint_policy, local_device,
                                  resolve_resume, resume_info)
from asyncrl.rpc.commands import FollowerHost, TrainerGroup, commands_group
from asyncrl.rpc.exposure import RunToken
from asyncrl.rpc.failover import Failover, RestorePoints
from asyncrl.rpc.fleet import Admissions, Fleet
from asyncrl.rpc.membership import RpcMembership
from asyncrl.rpc.param_server import CollectivePublisher, ColocatedPublisher
from asyncrl.rpc.restart import Restart, read_books
from asyncrl.rpc.spec import RunSpec
from asyncrl.rpc.store import RunStore
from asyncrl.runtime.agent import mean_windows
from asyncrl.runtime.controller import Controller, RunParts, RunSummary
from asyncrl.runtime.eval_schedule import EvalSchedule
from asyncrl.runtime.lifecycle import StopRequest
from asyncrl.runtime.roster import Roster
from asyncrl.runtime.run_log import RunLog

__all__ = ["run_head"]

log = logging.getLogger(__name__)


class _Head:
    """What rank 0 builds, in the order it must: followers and the command group (collective with them), its
    own learner shard; then admitting agents (in the background), the resume or restart meanwhile, and the
    publisher once the agents are in."""

    def __init__(self, spec: RunSpec, store: RunStore, stop: StopRequest, token: RunToken, nonce: str,
                 run_log: RunLog | None, restore_points: str | None, restart: Restart | None):
        self.spec, self.store, self.stop, self.run_log, self.restart = spec, store, stop, run_log, restart
        self.token, self.nonce = token, nonce
        self.queue = build_queue(spec)
        self.fleet = Fleet(store, RpcMembership(spec.rpc_timeout_s))
        evals, eval_slots = build_evals(spec)
        self.roster = Roster(self.queue, agent_timeout_s=spec.async_.agent_timeout_s,
                             allow_empty=spec.placement.restart_agents > 0, on_removed=self.fleet.discard,
                             evals=evals, eval_slots=eval_slots)
        self.roster_rref = rpc.RRef(self.roster)
        # colocated, a follower hosts an engine rank 0's roster drives over RPC: rank 0 creates it there; otherwise
        # each follower creates its own and is not in the RPC group at all (`asyncrl.rpc.roles.run_trainer`)
        followers = [rpc.remote(f"trainer{r}", FollowerHost, args=(spec, r, self.roster_rref),
                                timeout=spec.startup_timeout_s) for r in range(1, spec.num_trainers)] \
            if spec.colocate else []
        group = commands_group(spec)  # collective with the followers' constructors
        self.device = local_device(spec.trainer_devices[0])
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))
        phase(f"trainer0: loading the model on {self.device}")
        loading = time.monotonic()
        self.state = build_learner_state(spec, self.device, dist.group.WORLD, initial_weights=restart is None)
        phase(f"trainer0: model ready in {time.monotonic() - loading:.1f} s")
        self.hosted = AgentServer(spec, 0, "agent0", spec.agents[0].device, self.roster_rref, hosted=True) \
            if spec.colocate else None
        self.failover = Failover(spec, store, RestorePoints(restore_points, 0, spec.num_trainers),
                                 device=self.device, build=build_learner_state) if restore_points else None
        self.trainers = TrainerGroup(group, hosted=self.hosted, failover=self.failover)
        for rref in followers:
            rref.rpc_sync(timeout=spec.startup_timeout_s).status()  # built (raises the follower's error)
        self.followers = followers
        self.admissions: Admissions | None = None
        if not spec.colocate:  # agents build their engines while this rank resumes or restores its learner
            self.admissions = Admissions(spec, store, self.fleet, self.roster, self.roster_rref, self.device,
                                         token=token, nonce=nonce)
            self.admissions.start()
        self.resumed_extra: dict = {}
        if restart is not None:
            self.resumed = self._restarted(restart)
        else:
            self.resumed = self._resume()
            if self.failover is not None:  # the first restore point: a fault before the first step goes back here
                self.trainers.commit(self.state)
        self.publisher = self._colocated_publisher() if spec.colocate else self._collective_publisher()
        schedule = None if evals is None else EvalSchedule(evals, self.roster, resumed=self.resumed_extra.get("evals"),
                                                            version=self.state.version)
        self.controller = Controller(
            RunParts(self.queue, self.roster, self.publisher, self.trainers, self._agent_metrics), self.state,
            spec.async_, run_log=run_log, checkpoints=checkpoint_policy(spec), stop=stop,
            window_steps=self.resumed.window_steps if self.resumed else 0, evals=schedule,
            layout=layout_of(spec.trainer_devices, [a.device for a in spec.agents], spec.colocate))

    def _resume(self):
        chosen = resolve_resume(self.spec).resume_from  # the launcher chose it before spawning this process
        if chosen is None:
            return None
        path = pathlib.Path(chosen)
        extra = self.trainers.load(str(path), self.state)
        self.resumed_extra = extra
        self.queue.load_state_dict(extra["queue"])
        self.queue.version = self.state.version
        info = resume_info(path, self.state, extra)
        log.info(info.line())
        print(f"[asyncrl] {info.line()}", flush=True)
        if self.run_log is not None:
            self.run_log.resume(info.version, info.wall_s)
        return info

    def _restarted(self, restart: Restart):
        """Trainer rank 0 died and the launcher started every process again (`asyncrl.rpc.restart`): every rank back
        to the restore point of the restart's version boundary, and the queue, ledger and counters to its books."""
        if self.failover is None:
            raise RuntimeError("a restart needs the run's restore points (--trainer.max-recoveries)")
        record = read_books(restart.books)
        version, extra = int(record["version"]), record["books"]
        self.trainers.restore(self.state, restart, version)
        self.failover.restarted(restart, record)
        self.resumed_extra = extra
        self.queue.load_state_dict(extra["queue"])
        self.queue.version = version
        info = resume_info(pathlib.Path(restart.books), self.state, extra)
        line = (f"trainer rank 0 started again ({restart.why}): every rank back to step {info.step}, version "
                f"{info.version} ({info.queued} groups queued, {info.unfinished} prompts to generate again); the "
                "versions after it are trained again")
        log.warning(line)
        print(f"[asyncrl] {line}", flush=True)
        if self.run_log is not None:
            self.run_log.resume(info.version, info.wall_s)
        return info

    def _engine_dtype(self) -> torch.dtype:
        return getattr(torch, self.spec.agents[0].engine_dtype)

    def _colocated_publisher(self) -> ColocatedPublisher:
        servers = {"agent0": rpc.RRef(self.hosted)}
        for rank, rref in enumerate(self.followers, start=1):
            servers[f"agent{rank}"] = rref.rpc_sync(timeout=self.spec.rpc_timeout_s).hosted_agent()
        for rank, name in enumerate(servers):  # agent r lives in trainer rank r, on its device
            self.roster.add(name, live=True, device=self.spec.trainer_devices[rank])
        self.servers = servers
        return ColocatedPublisher(servers, self.roster, partial_rollout=self.spec.async_.partial_rollout,
                                  timeout=self.spec.async_.sync_timeout_s,
                                  load_fn=lambda state, version: self.trainers.load_hosted(state, self._engine_dtype(),
                                                                                           version))

    def _collective_publisher(self) -> CollectivePublisher:
        self.admissions.wait_for(self.spec.num_agent_processes, self.spec.startup_timeout_s, self.stop)
        return CollectivePublisher(self.fleet, self.roster, partial_rollout=self.spec.async_.partial_rollout,
                                   timeout=self.spec.async_.sync_timeout_s, bucket_mb=self.spec.bucket_mb,
                                   dtype=self._engine_dtype(), weights_fn=self.trainers.weights)

    def _start_agents(self) -> None:
        """Fresh start: the agents built the same initial weights, so they go live at once. Resumed: they get
        the checkpoint's weights first (a publication of the current version)."""
        if self.spec.colocate:
            if self.state.version > 0:
                self.publisher.publish(self.state, self.state.version)
            for name, server in self.servers.items():
                self.roster.synced(name, self.state.version)
                server.rpc_sync(timeout=self.spec.rpc_timeout_s).start()
            return
        if self.state.version > 0:
            self.publisher.publish(self.state, self.state.version)
            return
        for name in self.roster.joining():
            if self.roster.activate(name):
                self.roster.synced(name, 0)
                self.fleet.get(name).server.rpc_sync(timeout=self.spec.rpc_timeout_s).start()

    def _agent_metrics(self) -> dict:
        """Each live agent's window metrics (idle ratio, memory), averaged; a late agent is not waited for
        longer than agent_timeout_s (its health is the roster's business)."""
        servers = self.servers if self.spec.colocate else {n: h.server for n in self.roster.live()
                                                            if (h := self.fleet.get(n)) is not None}
        futures = {n: s.rpc_async(timeout=self.spec.async_.agent_timeout_s).window_metrics()
                   for n, s in servers.items() if self.roster.is_live(n)}
        deadline = time.monotonic() + self.spec.async_.agent_timeout_s
        windows = []
        for name, future in futures.items():
            while not future.done() and self.roster.is_live(name) and time.monotonic() < deadline:
                time.sleep(0.01)
            if future.done():
                try:
                    windows.append(future.wait())
                except Exception as err:  # noqa: BLE001 - a dying agent: the roster will name it
                    log.warning("no metrics from %s: %r", name, err)
        return mean_windows(windows)

    def run(self) -> RunSummary:
        self._start_agents()
        if self.restart is not None:
            self.failover.record_restart(self.restart, self.state)
        self.roster.start()
        try:
            end = self.controller.train()
        finally:
            self._shut_down()
        summary = self.controller.summary(end)
        if self.failover is None:
            return summary
        return dataclasses.replace(summary, trainer_recoveries=[dataclasses.asdict(r) for r in self.failover.recoveries])

    def _shut_down(self) -> None:
        """Stop admitting, stop the followers, stop every agent (its stats), then end the agent processes."""
        self.roster.stop()
        if self.admissions is not None:
            self.admissions.stop()
        try:
            self.trainers.stop()
        except Exception as err:  # noqa: BLE001 - a follower is gone; the launcher ends it
            log.error("could not stop the trainer followers: %r", err)
        servers = self.servers if self.spec.colocate else {n: h.server for n in self.roster.live() + self.roster.joining()
                                                            if (h := self.fleet.get(n)) is not None}
        wait_s = min(self.spec.async_.agent_timeout_s, 30.0)  # a hung agent is not waited for: the launcher ends it
        stops = {n: s.rpc_async(timeout=wait_s).stop() for n, s in servers.items()}
        stopped = []
        for name, future in stops.items():
            try:
                future.wait()
                stopped.append(name)
            except Exception as err:  # noqa: BLE001 - died or hung late: the launcher ends it
                log.error("could not stop agent %s cleanly: %r", name, err)
        if not self.spec.colocate:  # end the agent processes before they leave the roster (and the RPC group)
            for name in stopped:
                try:
                    servers[name].rpc_sync(timeout=wait_s).exit_process()
                except Exception:  # noqa: BLE001 - gone already
                    pass
        for name in servers:
            self.roster.leave(name, "run ended", readmit=False)
        self.store.shut_down()


def run_head(spec: RunSpec, store: RunStore, stop: StopRequest, token: RunToken, nonce: str, *,
             run_log: RunLog | None = None, restore_points: str | None = None,
             restart: Restart | None = None) -> RunSummary:
    """Rank 0's run; agents are admitted when they prove `token` over `nonce` (the nonce of the store's info).
    `run_log` takes each version's metrics (None: the run logs nowhere). `restore_points`: the directory of the
    trainer ranks' restore points (failover on, `asyncrl.rpc.failover`), else None. `restart`: the run goes on from
    a version boundary's restore points after the previous rank 0 died (`asyncrl.rpc.restart`), else None."""
    return _Head(spec, store, stop, token, nonce, run_log, restore_points, restart).run()
