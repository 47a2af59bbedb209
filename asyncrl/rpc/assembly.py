"""Run assembly, in one place for both launchers: the learner, the queue, each agent's engine, and the resume.

The in-process launcher (`asyncrl.rpc.local`) and the multi-process one (`asyncrl.rpc.roles`) build the same
objects from the same `RunSpec` through these functions, so the two cannot drift (precision of the reference
model, engine sizes, seeds, what a resume restores).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from asyncrl.algos.staleness import verl_max_required_samples
from asyncrl.checkpoint.repair import ChooseError, choose_checkpoint
from asyncrl.config import AsyncConfig
from asyncrl.data.sources import PromptSource
from asyncrl.learner import LearnerState, build_learner, shard_model, sharding_options
from asyncrl.policies.lora import apply_lora
from asyncrl.policies.protocol import RolloutEngine
from asyncrl.runtime.controller import CheckpointPolicy
from asyncrl.runtime.evaluation import EvalBoard
from asyncrl.runtime.queue import SampleQueue
from asyncrl.rpc.spec import AgentSpec, RunSpec

__all__ = ["local_device", "reference_dtype", "build_learner_state", "build_queue", "sample_queue", "build_engine",
           "checkpoint_policy", "build_evals",
           "resume_checkpoint", "resolve_resume", "ResumeInfo", "resume_info"]

log = logging.getLogger(__name__)


def local_device(device: str) -> str:
    """'cuda' alone means this node's GPU number LOCAL_RANK (torchrun); anything else is taken as is."""
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device == "cuda" else device


