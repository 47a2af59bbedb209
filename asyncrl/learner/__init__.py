"""The learner: one training step `(state, groups) -> (state, metrics)`.

    state = build_learner(policy, TrainerConfig(...), GRPO(...), reference=ref_model)
    state, metrics = train_step(state, groups)       # groups: list[Group] streamed from the agents

A step, for a batch of groups (every number comes from `asyncrl.algos`):
  1. collate groups into `[N, T]` response tensors (rewards shaped by DAPO's overlong penalty if asked);
  2. π_old: the behaviour log-probs (`use_rollout_log_probs`) or proximal log-probs recomputed now;
     π_ref log-probs if a KL is used (LoRA: the policy with its adapters off); critic values if the algorithm
     has a critic;
  3. per-token rewards (outcome at the last token, minus β·KL if KL-in-reward), advantages;
  4. the loss mask: response mask ∧ version-lag cap ∧ rejection; truncated IS weights;
  5. `ppo_epochs` × mini-batches of `mini_batch_size` groups, each accumulated over micro-batches formed
     by token budget (rows packed into one sequence with document-causal attention, or padded), normalised
     by the mini-batch's global token/row counts so accumulation is exact; gradient clipping, a skipped
     update (counted) on a non-finite gradient, AdamW + schedule;
  6. the critic's update on the GAE returns (the same loop), concurrently with the actor's when configured.

The package, by concern:
  batch     RolloutBatch, collate, filter_groups            state     LearnerState, build_learner, schedules
  layout    micro-batch split, packed / padded layouts      prepare   π_old, π_ref, values, advantages, masks
  forward   response log-probs and values of a micro-batch  update    the update loop, actor and critic losses
  head      the chunked fused log-prob head                 step      train_step and its metrics
  sharding  FSDP2: shard_model, grad_norm_, full_weights    publication  what a publication sends (LoRA: adapters)
  share     a trainer rank's share of a step: the deal of groups to ranks, rows gathered and scattered
"""

from asyncrl.learner.batch import RolloutBatch, collate, filter_groups
from asyncrl.learner.forward import response_logprobs, response_values
from asyncrl.learner.head import linear_logprobs
from asyncrl.learner.layout import MicroBatch, balance_groups, plan_micro_batches, split_rows
from asyncrl.learner.publication import published_weights, publishes_adapters
from asyncrl.learner.sharding import full_weights, grad_norm_, shard_model, sharding_options
from asyncrl.learner.state import LearnerState, build_learner, make_scheduler
from asyncrl.learner.step import memory_metrics, policy_gradients, train_step

__all__ = [
    "RolloutBatch", "collate", "filter_groups", "LearnerState", "build_learner", "train_step", "shard_model",
    "sharding_options",
    "full_weights", "published_weights", "publishes_adapters", "make_scheduler", "response_logprobs",
    "response_values", "linear_logprobs", "split_rows", "balance_groups",
    "plan_micro_batches", "MicroBatch", "policy_gradients", "grad_norm_", "memory_metrics",
]
