"""The learner's configs: the optimizer, the off-policy correction and the trainer (`--trainer.*`);
`asyncrl.config` re-exports them."""

from __future__ import annotations

import dataclasses
from typing import Literal

from asyncrl.config.flags import fail as _fail
from asyncrl.config.flags import flag

__all__ = ["OptimConfig", "OffPolicyConfig", "TrainerConfig"]


@dataclasses.dataclass
class OptimConfig:
    """AdamW with linear warmup and a constant or cosine schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warmup: keep `lr`, or decay it along a cosine to `min_lr_ratio`·lr at `total_steps`."""
    total_steps: int = 0
    """Optimizer steps of the whole run (needed by the cosine schedule)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule, as a fraction of `lr`."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""

    def validate(self, owner: str = "optim") -> None:
        if not self.lr > 0:
            _fail(owner, "lr", self.lr, "must be > 0")
        if self.warmup_steps < 0:
            _fail(owner, "warmup_steps", self.warmup_steps, "must be >= 0")
        if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
            _fail(owner, "total_steps", self.total_steps, f"the cosine schedule needs {flag(owner, 'total_steps')} > {flag(owner, 'warmup_steps')}={self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            _fail(owner, "min_lr_ratio", self.min_lr_ratio, "must lie in [0, 1]")
        if self.grad_clip < 0:
            _fail(owner, "grad_clip", self.grad_clip, "must be >= 0 (0 disables clipping)")


@dataclasses.dataclass
class OffPolicyConfig:
    """How stale or mismatched samples are corrected (behaviour μ → proximal π_old), see `algos.correction`."""

    use_rollout_log_probs: bool = True
    """Use the engine's behaviour log-probs as π_old (no recompute; verl's bypass mode). False recomputes
    proximal log-probs with the learner's weights before the update (decoupled PPO)."""
    is_level: Literal["none", "token", "sequence"] = "none"
    """Truncated importance weights π_old/μ (only meaningful when log-probs are recomputed)."""
    is_threshold: float = 2.0
    """Truncation C of the importance weights."""
    rs_stat: Literal["none", "k1", "k2", "k3"] = "none"
    """Rejection statistic: k1 bounds the ratio, k2/k3 bound a divergence."""
    rs_level: Literal["token", "sum", "mean", "max"] = "mean"
    """Reject single tokens, or whole sequences by the sum / mean / max of the statistic."""
    rs_lower: float | None = None
    """k1 only: lower ratio bound (default 1/rs_upper)."""
    rs_upper: float | None = None
    """Upper bound of the ratio (k1) or of the divergence (k2, k3)."""
    m2_threshold: float | None = None
    """M2PO's second-moment trust region (arXiv:2510.01161; AReaL's `m2_threshold`): the fewest tokens, largest
    (log π_old − log μ)² first, get no loss so that the step's mean of that square stays below this (e.g. 0.04).
    Needs recomputed log-probs (--trainer.off-policy.no-use-rollout-log-probs)."""
    behaviour_kl_coef: float = 0.0
    """β of a KL(π_θ ‖ μ) loss term toward the behaviour policy that sampled the tokens (k3 estimator on the
    behaviour log-probs, aggregated like the policy loss): keeps an update near the data's sampler however
    stale it is. 0 = off."""
    opsm_threshold: float | None = None
    """Off-policy sequence masking (DeepSeek-V3.2): a sequence with a negative advantage whose drift from the
    behaviour policy μ, the mean over its tokens of log μ − log π_θ with π_θ the policy being trained (measured in
    every micro-batch of the update), exceeds this δ gets no loss (e.g. 0.01 nats a token; unset: off). Bounds
    the step relative to μ where stale negative samples would push hardest; logged as actor/opsm_masked_fraction."""
    ess_scaled_lr: bool = False
    """VCPO's step-size control (arXiv:2602.17616): each update's learning rate times the normalised effective
    sample size of its token ratios π_θ/μ (1 on-policy; smaller as the policy drifts from the data's sampler),
    logged as actor/lr_scale."""
    max_version_lag: int | None = None
    """Hard cap on version lag: tokens (or sequences, see `stale_level`) older than this get no loss."""
    stale_level: Literal["token", "sequence"] = "sequence"
    """Apply `max_version_lag` per token or per sequence."""

    def validate(self, owner: str = "off_policy") -> None:
        if self.is_level != "none" and self.use_rollout_log_probs:
            _fail(owner, "is_level", self.is_level, "importance weights need recomputed proximal log-probs; "
                  f"add {flag(owner, 'no_use_rollout_log_probs')} (with it on, π_old = μ and every weight is 1)")
        if self.is_threshold < 1:
            _fail(owner, "is_threshold", self.is_threshold, "must be >= 1")
        if self.rs_stat != "none" and self.rs_upper is None and self.rs_lower is None:
            _fail(owner, "rs_upper", self.rs_upper, f"{flag(owner, 'rs_stat')} {self.rs_stat} needs a bound: set {flag(owner, 'rs_upper')} (or {flag(owner, 'rs_lower')})")
        if self.rs_stat == "k1" and self.rs_level == "max":
            _fail(owner, "rs_level", self.rs_level, "'max' is defined for k2/k3 only")
        if self.m2_threshold is not None:
            if not self.m2_threshold > 0:
                _fail(owner, "m2_threshold", self.m2_threshold, "must be > 0 (or left unset)")
            if self.use_rollout_log_probs:
                _fail(owner, "m2_threshold", self.m2_threshold, "M2PO compares recomputed log-probs with the "
                      f"behaviour ones; add {flag(owner, 'no_use_rollout_log_probs')} (with it on, π_old = μ and "
                      "nothing is ever masked)")
        if self.opsm_threshold is not None and not self.opsm_threshold >= 0:
            _fail(owner, "opsm_threshold", self.opsm_threshold, "must be >= 0 nats a token (or left unset: off)")
        if not self.behaviour_kl_coef >= 0:
            _fail(owner, "behaviour_kl_coef", self.behaviour_kl_coef, "must be >= 0 (0: off)")
        if self.max_version_lag is not None and self.max_version_lag < 0:
            _fail(owner, "max_version_lag", self.max_version_lag, "must be >= 0 or None")


