"""The trainer group: rank 0 drives ranks 1..T−1 (an FSDP2 group) by broadcasting commands, so that every
rank enters the same collectives in the same order.

    trainers = TrainerGroup(commands_group(spec), hosted=agent_server)   # rank 0 (hosted: colocated only)
    trainers.step(state, groups); trainers.weights(state, dtype); trainers.checkpoint(...); trainers.stop()

Followers are `FollowerHost`s: each builds its learner shard and executes the commands on a thread of its own
until "stop". A follower makes its own and stays out of the RPC group; a colocated one (which also hosts an engine
that rank 0's roster drives over RPC) joins RPC, and rank 0 creates it there with `rpc.remote`.
The commands travel on a CPU (gloo) group whose timeout covers the longest wait between two commands (the
trainer waiting for samples), so idle followers never time out. A single-rank trainer group has no followers
and the same interface.

The protocol: each command is a JSON header broadcast as typed data, and a step is followed by each follower's own
share of the collated batch, sent to it alone (rank 0 collates once and deals the groups; a follower gets the rows
of the groups dealt it and the counts it computes the step's deal from): nothing a follower receives is unpickled
(`broadcast_command`, `send_command`).
  {"cmd": "step", "version", "step"}, then    train_step on this rank's share of the batch
    {"fields", "rows", "group_tokens", ...} + its rows' tensors, to each follower
  {"cmd": "weights", "dtype"}                 take part in gathering the full weights (publication)
  {"cmd": "load_hosted", "dtype", "version"}  copy the full weights into this rank's own engine (colocated)
  {"cmd": "checkpoint", "run_dir", "version", "keep"}   take part in saving a checkpoint (rank 0 writes)
  {"cmd": "load", "path"}                     restore this rank's shard from a checkpoint
  {"cmd": "commit"}                           write this rank's restore point and wait for every rank's (failover)
  {"cmd": "pin", "step"}                      keep the restore point of `step` (a version boundary) past newer ones
  {"cmd": "restore", "step", "version", "world"}  back to the restore point of `step` (a re-formed group), from the
                                              files of a group of `world` ranks (a shrink: larger than this one)
  {"cmd": "stop"}                             leave the loop
With failover on (`asyncrl.rpc.failover`), every step ends with the ranks agreeing on the committed restore point
(and starting the next one when all are idle); rank 0 keeps the batches since, and after a trainer-group fault it
re-forms the group, trains those again from the committed step and gives the broken command again.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from asyncrl.checkpoint import load_checkpoint, save_checkpoint
from asyncrl.learner import LearnerState, RolloutBatch, collate, published_weights, train_step
from asyncrl.learner.share import Deal, Share, group_counts, take_share
from asyncrl.rpc.agent_server import AgentServer
from asyncrl.rpc.assembly import build_learner_state, local_device
from asyncrl.rpc.failover import Failover, RestorePoints
from asyncrl.rpc.restart import Restart
from asyncrl.rpc.spec import RunSpec
from asyncrl.runtime.kill_points import kill_point

__all__ = ["TrainerGroup", "FollowerHost", "commands_group", "broadcast_command", "receive_command", "send_command",
           "receive_sent", "follow_step"]

log = logging.getLogger(__name__)


def commands_group(spec: RunSpec) -> dist.ProcessGroup | None:
    """The gloo group rank 0's commands travel on (every trainer rank calls this, in the same order)."""
    if spec.num_trainers == 1:
        return None
    idle = datetime.timedelta(seconds=spec.async_.take_timeout_s + 2 * spec.async_.sync_timeout_s)
    return dist.new_group(list(range(spec.num_trainers)), timeout=idle, backend="gloo")


def _load_hosted(server, state: LearnerState, dtype: torch.dtype, version: int) -> int:
    """Every trainer rank (together: FSDP2 gathers): copy the published weights (a LoRA policy's adapters, or
    the full weights) into the engine this process hosts, one tensor at a time (the gather runs here, outside
    the engine's inference mode). Returns the bytes copied."""
    copied = 0
    for name, tensor in published_weights(state.policy, dtype=dtype):
        server.load_local([(name, tensor)], None)
        copied += tensor.numel() * tensor.element_size()
    server.load_local([], version)
    return copied


