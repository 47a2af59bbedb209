"""`asyncrl train` and `asyncrl agent`: a preset with the flags applied, checked before anything starts, then
launched; one more rollout agent for a running job.

    asyncrl train cpu-demo                          # the default job (what `make train` runs)
    asyncrl train cpu-demo --async-training.staleness-threshold 0 --run-dir runs/sync
    asyncrl train cpu-demo --data.path my.jsonl --reward.fn my_reward.py:score --dry-run
    asyncrl train --help
    asyncrl agent --join HOST:PORT --device cuda:3  # one more rollout agent for a running job
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys

import torch
import tyro

from asyncrl.config import RunConfig
from asyncrl.tracking.console import phase
from asyncrl.config.flags import as_flags, given_flags
from asyncrl.launch.preflight import check_devices, preflight
from asyncrl.launch.run_dir import after_torchrun_restart, owns_run_dir
from asyncrl.config.presets import PRESETS
from asyncrl.runtime.roster import FENCED_EXIT
from asyncrl.rpc.exposure import read_token, socket_interface
from asyncrl.rpc.roles import run_agent_process
from asyncrl.rpc.supervise import RunKilled
from asyncrl.launch.train import train
from asyncrl.runtime.lifecycle import exit_code

__all__ = ["run_config", "train_main", "agent_main"]


def _presets_help() -> str:
    lines = ["usage: asyncrl train PRESET [--field value ...]", "", "presets:"]
    width = max(map(len, PRESETS))
    lines += [f"  {name:{width}s}  {description}" for name, (description, _) in PRESETS.items()]
    lines += ["", "`asyncrl train PRESET --help` lists every field; `algorithm:dapo` (grpo, dr-grpo, gspo, cispo,",
              "rloo, reinforce-pp, ppo) switches the algorithm; flags may come before or after it."]
    return "\n".join(lines)


def run_config(preset: str, args: list[str]) -> RunConfig:
    """The RunConfig of `asyncrl train PRESET ARGS...`: the preset with the flags applied (exits on --help or a
    bad flag, as tyro does). The run's flags may come before or after `algorithm:NAME`, the algorithm's only
    after it: tyro.conf.CascadeSubcommandArgs (by default tyro gives the flags after a subcommand to that
    subcommand alone, so `algorithm:dapo --wandb off` was refused)."""
    description, default = PRESETS[preset]
    return tyro.cli(RunConfig, default=default, args=args, prog=f"asyncrl train {preset}", description=description,
                    config=(tyro.conf.CascadeSubcommandArgs,))


def train_main(args: list[str]) -> None:
    if not args or args[0] in ("-h", "--help"):
        print(_presets_help())
        raise SystemExit(0 if args else 2)
    if args[0] not in PRESETS:
        raise SystemExit(f"asyncrl train: unknown preset {args[0]!r}; choose one of {', '.join(PRESETS)}\n\n"
                         + _presets_help())
    config, restarted = after_torchrun_restart(run_config(args[0], args[1:]))
    if restarted is not None and owns_run_dir(config):
        phase(restarted)
    phase("checking the configuration, devices, model, rewards and data")
    report = preflight(config, say=phase, given=given_flags(args[1:]))
    if not report.ok:
        raise SystemExit(report.failure("asyncrl train"))
    if config.dry_run:
        sized = dataclasses.replace(config, rollout=report.config.rollout)  # the memory check may lower its slots
        print(f"asyncrl train {args[0]} \\\n  " + " \\\n  ".join(as_flags(sized)))
        print("checks:\n" + report.render())
        return
    for note in report.notes:
        phase(f"note: {note}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(name)s %(levelname)s %(message)s")
    try:
        summary = train(report)
    except ValueError as err:  # configuration errors name the flag and the fix
        raise SystemExit(f"asyncrl train: {err}") from None
    except RunKilled as err:
        print(f"asyncrl train: {err}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code(err.signal_name)) from None
    except (RuntimeError, OSError) as err:  # a failed run: its process logged the traceback above
        raise SystemExit(f"asyncrl train: the run failed: {err}") from None
    if summary is None:  # a non-zero rank of a torchrun job
        return
    if summary.interrupted is not None:
        print(summary.interrupted_line(), flush=True)
        raise SystemExit(exit_code(summary.interrupted))
    print(summary.done_lines(config.reward.error_warn_share), flush=True)


@dataclasses.dataclass
class AgentArgs:
    """Join a running asyncrl job as one more rollout agent. The job prints its join address at start-up
    ("more rollout agents can join this run: ..."); the agent takes the next free slot, receives the current
    weights at the next publication, then generates. SIGTERM or Ctrl-C leaves cleanly (its unfinished
    prompts go to the other agents)."""

    join: str
    """HOST:PORT of the job's store (--placement.join-port on the trainer's host; torchrun: MASTER_PORT+1)."""
    device: str = "cpu"
    """Device of this agent's engine (cuda:N, or cpu)."""
    threads: int = 1
    """torch intra-op threads (CPU)."""
    token_file: str | None = None
    """File whose first line is the run's token (else $ASYNCRL_RUN_TOKEN). A run on another host needs it (the
    one that run was given); a loopback run on this host hands it over by itself, to the same user."""
    rejoins: int = 3
    """Times this agent joins the job again after the job declared it dead while it lived (a network partition
    longer than --async-training.agent-timeout-s, a long stall): each time a fresh process joins as a new agent.
    0: exit instead (status 75)."""
    interface: str = "auto"
    """The network interface this agent listens and connects on (TensorPipe, gloo, NCCL, vLLM); auto: the one
    that routes to the job's host (loopback for a job on this host)."""


def agent_main(args: list[str]) -> None:
    """`asyncrl agent --join HOST:PORT --device DEVICE`: one more rollout agent for a running job."""
    parsed = tyro.cli(AgentArgs, args=args, prog="asyncrl agent")
    host, _, port = parsed.join.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"asyncrl agent: --join {parsed.join!r} is not HOST:PORT (e.g. --join 10.0.0.5:29511)")
    for problem in check_devices({"--device": (parsed.device,)}):
        raise SystemExit(f"asyncrl agent: {problem}")
    torch.set_num_threads(parsed.threads)
    try:
        token = read_token(parsed.token_file, flag="--token-file")
        socket_interface(host, parsed.interface)
    except ValueError as err:
        message = str(err).replace("--placement.master-addr", "--join").replace("--placement.interface", "--interface")
        raise SystemExit(f"asyncrl agent: {message}") from None
    context = multiprocessing.get_context("spawn")
    current: list = []
    for sig in (signal.SIGTERM, signal.SIGINT):  # the agent process decides what a signal means (leave, or exit)
        signal.signal(sig, lambda number, frame: current and current[-1].pid and os.kill(current[-1].pid, number))
    for attempt in range(parsed.rejoins + 1):
        child = context.Process(target=run_agent_process, args=(host, int(port)), name="asyncrl-agent",
                                kwargs=dict(device=parsed.device, token=token, interface=parsed.interface))
        child.start()
        current.append(child)
        child.join()
        if child.exitcode != FENCED_EXIT or attempt == parsed.rejoins:
            raise SystemExit(child.exitcode)
        print(f"[asyncrl] the job declared this agent dead while it lived (fenced); joining it again "
              f"({parsed.rejoins - attempt} rejoins left)", flush=True)
