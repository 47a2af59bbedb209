"""The trainer group: rank 0 drives ranks 1..T−1 (an FSDP2 group) by broadcasting commands, so that every
rank enters the same collectives in the same order.

    trainers = TrainerGroup(commands_group(spec), hosted=agent_server)   # rank 0 (hosted: colocated only)
    trainers.step(state, groups); trainers.weights(state, dtype); trainers.checkpoint(...); trainers.stop()

Followers are `FollowerHost`s that rank 0 creates in their processes with `rpc.remote`: each builds its
learner shard (and, colocated, its own engine) and executes the commands on a thread of its own until "stop".
The commands travel on a CPU (gloo) group whose timeout covers the longest wait between two commands (the
trainer waiting for samples), so idle followers never time out. A single-rank trainer group has no followers
and the same interface.

The protocol, one `broadcast_object_list` per command from rank 0:
  ("step", groups, version)          train_step on this rank's share of the groups
  ("weights", dtype)                 take part in gathering the full weights (publication)
  ("load_hosted", dtype, version)    copy the full weights into this rank's own engine (colocated)
  ("checkpoint", run_dir, version, keep)   take part in saving a checkpoint (rank 0 writes)
  ("load", path)                     restore this rank's shard from a checkpoint
  ("stop",)                          leave the loop
"""

from __future__ import annotations

import datetime
import logging
import os
import threading

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from asyncrl.checkpoint import load_checkpoint, save_checkpoint
from asyncrl.learner import LearnerState, published_weights, train_step
from asyncrl.rpc.agent_server import AgentServer
from asyncrl.rpc.assembly import build_learner_state, local_device
from asyncrl.rpc.spec import RunSpec

__all__ = ["TrainerGroup", "FollowerHost", "commands_group"]

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


class TrainerGroup:
    """Rank 0's handle on the whole trainer group (itself plus the followers)."""

    def __init__(self, group: dist.ProcessGroup | None, *, hosted=None):
        self.group = group  # the commands group; None for a single-rank trainer
        self.hosted = hosted  # the AgentServer this process hosts (colocated placement)

    def _command(self, *cmd) -> None:
        if self.group is not None:
            dist.broadcast_object_list([cmd], src=0, group=self.group)

    def step(self, state: LearnerState, groups):
        self._command("step", groups, state.version)  # followers learn the version only through commands
        return train_step(state, groups)

    def weights(self, state: LearnerState, dtype: torch.dtype) -> list:
        """What a publication sends (`published_weights`), gathered by every rank together."""
        self._command("weights", str(dtype).removeprefix("torch."))
        return list(published_weights(state.policy, dtype=dtype))

    def load_hosted(self, state: LearnerState, dtype: torch.dtype, version: int) -> int:
        self._command("load_hosted", str(dtype).removeprefix("torch."), version)
        return _load_hosted(self.hosted, state, dtype, version)

    def checkpoint(self, run_dir: str, state: LearnerState, extra: dict, keep: int):
        self._command("checkpoint", run_dir, state.version, keep)
        return save_checkpoint(run_dir, state, extra=extra, keep_last=keep)

    def load(self, path: str, state: LearnerState) -> dict:
        self._command("load", str(path))
        return load_checkpoint(path, state)

    def stop(self) -> None:
        self._command("stop")


class FollowerHost:
    """Trainer rank r ≥ 1: its learner shard (and colocated engine), executing rank 0's commands."""

    def __init__(self, spec: RunSpec, rank: int, roster: rpc.RRef | None):
        self.spec, self.rank = spec, rank
        self.group = commands_group(spec)
        device = local_device(spec.trainer_devices[rank])
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        self.state = build_learner_state(spec, device, dist.group.WORLD)
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
        except BaseException as err:  # noqa: BLE001 - the process ends: the launcher sees it and stops the run
            self.error = err
            log.exception("trainer rank %d failed; its process exits", self.rank)
            os._exit(1)
        finally:
            self.done.set()

    def _execute(self) -> bool:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        cmd, *args = box[0]
        state = self.state
        if cmd == "step":
            state.version = args[1]
            self.state, _ = train_step(state, args[0])
        elif cmd == "weights":
            for _ in published_weights(state.policy, dtype=getattr(torch, args[0])):
                pass
        elif cmd == "load_hosted":
            _load_hosted(self.hosted, state, getattr(torch, args[0]), args[1])
            state.version = args[1]
        elif cmd == "load":
            load_checkpoint(args[0], state)
        elif cmd == "checkpoint":
            state.version = args[1]
            save_checkpoint(args[0], state, keep_last=args[2])
        elif cmd == "stop":
            return False
        else:
            raise RuntimeError(f"trainer rank {self.rank}: unknown command {cmd!r}")
        return True

    def status(self) -> dict:
        return {"done": self.done.is_set(), "error": repr(self.error) if self.error else None}
