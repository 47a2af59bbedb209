"""The algorithm configs: one dataclass per algorithm, each saying which advantage estimator and which policy
loss it uses (so the learner never switches on strings). `algorithm:NAME` on the command line picks one;
`asyncrl.config` re-exports them."""

from __future__ import annotations

import dataclasses
from typing import Callable, Union

from torch import Tensor

from asyncrl import algos
from asyncrl.algos import AdvantageResult, PolicyLossResult
from asyncrl.config.flags import fail as _fail

__all__ = ["GRPO", "DrGRPO", "DAPO", "GSPO", "CISPO", "RLOO", "ReinforcePP", "PPO", "AlgorithmConfig", "CriticConfig"]


@dataclasses.dataclass
class CriticConfig:
    """The value model of PPO: the policy's architecture with a scalar head, trained on GAE returns."""

    lr: float = 1e-5
    """Critic learning rate."""
    value_clip: float | None = 0.5
    """Clip range of the value loss around the rollout-time values (None: plain squared error)."""
    device: str | None = None
    """Device of the critic (split placement: e.g. 'cuda:1'); None = the policy's device."""
    concurrent: bool = True
    """Update actor and critic at the same time (the critic in a worker thread), joined before the next step."""
    warmup_steps: int = 0
    """Critic-only steps before the actor starts updating."""