_DTYPES = {str(d): d for d in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool, torch.float32,
                                torch.float64, torch.bfloat16, torch.float16)}
"""The dtypes a command's tensors may have (a header naming another is refused)."""
_MAX_HEADER = 1 << 20


def _post(header: dict, tensors: list[torch.Tensor], carry) -> None:
    """Send `header` (JSON) and `tensors` (CPU copies), each through `carry` (a collective or a send)."""
    tensors = [t.detach().contiguous().cpu() for t in tensors]
    header = {**header, "tensors": [[str(t.dtype), list(t.shape)] for t in tensors]}
    data = json.dumps(header).encode()
    carry(torch.tensor([len(data)], dtype=torch.int64))
    carry(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    for tensor in tensors:
        carry(tensor)


def _take(carry) -> tuple[dict, list[torch.Tensor]]:
    """What `_post` sent, each buffer filled by `carry`. Raises RuntimeError on a header that is not a JSON object
    of known dtypes and shapes."""
    size = torch.zeros(1, dtype=torch.int64)
    carry(size)
    if not 0 < int(size) <= _MAX_HEADER:
        raise RuntimeError(f"trainer group: a command header of {int(size)} bytes")
    data = torch.empty(int(size), dtype=torch.uint8)
    carry(data)
    header = json.loads(bytes(data.numpy()).decode())
    specs = header.get("tensors") if isinstance(header, dict) else None
    if not isinstance(specs, list) or not all(
            isinstance(spec, list) and len(spec) == 2 and spec[0] in _DTYPES and isinstance(spec[1], list)
            and all(isinstance(n, int) and n >= 0 for n in spec[1]) for spec in specs):
        raise RuntimeError(f"trainer group: a command header that is not one: {str(header)[:200]}")
    tensors = []
    for dtype, shape in specs:
        tensor = torch.empty(shape, dtype=_DTYPES[dtype])
        carry(tensor)
        tensors.append(tensor)
    return header, tensors


def broadcast_command(group: dist.ProcessGroup, header: dict, tensors: list[torch.Tensor] = ()) -> None:
    """Rank 0: send `header` (JSON) and `tensors` to every rank of `group`."""
    _post(header, list(tensors), lambda t: dist.broadcast(t, group=group, group_src=0))


def receive_command(group: dist.ProcessGroup) -> tuple[dict, list[torch.Tensor]]:
    """A follower: the next (header, tensors) rank 0 broadcast on `group` (see `_take` for what is refused)."""
    return _take(lambda t: dist.broadcast(t, group=group, group_src=0))


def send_command(group: dist.ProcessGroup, rank: int, header: dict, tensors: list[torch.Tensor] = ()) -> None:
    """Rank 0: send `header` and `tensors` to `rank` of `group` alone."""
    _post(header, list(tensors), lambda t: dist.send(t, group=group, group_dst=rank))


def receive_sent(group: dist.ProcessGroup) -> tuple[dict, list[torch.Tensor]]:
    """A follower: the next (header, tensors) rank 0 sent it alone on `group`."""
    return _take(lambda t: dist.recv(t, group=group, group_src=0))


def _batch_message(batch: RolloutBatch) -> tuple[dict, list[torch.Tensor]]:
    """A collated batch as a header (field names, the ints) and its tensors, in field order."""
    fields = [f.name for f in dataclasses.fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]
    header = {"fields": fields, "prompt_ids": [int(i) for i in batch.prompt_ids],
              "nonfinite_logprobs": int(batch.nonfinite_logprobs)}
    return header, [getattr(batch, name) for name in fields]


def _batch_of(header: dict, tensors: list[torch.Tensor]) -> RolloutBatch:
    known = {f.name for f in dataclasses.fields(RolloutBatch)}
    fields = header.get("fields")
    if not isinstance(fields, list) or len(fields) != len(tensors) or not set(fields) <= known:
        raise RuntimeError(f"trainer group: a step whose batch fields are {fields!r}")
    return RolloutBatch(**dict(zip(fields, tensors)), prompt_ids=[int(i) for i in header["prompt_ids"]],
                        nonfinite_logprobs=int(header["nonfinite_logprobs"]))


def _share_message(share: Share) -> tuple[dict, list[torch.Tensor]]:
    """A rank's share of a step: its rows as a batch, their row numbers, and the deal's inputs (every group's token
    and row counts), from which the rank computes the step's deal itself."""
    header, tensors = _batch_message(share.batch)
    return {**header, "rows": share.rows, "group_tokens": share.deal.group_tokens,
            "group_rows": share.deal.group_rows}, tensors


def _share_of(header: dict, tensors: list[torch.Tensor], state: LearnerState, rank: int, ranks: int) -> Share:
    """The share `_share_message` sent `rank`; its deal computed here (for the step `state` is at). Raises
    RuntimeError when the rows are not those the deal gives this rank (rank 0 and this rank disagree)."""
    lists = [header.get(k) for k in ("rows", "group_tokens", "group_rows")]
    if not all(isinstance(v, list) and all(isinstance(n, int) and n >= 0 for n in v) for v in lists):
        raise RuntimeError("trainer group: a step's share without its rows and group counts")
    rows, tokens, counts = lists
    deal = Deal.of_step(state.config, state.step, tokens, counts, ranks)
    if rows != deal.held(rank):
        raise RuntimeError(f"trainer group: rank {rank} was sent rows {rows[:8]}… of step {state.step}, but its deal "
                           f"gives it {deal.held(rank)[:8]}…")
    return Share(_batch_of(header, tensors), rows, deal)


def collate_step(state: LearnerState, groups) -> RolloutBatch:
    """The batch every rank trains on: `groups` collated as `train_step` would (rank 0 does it once)."""
    if isinstance(groups, RolloutBatch):
        return groups
    cfg, algo = state.config, state.algorithm
    return collate(groups, max_response_length=cfg.max_response_length,
                   overlong_buffer_len=algo.overlong_buffer(cfg.max_response_length),
                   overlong_penalty_factor=algo.overlong_penalty_factor)


def follow_step(group: dist.ProcessGroup, state: LearnerState, header: dict) -> tuple[LearnerState, dict]:
    """A follower, after a "step" `header`: receive this rank's share and take the step on it."""
    state.version, state.step = int(header["version"]), int(header["step"])
    share = _share_of(*receive_sent(group), state, dist.get_rank(group), dist.get_world_size(group))
    return train_step(state, share)


class TrainerGroup:
    """Rank 0's handle on the whole trainer group (itself plus the followers)."""

    def __init__(self, group: dist.ProcessGroup | None, *, hosted=None, failover: Failover | None = None):
        self.group = group  # the commands group; None for a single-rank trainer
        self.hosted = hosted  # the AgentServer this process hosts (colocated placement)
        self.failover = failover  # None: a fault ends the run
        self._since: list[tuple[int, int, RolloutBatch]] = []  # (step, version, batch) of each step since the commit

    def _command(self, cmd: str, tensors: list[torch.Tensor] = (), **fields) -> None:
        if self.group is not None:
            broadcast_command(self.group, {"cmd": cmd, **fields}, tensors)

    def _guarded(self, state: LearnerState, command):
        """`command()`, a command to the whole group; with failover on, a trainer-group fault (posted before it, or
        breaking it) is recovered from and the command given again from the committed step."""
        if self.failover is None:
            return command()
        while True:
            fault = self.failover.posted()
            if fault is None:
                try:
                    with self.failover.watching():
                        return command()
                except Exception as err:  # noqa: BLE001 - a peer's death breaks any collective: the launcher says
                    fault = self.failover.await_fault(err)
            self._recover(state, fault)

    def _recover(self, state: LearnerState, fault: dict) -> None:
        """Re-form the group for `fault`, have every follower restore the committed step and train the steps since
        again; a fault meanwhile (a follower started again that died or hangs) starts it over with that fault."""
        while True:
            self.failover.take_on(state, fault)
            try:
                with self.failover.watching():
                    self.group = self.failover.rebuild(state, commands_group)
                    self._command("restore", step=self.failover.committed, version=state.version,
                                  world=self.failover.committed_world)
                    dist.barrier(group=self.group)  # every follower restored its shard
                    self._replay(state)
                self.failover.recovered(state)
                return
            except Exception as err:  # noqa: BLE001 - as in _guarded; Abandoned: the newer fault is posted already
                fault = self.failover.await_fault(err)

    def _replay(self, state: LearnerState) -> None:
        """Train the steps since the committed one again, on their batches at their versions (their metrics were
        logged the first time). Broken midway, those not committed again are kept for the next recovery."""
        version, since = state.version, [entry for entry in self._since if entry[0] >= state.step]
        self._since = []
        if since:
            log.warning("trainer failover: training steps %d..%d again from the committed step", since[0][0] + 1,
                        since[-1][0] + 1)
        try:
            for step, at_version, batch in since:
                if step != state.step:
                    raise RuntimeError(f"trainer failover: the batch of step {step} came up at step {state.step}")
                state.version = at_version
                self._step(state, batch)
        except BaseException:
            self._since = [entry for entry in since if entry[0] >= self.failover.committed]
            raise
        finally:
            state.version = version

    def commit(self, state: LearnerState) -> None:
        """Every rank writes its restore point of `state.step` (failover on; before the first step)."""
        self._command("commit")
        self.failover.commit_now(state, self.group)
        self._since = []

    def keep_books(self, state: LearnerState, books) -> float | None:
        """At a version boundary (failover on) whose step the ranks took a restore point of: every rank keeps that
        file (`RestorePoints.pin`) and rank 0 writes `books()` beside them, so that a restart after rank 0's death
        goes on from here (`asyncrl.rpc.restart`). A boundary the ranks were still writing an older restore point at
        is skipped (the restart goes back to an earlier one: a snapshot is never waited for). Returns the seconds it
        took (None: nothing kept)."""
        if self.failover is None or self.failover.points.latest != state.step:
            return None
        started = time.monotonic()

        def pin() -> bool:
            if self.failover.points.latest != state.step:  # a recovery meanwhile took the group back and on again
                return False
            self._command("pin", step=state.step)
            self.failover.points.pin(state.step)
            return True
        if not self._guarded(state, pin):
            return None
        self.failover.keep_books(state, books())
        return time.monotonic() - started

    def restore(self, state: LearnerState, restart: Restart, version: int) -> None:
        """A restarted group (every rank started again after rank 0 died): every rank back to its restore point of
        the restart's step, at `version` (`asyncrl.rpc.restart`)."""
        self.failover.points.restore(state, restart.step)
        self._command("restore", step=restart.step, version=version, world=self.failover.points.world)
        if self.group is not None:
            dist.barrier(group=self.group)  # every follower restored its shard
        state.version = version

    def step(self, state: LearnerState, groups):
        """A training step: each follower is sent only its share of the collated batch (`asyncrl.learner.share`)."""
        if self.group is None and self.failover is None:
            return train_step(state, groups)
        batch = collate_step(state, groups)
        return self._guarded(state, lambda: self._step(state, batch))

    def _step(self, state: LearnerState, batch: RolloutBatch):
        ranks = dist.get_world_size(self.group)
        deal = Deal.of_step(state.config, state.step, *group_counts(batch), ranks)
        self._command("step", version=state.version, step=state.step)  # followers learn the version this way
        for rank in range(1, ranks):
            send_command(self.group, rank, *_share_message(take_share(batch, deal, rank)))
        step, version = state.step, state.version
        state, metrics = train_step(state, batch)
        if self.failover is not None:
            self.failover.after_step(state, self.group)
            self._since = [e for e in self._since if e[0] >= self.failover.committed] + [(step, version, batch)]
            metrics["trainer/recoveries"] = len(self.failover.recoveries)
        return state, metrics

    def weights(self, state: LearnerState, dtype: torch.dtype) -> list:
        """What a publication sends (`published_weights`), gathered by every rank together."""
        def gather():
            self._command("weights", dtype=str(dtype).removeprefix("torch."))
            kill_point("publish", 0, state.version)
            return list(published_weights(state.policy, dtype=dtype))
        return self._guarded(state, gather)

    def load_hosted(self, state: LearnerState, dtype: torch.dtype, version: int) -> int:
        self._command("load_hosted", dtype=str(dtype).removeprefix("torch."), version=version)
        return _load_hosted(self.hosted, state, dtype, version)

    def checkpoint(self, run_dir: str, state: LearnerState, extra: dict, keep: int):
        def save():
            self._command("checkpoint", run_dir=str(run_dir), version=state.version, keep=keep)
            kill_point("checkpoint", 0, state.version)
            return save_checkpoint(run_dir, state, extra=extra, keep_last=keep)
        return self._guarded(state, save)

    def load(self, path: str, state: LearnerState) -> dict:
        self._command("load", path=str(path))
        return load_checkpoint(path, state)

    def stop(self) -> None:
        self._command("stop")


class FollowerHost:
    """Trainer rank r ≥ 1: its learner shard (and colocated engine), executing rank 0's commands."""

    def __init__(self, spec: RunSpec, rank: int, roster: rpc.RRef | None, points: RestorePoints | None = None,
                 *, initial_weights: bool = True):
        self.spec, self.rank = spec, rank
        self.points = points  # its restore points (failover on), else None
        self.group = commands_group(spec)
        device = local_device(spec.trainer_devices[rank])
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        self.state = build_learner_state(spec, device, dist.group.WORLD, initial_weights=initial_weights)
        self.hosted = None
        if spec.colocate:
            self.hosted = AgentServer(spec, rank, f"agent{rank}", spec.agents[rank].device, roster, hosted=True)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"follower{rank}", daemon=True)
        self._thread.start()

    def hosted_agent(self) -> rpc.RRef:
        if self.hosted is None:
            raise RuntimeError(f"trainer rank {self.rank} hosts no agent (not a colocated run)")
        return rpc.RRef(self.hosted)

    def _follow(self) -> None:
        device = local_device(self.spec.trainer_devices[self.rank])
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))  # the current device is per thread
        try:
            while self._execute():
                pass
        except BaseException as err:  # noqa: BLE001 - the process ends: the launcher sees it (stops the run, or
            self.error = err  # starts the trainer group's next generation: failover)
            if self.points is None:
                log.exception("trainer rank %d failed; its process exits", self.rank)
            else:  # most likely a peer's death broke its collective: one line, not a traceback
                first = (str(err).splitlines() or [""])[0][:300]
                log.error("trainer rank %d: %s: %s; its process exits (the launcher starts the trainer group again)",
                          self.rank, type(err).__name__, first)
            os._exit(1)
        finally:
            self.done.set()

    def _execute(self) -> bool:
        header, tensors = receive_command(self.group)
        cmd, state = header.get("cmd"), self.state
        if cmd == "step":
            self.state, _ = follow_step(self.group, state, header)
            if self.points is not None:
                self.points.after_step(self.state, self.group)
        elif cmd == "commit":
            self.points.commit_now(state, self.group)
        elif cmd == "pin":
            self.points.pin(int(header["step"]))
        elif cmd == "restore":
            kill_point("restore", self.rank, int(header["version"]))
            started = time.monotonic()
            self.points.restore(state, int(header["step"]), world=int(header["world"]))
            log.warning("trainer rank %d: step %d restored in %.1f s", self.rank, int(header["step"]),
                        time.monotonic() - started)
            state.version = int(header["version"])
            dist.barrier(group=self.group)
        elif cmd == "weights":
            kill_point("publish", self.rank, state.version)
            for _ in published_weights(state.policy, dtype=_DTYPES[f"torch.{header['dtype']}"]):
                pass
        elif cmd == "load_hosted":
            _load_hosted(self.hosted, state, _DTYPES[f"torch.{header['dtype']}"], int(header["version"]))
            state.version = int(header["version"])
        elif cmd == "load":
            load_checkpoint(str(header["path"]), state)
        elif cmd == "checkpoint":
            state.version = int(header["version"])
            kill_point("checkpoint", self.rank, state.version)
            save_checkpoint(str(header["run_dir"]), state, keep_last=int(header["keep"]))
        elif cmd == "stop":
            return False
        else:
            raise RuntimeError(f"trainer rank {self.rank}: unknown command {cmd!r}")
        return True

    def status(self) -> dict:
        return {"done": self.done.is_set(), "error": repr(self.error) if self.error else None}
