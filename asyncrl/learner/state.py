"""The learner's state and how it is built: the trained models set up for training (checkpointing,
compiled layers), AdamW optimizers and their learning-rate schedules."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.learner.offload import HostAdamW
from asyncrl.learner.sharding import compute_device, shard_model, sharding_options
from asyncrl.policies.lora import lora_modules
from asyncrl.policies.model import use_fused_kernels
from asyncrl.policies.expert_precision import autocast_experts
from asyncrl.policies.router_precision import float32_routers
from asyncrl.policies.routing_replay import RoutingReplay, find_routers, router_layers
from asyncrl.policies.value import ValueModel

__all__ = ["LearnerState", "build_learner", "make_scheduler", "apply_optim_config", "world", "group_reduced"]


@dataclasses.dataclass
class LearnerState:
    """Everything a training step reads and updates (mutated in place and returned)."""

    policy: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    config: TrainerConfig
    algorithm: AlgorithmConfig
    reference: nn.Module | None = None
    critic: nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    step: int = 0  # training steps taken (each = one batch of groups)
    optimizer_steps: int = 0
    version: int = 0  # weight version published to the agents
    kl_coef: float = 0.0  # current β of KL-in-reward (adaptive controller state)
    skipped_updates: int = 0
    critic_skipped_updates: int = 0
    group: dist.ProcessGroup | None = None  # the trainer group (FSDP2), None = one process
    reference_is_base: bool = False  # π_ref = the LoRA policy's base, its adapters off (no second model)
    moe: RoutingReplay | None = None  # a MoE policy's routers (tapped each micro-batch; replayed with r2)

    @property
    def device(self) -> torch.device:
        """Where the policy computes (with FSDP2's CPU offload its parameters live on the host)."""
        return compute_device(self.policy)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak lr, then constant or cosine down to `min_lr_ratio`."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress = min((step - cfg.warmup_steps) / max(cfg.total_steps - cfg.warmup_steps, 1), 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _set_optim(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, cfg,
               lr: float) -> None:
    """Put `cfg`'s AdamW settings and peak `lr` on every parameter group, and the lr its schedule gives at the
    scheduler's (restored) step."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group.update(initial_lr=lr, lr=lr * factor(scheduler.last_epoch), betas=tuple(cfg.betas), eps=cfg.eps,
                     weight_decay=cfg.weight_decay)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def apply_optim_config(state: LearnerState) -> None:
    """After a checkpoint's optimizer and schedule states were loaded into `state`: its optimizers keep their
    moments and step counts but take this state's configured lr, betas, eps and weight decay
    (`state.config.optim`; the critic's lr from `state.algorithm.critic`), the lr being the one this run's
    schedule (warmup, constant or cosine, total steps) gives at the restored step; a fixed KL-in-reward β
    (`kl_in_reward_coef` > 0 without `kl_target`) is the configured one (an adaptive β is the controller's
    state and stays restored). Unchanged settings give exactly the values that were saved."""
    optim = state.config.optim
    _set_optim(state.optimizer, state.scheduler, optim, optim.lr)
    if state.critic_optimizer is not None and state.critic_scheduler is not None:
        _set_optim(state.critic_optimizer, state.critic_scheduler, optim, state.algorithm.critic.lr)
    if state.algorithm.kl_target is None and state.algorithm.kl_in_reward_coef > 0:
        state.kl_coef = state.algorithm.kl_in_reward_coef


def _adamw(model: nn.Module, lr: float, config: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters: with `offload="optimizer"` its state in host memory (`HostAdamW`);
    else fused (one kernel) on CUDA when asked and the parameters are plain tensors; FSDP2's DTensor shards
    (on the host too with `offload="params"`) use the multi-tensor (foreach) one."""
    params = [p for p in model.parameters() if p.requires_grad]
    cfg = config.optim
    if config.offload == "optimizer":
        return HostAdamW(params, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    fused = (config.fused_optimizer and bool(params) and all(p.is_cuda for p in params)
             and not any(hasattr(p, "device_mesh") for p in params))
    return torch.optim.AdamW(params, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             **({"fused": True} if fused else {}))


def layer_compile_options() -> dict[str, bool]:
    """Inductor options for the compiled decoder layers, so that one graph serves every packed length.

    Inductor's mix-order reduction (fusing RMSNorm's weight-gradient column sum with its row reduction)
    fuses only from 5·2^20 elements and twice as many rows as columns, and with dynamic shapes each of these
    decisions becomes a guard on the packed length: ragged micro-batches recompiled the layer whenever a
    length fell in a range not seen before (three graphs; one recompile cost 6.5 s inside a timed step at a
    Qwen3-1.7B shape, torch 2.11). Its non-strict mode fuses at every length: no guard. Empty where this
    torch has no such option."""
    from torch._inductor import config as inductor_config
    if hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        return {"triton.mix_order_reduction_non_strict_mode": True}
    return {}


def _prepare_for_training(model: nn.Module, config: TrainerConfig) -> None:
    """Train mode, gradient checkpointing of the configured scope, and (CUDA) each decoder layer compiled.

    An FSDP2-sharded model compiles its layers too (the way torchtitan does): FSDP2's hooks sit on each layer,
    and Dynamo skips them (`torch._dynamo.config.skip_fsdp_hooks`), so the gathers run eagerly around each
    compiled layer body. A sharded model compiles each layer, whatever `compile_scope` says (the whole model
    would hold every layer's gathers in one frame), and never as CUDA graphs (each step gathers its weights
    into fresh memory, which a recorded graph cannot follow; the checks before launch refuse that pair).
    Shards offloaded to the host (`--trainer.offload params`) stay eager. With `cuda_graphs` the compiled
    layers replay CUDA graphs (inductor's graph trees) and every trained parameter gets a zeroed `.grad` that
    stays allocated (a gradient first allocated inside a recorded backward would live in the graphs' memory
    and be overwritten by the next replay)."""
    model.train()
    model.gradient_checkpointing = config.gradient_checkpointing
    model.checkpoint_scope = config.checkpoint_scope
    params = list(model.parameters())
    sharded = any(hasattr(p, "device_mesh") for p in params)
    if not (config.compile_layers and params[0].is_cuda):
        return
    options = layer_compile_options()
    graphs = config.cuda_graphs and not sharded
    if graphs:
        options["triton.cudagraphs"] = True
    if config.compile_scope == "model" and not sharded:
        model.compile(dynamic=True, options=options)
    else:
        for layer in model.blocks():
            layer.compile(dynamic=True, options=options)
    if graphs:  # gradients accumulate in place into stable buffers, never into graph memory
        for p in params:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def _freeze_routers(policy: nn.Module) -> None:
    """--trainer.freeze-router: every MoE router's parameters out of training (before the optimizer sees them)."""
    routers = find_routers(policy)
    if not routers:
        raise ValueError(f"--trainer.freeze-router: {type(policy).__name__} has no mixture-of-experts router to "
                         "freeze; leave it off")
    for _, router in routers:
        router.requires_grad_(False)


def _attach_routers(state: LearnerState, policy: nn.Module, config: TrainerConfig) -> None:
    """A MoE policy's routers on `state.moe`; the flags that need them refused on a policy without, and replay
    refused where a router follows no known rule."""
    if find_routers(policy):
        state.moe = RoutingReplay(policy)
    aux = f"--trainer.router-aux-loss-coef {config.router_aux_loss_coef:g}"
    for flag, on in ((aux, config.router_aux_loss_coef > 0),
                     (f"--trainer.routing-replay {config.routing_replay}", config.routing_replay != "off")):
        if on and state.moe is None:
            raise ValueError(f"{flag}: {type(policy).__name__} has no mixture-of-experts router; leave it off")
    features = getattr(policy, "features", None)
    if config.routing_replay != "off" and config.pack_sequences and features is not None and not features.packing:
        raise ValueError(f"--trainer.routing-replay {config.routing_replay}: this model runs a packed micro-batch as "
                         "padded rows of its own (its packing probe failed), whose tokens the routes cannot follow; "
                         "add --trainer.no-pack-sequences")
    if config.routing_replay != "off":
        try:
            state.moe.check_rules()
            if config.routing_replay == "r3":
                router_layers(state.moe.names)
        except ValueError as err:
            raise ValueError(f"--trainer.routing-replay {config.routing_replay}: {err}") from None


def build_learner(policy: nn.Module, config: TrainerConfig, algorithm: AlgorithmConfig, *,
                  reference: nn.Module | None = None, critic: nn.Module | None = None,
                  group: dist.ProcessGroup | None = None) -> LearnerState:
    """Validate the configs, set up optimizers and schedules. Pass a frozen `reference` when the algorithm
    uses a KL (a LoRA policy, `asyncrl.policies.lora.apply_lora`, needs none: its base with the adapters off
    is the reference), and a critic (`ValueModel.from_policy(policy)` by default) when it needs one. Only
    parameters that require a gradient are optimized: a LoRA policy's adapters, never its frozen base."""
    config.validate()
    algorithm.validate()
    lora = next(lora_modules(policy), None) is not None
    if algorithm.needs_reference and reference is None and not lora:
        raise ValueError(f"{type(algorithm).__name__}: kl_loss_coef / kl_in_reward_coef > 0 need a reference model; "
                         "pass reference= (a frozen copy of the initial policy), or train LoRA adapters, whose "
                         "base is the reference")
    if algorithm.needs_critic and critic is None:
        critic = ValueModel.from_policy(policy, device=algorithm.critic.device)
        mesh = getattr(next(policy.parameters()), "device_mesh", None)
        if mesh is not None:  # a sharded policy gets a critic sharded alike (unsharded, the ranks' copies drift)
            shard_model(critic, mesh, offload=compute_device(policy) != next(policy.parameters()).device,
                        **sharding_options(config, mesh.device_type))
    if config.freeze_router:
        _freeze_routers(policy)
    for model in (policy, reference):
        if model is not None:
            autocast_experts(model)  # grouped expert GEMMs follow autocast (it does not cover them)
            if config.router_dtype == "float32":
                float32_routers(model)
    _prepare_for_training(policy, config)
    device = compute_device(policy)
    if config.fused_kernels and device.type == "cuda":
        use_fused_kernels(True, device, torch.bfloat16 if config.autocast_bf16 else next(policy.parameters()).dtype,
                          model=policy)
    optimizer = _adamw(policy, config.optim.lr, config)
    state = LearnerState(policy, optimizer, make_scheduler(optimizer, config.optim), config, algorithm,
                         reference=reference, critic=critic, kl_coef=algorithm.kl_in_reward_coef, group=group,
                         reference_is_base=algorithm.needs_reference and reference is None)
    _attach_routers(state, policy, config)
    if reference is not None:
        reference.eval().requires_grad_(False)
    if critic is not None:
        _prepare_for_training(critic, config)
        state.critic_optimizer = _adamw(critic, algorithm.critic.lr, config)
        state.critic_scheduler = make_scheduler(state.critic_optimizer, config.optim)
    return state


def world(state: LearnerState) -> tuple[int, int]:
    """(rank, world size) in the trainer group; (0, 1) for one process."""
    if state.group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(state.group), dist.get_world_size(state.group)


def group_reduced(state: LearnerState, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`tensor` all-reduced over the trainer group, as a new tensor: a NCCL group reduces only accelerator
    tensors (this rank's GPU), gloo host ones."""
    buffer = tensor.to(state.device if dist.get_backend(state.group) == "nccl" else "cpu", copy=True)
    dist.all_reduce(buffer, op=op, group=state.group)
    return buffer
