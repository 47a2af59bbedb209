"""Deterministic kill points for failover drills: `ASYNCRL_FAULT=trainer:R:version:V:phase:P` ends trainer rank R's
process at once (`os._exit(9)`, as a crash would: no cleanup, no message to its peers) when it reaches phase P with
its learner's version counter at V; `...:phase:P:hang` stops it there instead (SIGSTOP, as a process hung as a
whole: it neither exits nor beats). A comma-separated list drills one fault per trainer-group generation: its k-th
point (from 0) applies after k recoveries (`--trainer.max-recoveries`), in the group the launcher formed then.

    ASYNCRL_FAULT=trainer:1:version:2:phase:backward asyncrl train cpu-demo --placement.trainer-devices cpu cpu
    ASYNCRL_FAULT=trainer:2:version:1:phase:forward,trainer:1:version:3:phase:norm asyncrl train ... \
        --trainer.max-recoveries 2

Phases, in a step's order: forward (a micro-batch's forward begins), backward (its loss is computed, its backward
not begun), norm (a mini-batch's gradients are complete; the gradient-norm all-reduce, the step's commit barrier, not
begun), step (the norm is agreed; the optimizer step not taken), publish (the weights are gathered for a
publication), checkpoint (a checkpoint is being written). Two more fall inside a recovery, in a follower started
again: join (before it joins the re-formed group; its version is 0 there, as it has no learner yet) and restore (rank
0's restore command received, the restore point not yet read; the version is the one the command carries). Unset, a
point costs one environment lookup. A malformed
value is refused before any process starts (`check_kill_point_env`). A trainer process learns its generation from
`ASYNCRL_TRAINER_GENERATION`, which it sets itself (`asyncrl.rpc.failover`), plus torchrun's restart count
(`TORCHELASTIC_RESTART_COUNT`): a job torchrun started again (`--max-restarts`) is the drill's next generation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal

__all__ = ["ENV", "GENERATION_ENV", "TORCHRUN_RESTART_ENV", "PHASES", "KillPoint", "parse_kill_point", "parse_kill_points",
           "check_kill_point_env", "kill_point"]

log = logging.getLogger(__name__)

ENV = "ASYNCRL_FAULT"
GENERATION_ENV = "ASYNCRL_TRAINER_GENERATION"
TORCHRUN_RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun in every process it starts: how many times it started the node's processes again
(`--max-restarts`); such a restart counts as one more generation of the drill."""
PHASES = ("forward", "backward", "norm", "step", "publish", "checkpoint", "join", "restore")
_FORMAT = re.compile(r"trainer:(\d+):version:(\d+):phase:([a-z]+)(:hang)?")


@dataclasses.dataclass(frozen=True)
class KillPoint:
    rank: int
    version: int
    phase: str
    hang: bool = False
    """Stop the process there (SIGSTOP) rather than end it."""


def parse_kill_point(text: str) -> KillPoint:
    match = _FORMAT.fullmatch(text.strip())
    if match is None or match.group(3) not in PHASES:
        raise ValueError(f"{ENV}={text!r}: expected trainer:RANK:version:VERSION:phase:PHASE[:hang] with PHASE one "
                         f"of {', '.join(PHASES)} (e.g. trainer:1:version:2:phase:backward)")
    return KillPoint(int(match.group(1)), int(match.group(2)), match.group(3), hang=match.group(4) is not None)


def parse_kill_points(text: str) -> list[KillPoint]:
    """A drill's points, one per trainer-group generation (module docstring)."""
    return [parse_kill_point(part) for part in text.split(",")]


def check_kill_point_env(num_trainers: int) -> list[KillPoint]:
    """The drill's kill points, checked against the run (before anything is spawned); [] when unset."""
    text = os.environ.get(ENV)
    if not text:
        return []
    points = parse_kill_points(text)
    for point in points:
        if point.rank >= num_trainers:
            raise ValueError(f"{ENV}={text!r}: trainer rank {point.rank} does not exist in a run of {num_trainers} "
                             "trainer rank(s) (--placement.trainer-devices)")
    return points


def kill_point(phase: str, rank: int, version: int) -> None:
    """End this process here if the drill names this trainer rank, version and phase for this process's trainer-group
    generation."""
    text = os.environ.get(ENV)
    if not text:
        return
    points = parse_kill_points(text)
    generation = int(os.environ.get(GENERATION_ENV) or 0) + int(os.environ.get(TORCHRUN_RESTART_ENV) or 0)
    point = points[generation] if generation < len(points) else None
    if point is not None and (point.rank, point.version, point.phase) == (rank, version, phase):
        log.error("%s: trainer rank %d %s at %s of version %d (trainer group generation %d)", ENV, rank,
                  "stopped" if point.hang else "killed", phase, version, generation)
        if point.hang:
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread: the heartbeat too
            return
        logging.shutdown()
        os._exit(9)