@dataclasses.dataclass
class _PolicyGradient:
    """Fields every policy-gradient algorithm shares."""

    clip_ratio_low: float = 0.2
    """ε_low of the ratio clip."""
    clip_ratio_high: float = 0.2
    """ε_high of the ratio clip (DAPO clip-higher: 0.28)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip bound c > 1 for negative advantages (None disables)."""
    loss_agg_mode: algos.LossAggMode = "token-mean"
    """How per-token losses are reduced (verl's modes)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL(π_θ ‖ π_ref) loss (0: no reference model needed for it)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss: k1, k2, k3 / low_var_kl, abs, mse; a '+' suffix takes the k2 gradient."""
    kl_in_reward_coef: float = 0.0
    """β of a KL penalty folded into the per-token reward (0: off)."""
    kl_target: float | None = None
    """Target KL of the adaptive controller for `kl_in_reward_coef` (None: fixed β)."""
    kl_horizon: int = 10_000
    """Horizon of the adaptive KL controller."""
    overlong_buffer_len: int | None = 0
    """DAPO overlong shaping: penalise responses inside the last this-many tokens of the budget (0: off;
    None: a fifth of --rollout.max-new-tokens, the proportion of verl's DAPO recipe, 4096 of 20480)."""
    overlong_penalty_factor: float = 1.0
    """Penalty at the full budget."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no gradient)."""
    max_num_gen_batches: int = 10
    """With filter_groups: fail the run when one learner step has dropped this many batches' worth of groups
    (× the groups a step takes) without filling its batch: every answer scoring alike is a reward or data
    problem, not something to wait out (verl's knob; 0: no limit)."""

    def validate(self) -> None:
        owner = type(self).__name__
        if not 0 <= self.clip_ratio_low < 1:
            _fail(owner, "clip_ratio_low", self.clip_ratio_low, "must lie in [0, 1)")
        if self.clip_ratio_high < 0:
            _fail(owner, "clip_ratio_high", self.clip_ratio_high, "must be >= 0")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            _fail(owner, "clip_ratio_c", self.clip_ratio_c, "must be > 1, or None to disable the dual clip")
        if self.loss_agg_mode not in algos.LOSS_AGG_MODES:
            _fail(owner, "loss_agg_mode", self.loss_agg_mode, f"must be one of {algos.LOSS_AGG_MODES}")
        if self.kl_loss_type.rstrip("+") not in algos.KL_ESTIMATORS:
            _fail(owner, "kl_loss_type", self.kl_loss_type, f"must be one of {sorted(algos.KL_ESTIMATORS)} "
                  "(optionally with a '+' suffix)")
        for field in ("entropy_coef", "kl_loss_coef", "kl_in_reward_coef", "overlong_buffer_len",
                      "max_num_gen_batches"):
            if getattr(self, field) is not None and getattr(self, field) < 0:
                _fail(owner, field, getattr(self, field), "must be >= 0")

    def overlong_buffer(self, max_new_tokens: int | None) -> int:
        """The overlong-shaping buffer in tokens for this token budget (0: no shaping)."""
        if self.overlong_buffer_len is not None:
            return self.overlong_buffer_len
        if not max_new_tokens:
            raise ValueError("overlong_buffer_len=None (a fifth of the token budget) needs the budget: set the "
                             "trainer's max_response_length to the rollouts' max_new_tokens")
        return max(1, max_new_tokens // 5)

    @property
    def needs_reference(self) -> bool:
        return self.kl_loss_coef > 0 or self.kl_in_reward_coef > 0

    @property
    def needs_critic(self) -> bool:
        return False

    def kl_estimator(self) -> Callable[[Tensor, Tensor], Tensor]:
        base = algos.KL_ESTIMATORS[self.kl_loss_type.rstrip("+")]
        straight = self.kl_loss_type.endswith("+")
        return lambda logp, logp_ref: base(logp, logp_ref, straight_through=straight)

    def advantages(self, rewards: Tensor, token_rewards: Tensor, group_index: Tensor, mask: Tensor,
                   values: Tensor | None) -> AdvantageResult:
        return algos.grpo_advantage(rewards, group_index, mask)

    def policy_loss(self, logp: Tensor, logp_old: Tensor, advantages: Tensor, mask: Tensor, *,
                    is_weights: Tensor | None, num_tokens: float, num_seqs: float,
                    norm_length: float) -> PolicyLossResult:
        """The policy loss of a micro-batch, normalised by the mini-batch's global token / row counts."""
        return algos.ppo_clip_loss(logp, logp_old, advantages, mask, clip_ratio_low=self.clip_ratio_low,
                                   clip_ratio_high=self.clip_ratio_high, clip_ratio_c=self.clip_ratio_c,
                                   loss_agg_mode=self.loss_agg_mode, is_weights=is_weights, num_tokens=num_tokens,
                                   num_seqs=num_seqs, norm_length=norm_length)


@dataclasses.dataclass
class GRPO(_PolicyGradient):
    """GRPO (DeepSeekMath, arXiv:2402.03300): group-normalised outcome advantages + PPO clip."""

    norm_adv_by_std: bool = True
    """Divide by the group's std (False: Dr.GRPO's mean-only baseline)."""

    def advantages(self, rewards, token_rewards, group_index, mask, values):
        return algos.grpo_advantage(rewards, group_index, mask, norm_by_std=self.norm_adv_by_std)


@dataclasses.dataclass
class DrGRPO(GRPO):
    """Dr.GRPO (arXiv:2503.20783): no std normalisation, constant length normaliser."""

    norm_adv_by_std: bool = False
    loss_agg_mode: algos.LossAggMode = "seq-mean-token-sum-norm"


@dataclasses.dataclass
class DAPO(GRPO):
    """DAPO (arXiv:2503.14476): clip-higher, token-mean loss, overlong shaping, dynamic sampling."""

    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = 10.0
    overlong_buffer_len: int | None = None
    filter_groups: bool = True


@dataclasses.dataclass
class GSPO(GRPO):
    """GSPO (arXiv:2507.18071): sequence-level geometric-mean ratio, always seq-mean-token-mean."""

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4
    clip_ratio_c: float | None = None
    loss_agg_mode: algos.LossAggMode = "seq-mean-token-mean"

    def policy_loss(self, logp, logp_old, advantages, mask, *, is_weights, num_tokens, num_seqs, norm_length):
        return algos.gspo_loss(logp, logp_old, advantages, mask, clip_ratio_low=self.clip_ratio_low,
                               clip_ratio_high=self.clip_ratio_high, is_weights=is_weights, num_seqs=num_seqs)


@dataclasses.dataclass
class CISPO(GRPO):
    """CISPO (MiniMax-M1, arXiv:2506.13585): clipped, detached IS weight times REINFORCE; every token learns."""

    clip_ratio_low: float = 0.0
    clip_ratio_c: float | None = None

    def policy_loss(self, logp, logp_old, advantages, mask, *, is_weights, num_tokens, num_seqs, norm_length):
        low = None if self.clip_ratio_low == 0 else self.clip_ratio_low
        return algos.cispo_loss(logp, logp_old, advantages, mask, clip_ratio_low=low,
                                clip_ratio_high=self.clip_ratio_high, loss_agg_mode=self.loss_agg_mode,
                                is_weights=is_weights, num_tokens=num_tokens, num_seqs=num_seqs,
                                norm_length=norm_length)


@dataclasses.dataclass
class RLOO(_PolicyGradient):
    """REINFORCE leave-one-out baseline (arXiv:2402.14740) + PPO clip."""

    def advantages(self, rewards, token_rewards, group_index, mask, values):
        return algos.rloo_advantage(rewards, group_index, mask)


@dataclasses.dataclass
class ReinforcePP(_PolicyGradient):
    """REINFORCE++ (arXiv:2501.03262): discounted per-token returns (with KL in the reward), whitened over
    the batch; `group_baseline` subtracts the group mean first (REINFORCE++-baseline)."""

    group_baseline: bool = False
    """Subtract the group-mean reward (REINFORCE++-baseline) instead of using discounted returns."""
    baseline_shift_mean: bool = False
    """With group_baseline: also subtract the batch mean before dividing by the batch std (verl's whitening;
    groups of one or of equal rewards then get −μ/σ instead of 0)."""
    gamma: float = 1.0
    """Discount of the per-token return."""

    def advantages(self, rewards, token_rewards, group_index, mask, values):
        if self.group_baseline:
            return algos.reinforce_pp_baseline_advantage(rewards, group_index, mask,
                                                         shift_mean=self.baseline_shift_mean)
        return algos.reinforce_pp_advantage(token_rewards, mask, gamma=self.gamma)


@dataclasses.dataclass
class PPO(_PolicyGradient):
    """PPO with a learned critic (arXiv:1707.06347): GAE advantages (arXiv:1506.02438), clipped value loss."""

    gamma: float = 1.0
    """GAE discount."""
    lam: float = 1.0
    """GAE λ."""
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)

    @property
    def needs_critic(self) -> bool:
        return True

    def advantages(self, rewards, token_rewards, group_index, mask, values):
        return algos.gae_advantage(token_rewards, values, mask, gamma=self.gamma, lam=self.lam)


AlgorithmConfig = Union[GRPO, DrGRPO, DAPO, GSPO, CISPO, RLOO, ReinforcePP, PPO]