def reference_dtype(device: str) -> str:
    """The precision of frozen weights (the reference model, a LoRA policy's base): bf16 on GPUs (no update
    to lose), fp32 on CPU (no autocast there)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def build_learner_state(spec: RunSpec, device: str, group: dist.ProcessGroup | None = None, *,
                        initial_weights: bool = True, reference: nn.Module | None = None) -> LearnerState:
    """The policy (sharded with FSDP2 over `group` when it has more than one rank or keeps its weights on the
    host, `--trainer.offload params`), the reference model when the algorithm needs one, and the optimizer.
    With LoRA (`spec.lora.rank` > 0) the policy is its base, loaded frozen in the reference's precision (bf16
    on GPUs, fp32 on CPU: no fp32 master copy, no optimizer state), with fp32 adapters on it; it is its own
    reference (adapters off) and the critic shares its base. `initial_weights` False: a learner a restore point
    fills (trainer failover), its trained weights left uninitialised where that saves reading or drawing them (a
    LoRA base and frozen routers, which no restore point holds, are loaded all the same); `reference`: the
    reference model to use rather than build (rank 0's, kept through a failover: unsharded, never trained)."""
    device = local_device(device)
    lora = spec.lora
    offload = spec.trainer.offload == "params"  # FSDP2 keeps the weights on the host: build them there
    policy = spec.model.build("cpu" if offload else device,
                              reference_dtype(device) if lora.enabled else spec.trainer.param_dtype,
                              weights=initial_weights or lora.enabled or spec.trainer.freeze_router)
    if lora.enabled:
        with torch.random.fork_rng(devices=[torch.device(device).index or 0] if device.startswith("cuda") else []):
            torch.manual_seed(spec.seed)  # every rank of a trainer group draws the same initial adapters
            apply_lora(policy, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.target_modules)
    if reference is None and spec.reference:
        reference = spec.model.build(device, reference_dtype(device))
    if group is not None and (dist.get_world_size(group) > 1 or offload):
        device_type = torch.device(device).type
        shard_model(policy, DeviceMesh.from_group(group, device_type), offload=offload,
                    **sharding_options(spec.trainer, device_type))
    else:
        group = None
    return build_learner(policy, spec.trainer, spec.algorithm, reference=reference, group=group)


def build_queue(spec: RunSpec, version: int = 0) -> SampleQueue:
    """The sample queue of `spec` at `version` (`sample_queue` over its prompt source, for its knobs)."""
    return sample_queue(spec.source_factory(), spec.trainer.mini_batch_size, spec.async_, seed=spec.seed,
                        version=version)


def sample_queue(source: PromptSource, mini_batch_size: int, config: AsyncConfig, *, seed: int = 0,
                 version: int = 0) -> SampleQueue:
    """A sample queue over `source` at `version` that admits within verl's budget: `mini_batch_size` ×
    `require_batches` × (1 + `staleness_threshold`) × `trigger_parameter_sync_step` samples per version window
    (`asyncrl.algos.staleness.verl_max_required_samples`), with the version-lag cap and policy of `config`."""
    max_required = verl_max_required_samples(mini_batch_size, config.require_batches, config.staleness_threshold,
                                             config.trigger_parameter_sync_step)
    return SampleQueue(source, max_required_samples=max_required, version=version, seed=seed,
                       max_version_lag=config.max_version_lag, lag_policy=config.lag_policy)


def checkpoint_policy(spec: RunSpec) -> CheckpointPolicy:
    """Where and how often the run checkpoints (`--run-dir`, `--checkpoint-every`, the newest kept)."""
    return CheckpointPolicy(spec.run_dir, every=spec.checkpoint_every, keep=spec.keep_checkpoints)


def build_evals(spec: RunSpec) -> tuple[EvalBoard | None, int]:
    """The evaluation board of `--eval.*` with its held-out prompts (None when off), and how many evaluation
    prompts an agent may hold at once: `--eval.max-share` of its sequence slots, in prompts of `--eval.n`
    samples (at least one)."""
    if spec.eval_prompts is None:
        return None, 0
    board = EvalBoard(spec.eval_prompts(), spec.eval, seed=spec.seed, max_new_tokens=spec.rollout.max_new_tokens)
    return board, max(1, int(spec.eval.max_share * spec.rollout.max_slots) // spec.eval.n)


def build_engine(spec: RunSpec, agent: AgentSpec, slot: int, name: str) -> RolloutEngine:
    """Agent `name`'s engine on its device, with the initial weights: asyncrl's own model built here, or, for an
    HF-path model (impl "hf", served by vLLM), its directory (`ModelSpec.directory`), which vLLM loads itself."""
    device = local_device(agent.device)
    if spec.model.impl == "hf":
        model = spec.model.directory(device, agent.engine_dtype)
    else:
        model = spec.model.build(device, agent.engine_dtype)
    return agent.engine_factory(model, spec.engine_config(agent, slot), agent=name)


# -------------------------------------------------------------------------------------------- resume
def resume_checkpoint(spec: RunSpec, *, repair: bool = True) -> pathlib.Path | None:
    """The checkpoint this run resumes from, or None for a fresh start. Checked before any process starts:
    `resume` on a run directory without a checkpoint is an error unless `resume_or_start`. It is the newest
    checkpoint that verifies, after the leftovers of an interrupted save are settled (`repair`; without it
    nothing on disk changes and the path may be a `step_N.old` a repair would restore): see
    `asyncrl.checkpoint.repair`. A newer checkpoint that does not verify is moved aside, logged in one line."""
    if not (spec.resume or spec.resume_or_start):
        return None
    flag = "--resume" if spec.resume else "--resume-or-start"
    if spec.run_dir is None:
        raise ValueError(f"{flag} needs --run-dir: the directory whose checkpoints/ to resume from")
    try:
        path = choose_checkpoint(spec.run_dir, repair=repair).path
    except ChooseError as err:
        raise ValueError(f"{flag}: {err}; start a new run with --overwrite or another --run-dir") from None
    if path is None and not spec.resume_or_start:
        raise ValueError(f"--resume: {pathlib.Path(spec.run_dir) / 'checkpoints'} holds no checkpoint; drop --resume "
                         "to start a new run there, or pass --resume-or-start to resume when one exists")
    return path


def resolve_resume(spec: RunSpec) -> RunSpec:
    """The spec with its resume request settled, once per launch and before any process starts: the chosen
    checkpoint in `resume_from` (`resume_checkpoint`, which refuses a resume without one), the request
    consumed, so every later call returns the spec as it is."""
    if not (spec.resume or spec.resume_or_start):
        return spec
    path = resume_checkpoint(spec)
    return dataclasses.replace(spec, resume=False, resume_or_start=False,
                               resume_from=str(path) if path is not None else None)


@dataclasses.dataclass
class ResumeInfo:
    """What a resume restored, for the one line that says so and for the tracker."""

    path: pathlib.Path
    step: int
    version: int
    queued: int
    unfinished: int
    window_steps: int
    wall_s: float

    def line(self) -> str:
        return (f"resuming from {self.path.name} (version {self.version}, {self.queued} queued, "
                f"{self.unfinished} in flight)")


def resume_info(path: pathlib.Path, state: LearnerState, extra: dict) -> ResumeInfo:
    queue = extra["queue"]
    run = extra.get("run", {})
    return ResumeInfo(path=path, step=state.step, version=state.version, queued=len(queue["queue"]),
                      unfinished=len(queue["unfinished"]), window_steps=int(run.get("window_steps", 0)),
                      wall_s=float(run.get("wall_s", 0.0)))