@dataclasses.dataclass
class TrainerConfig:
    """The learner: batching, precision and the optimizer."""

    mini_batch_size: int = 16
    """Groups (prompts, each with its n responses) per optimizer step (verl `ppo_mini_batch_size`)."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    use_dynamic_bsz: bool = True
    """Form micro-batches by token budget (length-sorted rows, little padding) instead of a fixed row count."""
    max_tokens_per_micro_batch: int = 16384
    """Token budget of one forward/backward (rows × longest row), verl `ppo_max_token_len_per_gpu`."""
    micro_batch_size: int = 4
    """Rows per forward/backward when `use_dynamic_bsz` is off."""
    logits_chunk_tokens: int = 4096
    """Response tokens per LM-head chunk: only one [chunk, vocab] logits tensor exists at a time."""
    pack_sequences: bool = True
    """Concatenate a micro-batch's rows into one sequence (up to max_tokens_per_micro_batch tokens) with
    document-causal attention, instead of padding them to the longest row: no padding compute. Loss and
    gradients equal the padded path's to round-off."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    checkpoint_scope: Literal["layer", "mlp"] = "mlp"
    """What gradient checkpointing recomputes: only each decoder layer's MLP (the attention block's
    activations are kept; measured 1.5x faster than whole layers on an H100 for ~10% more memory, see
    BENCHMARKS.md), or each whole layer (least memory)."""
    compile_layers: bool = True
    """torch.compile each decoder layer of the trained models (regional compilation; CUDA; an FSDP2 trainer
    group compiles each layer between its gathers). Measured 1.6-2x faster on an H100; the first steps take
    ~1 min longer while it compiles."""
    compile_scope: Literal["layer", "model"] = "layer"
    """With compile_layers: compile each decoder layer on its own (one graph serves every layer; ~10 s to
    compile), or the model's whole forward as one region (one call a micro-batch instead of one per layer;
    Qwen2.5-0.5B ragged on an H100: 83k against 80k tok/s, but ~110 s to compile; see BENCHMARKS.md)."""
    cuda_graphs: bool = False
    """Replay the compiled region as CUDA graphs (inductor's CUDA graph trees). Packed micro-batches are
    padded to a few shapes (length to a multiple of 512, document count and the flash bound bucketed) so
    the recorded graphs are replayed; needs compiled layers and packed sequences. Measured no faster at
    the layer scope (Qwen2.5-0.5B ragged, H100) and the first step records for ~1 min: see BENCHMARKS.md."""
    fsdp_reshard_after_forward: bool = True
    """A trainer group (FSDP2, 2+ trainer devices): free each decoder layer's gathered weights after its
    forward and gather them again for its backward. Off: keep them from forward to backward (one all-gather
    fewer per layer and micro-batch; every rank holds the whole bf16 model while a micro-batch runs)."""
    routing_replay: Literal["off", "r2", "r3"] = "off"
    """Mixture-of-experts models: r2 records the experts each router picks for each token in the learner's
    first pass over a batch (the one that computes π_old) and replays them in every update of that batch, so
    the PPO ratio compares the same experts across updates and epochs while the routers still get gradients
    (`asyncrl.policies.routing_replay`). r3 replays the experts the rollout engine picked (vLLM on GPUs returns
    them with each sample) in that first pass and every update, so the learner's log-probs are those of the
    experts that sampled the tokens; positions the engine did not route (a sample resumed from a checkpoint, a
    response's last token) are routed by the learner and kept as in r2. off: each forward routes afresh."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts models: weight of the load-balancing auxiliary loss (Switch Transformer's, per router,
    averaged over routers: `asyncrl.algos.moe`) added to the policy loss. 0 (the default): RL post-training
    leaves the pretrained routing alone; the expert load is reported either way (`moe/expert_load_*`)."""
    freeze_router: bool = False
    """Mixture-of-experts models: keep every router's weights as loaded (no gradient, no update), so the experts
    each token goes to change only through the hidden states reaching the routers."""
    router_dtype: Literal["float32", "model"] = "float32"
    """Mixture-of-experts models: float32 runs each router's GEMM and softmax on float32 operands with autocast off
    (`asyncrl.policies.router_precision`), so two experts' logits closer than a bf16 step do not tie or swap
    between passes; model: as the model's dtype and autocast have it. No effect on a dense model or in fp32."""
    fused_optimizer: bool = True
    """Fused AdamW (one kernel for all parameters) on CUDA; a sharded (FSDP2) model uses the foreach one."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the trained weights (fp32 master weights are the safe default). bfloat16 halves the weights'
    and Adam moments' memory but keeps no fp32 copy, so updates smaller than half a bf16 step of a weight are
    lost (at lr 1e-6 a step moves under 1% of the weights); the checks before launch say so."""
    autocast_bf16: bool = True
    """Run forward/backward under bf16 autocast on CUDA (ignored on CPU)."""
    fused_kernels: bool = False
    """torch.compile the model's elementwise pieces on CUDA (measured slower for training on an H100:
    the guards cost more host time than the launches they save; see BENCHMARKS.md)."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """Host memory for what does not fit the GPU. optimizer: AdamW's moments (and, with
    --trainer.param-dtype bfloat16, an fp32 master copy of the weights) live in pinned host memory and are
    streamed through the GPU for the update: the GPU holds weights and gradients only (one trainer process).
    params: FSDP2's CPU offload (weights, gradients and optimizer state on the host, the update on the CPU;
    any number of trainer ranks). See BENCHMARKS.md for what each costs a step."""
    temperature: float | None = None
    """Temperature of the learner's log-probs (logits / temperature). None: the rollout's
    (--rollout.temperature); 1.0 for a learner used on its own. Set it only to check it matches."""
    max_response_length: int | None = None
    """The rollouts' max_new_tokens: the budget of DAPO's overlong shaping and the constant of
    seq-mean-token-sum-norm (None: the longest response of each batch)."""
    shuffle: bool = True
    """Shuffle groups between PPO epochs."""
    seed: int = 0
    """Seed of the mini-batch shuffling."""
    max_recoveries: int = 0
    """Trainer-group faults (a follower rank that dies or hangs) the run recovers from without stopping: every rank
    keeps a restore point of each step in host shared memory, and the launcher starts the followers again
    (`asyncrl.rpc.failover`). 0: such a fault ends the run (resume from a checkpoint)."""
    failover: Literal["replace", "shrink"] = "replace"
    """What a recovered fault leaves (with --trainer.max-recoveries): replace: followers started again in the same
    layout (the run equals an uninterrupted one bitwise); shrink: the group goes on one rank smaller, without the
    faulty rank's device, every shard re-sliced from the restore points (equal to an uninterrupted run within float
    rounding)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    off_policy: OffPolicyConfig = dataclasses.field(default_factory=OffPolicyConfig)

    def validate(self) -> None:
        owner = "trainer"
        for field in ("mini_batch_size", "ppo_epochs", "max_tokens_per_micro_batch", "micro_batch_size",
                      "logits_chunk_tokens"):
            if getattr(self, field) < 1:
                _fail(owner, field, getattr(self, field), "must be >= 1")
        if self.cuda_graphs and not (self.compile_layers and self.pack_sequences and self.use_dynamic_bsz):
            _fail(owner, "cuda_graphs", self.cuda_graphs, "replays compiled layers over packed micro-batches: "
                  "keep --trainer.compile-layers, --trainer.pack-sequences and --trainer.use-dynamic-bsz on")
        if not self.router_aux_loss_coef >= 0:
            _fail(owner, "router_aux_loss_coef", self.router_aux_loss_coef, "must be >= 0 (0: no auxiliary loss)")
        if self.routing_replay != "off" and self.cuda_graphs:
            _fail(owner, "routing_replay", self.routing_replay, "replays routes through each micro-batch's token "
                  "cells, which the CUDA graphs' bucket padding shares; leave --trainer.cuda-graphs off")
        if self.max_recoveries < 0:
            _fail(owner, "max_recoveries", self.max_recoveries, "must be >= 0 (0: a trainer rank's fault ends the run)")
        if self.temperature is not None and not self.temperature > 0:
            _fail(owner, "temperature", self.temperature, "must be > 0 (the rollout temperature), or None")
        self.optim.validate("trainer.optim")
        self.off_policy.validate("trainer.off_policy")

    @property
    def sampling_temperature(self) -> float:
        """The temperature log-probs are computed at (see `temperature`)."""
        return 1.0 if self.temperature is None else self.temperature
