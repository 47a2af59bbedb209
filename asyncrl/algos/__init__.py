"""Pure tensor functions of asynchronous RL: advantages, losses, KL, off-policy correction, staleness.

No config objects, no I/O, no torch.distributed, no globals. Shapes: `[B, T]` per token, `[B]` per
sequence; masks are bool `[B, T]`. Every function checks its inputs and raises `ValueError` naming what it
received and the fix.
"""

from asyncrl.algos.advantages import (
    AdvantageResult, GroupStats, dr_grpo_advantage, gae_advantage, group_stats, grpo_advantage,
    reinforce_pp_advantage, reinforce_pp_baseline_advantage, rloo_advantage,
)
from asyncrl.algos.correction import (
    ISWeightsResult, RejectionResult, VTraceResult, decoupled_ppo_weights, sequence_rejection_mask,
    sequence_tis_weights, token_rejection_mask, token_tis_weights, vtrace, m2po_mask,
)
from asyncrl.algos.drift import (
    BehaviourDrift, DriftRate, SequenceMask, behaviour_drift, drift_lag_cap, drift_rate_update, effective_sample_size,
    off_policy_sequence_mask,
)
from asyncrl.algos.kl import (
    KL_ESTIMATORS, KLRewardResult, adaptive_kl_coef, kl_abs, kl_k1, kl_k2, kl_k3, kl_penalized_rewards,
)
from asyncrl.algos.losses import (
    LOSS_AGG_MODES, LossAggMode, PolicyLossResult, ValueLossResult, agg_loss, cispo_loss, gspo_loss,
    ppo_clip_loss, reinforce_loss, value_loss,
)
from asyncrl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten, seq_lengths
from asyncrl.algos.moe import LoadBalance, load_balancing
from asyncrl.algos.staleness import (
    LengthBucket, VerlBudget, VersionLag, areal_capacity, lag_by_length, length_bucket, staleness_mask, verl_admit,
    verl_max_required_samples, verl_on_new_version, verl_release, version_lag,
)

__all__ = [
    # advantages
    "AdvantageResult", "GroupStats", "group_stats", "gae_advantage", "grpo_advantage", "dr_grpo_advantage",
    "rloo_advantage", "reinforce_pp_advantage", "reinforce_pp_baseline_advantage",
    # losses
    "LossAggMode", "LOSS_AGG_MODES", "agg_loss", "PolicyLossResult", "ValueLossResult", "ppo_clip_loss",
    "gspo_loss", "cispo_loss", "reinforce_loss", "value_loss",
    # kl
    "kl_k1", "kl_k2", "kl_k3", "kl_abs", "KL_ESTIMATORS", "KLRewardResult", "kl_penalized_rewards",
    "adaptive_kl_coef",
    # off-policy correction
    "ISWeightsResult", "RejectionResult", "VTraceResult", "token_tis_weights", "sequence_tis_weights",
    "token_rejection_mask", "sequence_rejection_mask", "m2po_mask", "decoupled_ppo_weights", "vtrace",
    # drift from the behaviour policy
    "BehaviourDrift", "behaviour_drift", "effective_sample_size", "SequenceMask", "off_policy_sequence_mask",
    "DriftRate", "drift_rate_update", "drift_lag_cap",
    # staleness
    "VersionLag", "version_lag", "staleness_mask", "verl_max_required_samples", "VerlBudget", "verl_admit",
    "verl_release", "verl_on_new_version", "areal_capacity", "length_bucket", "lag_by_length", "LengthBucket",
    # masked reductions
    "masked_sum", "masked_mean", "masked_var", "masked_whiten", "seq_lengths",
    # mixture-of-experts routers
    "LoadBalance", "load_balancing",
]
