"""GRPO end to end on a toy addition task, in one process, on the CPU.

    python scripts/train.py                 # defaults: ~1 minute on 2 CPU cores
    python scripts/train.py --help

A tiny GRU language model over 12 tokens (digits, EOS, SEP) reads "a b SEP" and must write the last digit
of a + b, then EOS. Each step samples G responses per prompt, keeps the behaviour log-probs, scores them,
and updates with the pure functions of `asyncrl.algos` exactly as the full runtime does:
  grpo_advantage → ppo_clip_loss (clip-higher, dual clip) + k3 KL to a frozen reference,
with DAPO's overlong penalty from `asyncrl.rewards`. It prints mean reward per step: it starts near
chance and should pass 0.9 within the default budget.

Deliberate simplifications, to be replaced by the rollout engine and the async runtime: the policy is a
GRU, not a transformer; generation and training take turns in one process (colocated sync mode).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import tyro
from torch import nn

from asyncrl.algos import agg_loss, grpo_advantage, kl_k3, ppo_clip_loss
from asyncrl.rewards import overlong_penalty

EOS, SEP, VOCAB = 10, 11, 12


@dataclasses.dataclass
class Args:
    steps: int = 200
    """Training steps (one batch of prompts each)."""
    prompts_per_step: int = 32
    """Distinct prompts per step."""
    group_size: int = 16
    """Responses per prompt (G)."""
    max_new_tokens: int = 4
    """Response budget; the answer needs 2 tokens (a digit and EOS)."""
    ppo_epochs: int = 2
    """Passes over each batch."""
    lr: float = 3e-3
    """AdamW learning rate."""
    kl_coef: float = 0.05
    """Weight of the k3 KL to the initial policy."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    """Asymmetric PPO clip (DAPO clip-higher)."""
    max_operand: int = 9
    """Operands are drawn from 0..max_operand (at most 9)."""
    seed: int = 0
    """Seed for prompts, sampling and initial weights."""


class TinyLM(nn.Module):
    """Embedding → GRU → logits; `forward` returns logits for every position."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, V]
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out)


def make_prompts(n: int, max_operand: int, gen: torch.Generator) -> torch.Tensor:
    ab = torch.randint(0, max_operand + 1, (n, 2), generator=gen)
    return torch.cat([ab, torch.full((n, 1), SEP)], dim=1)  # [n, 3]


@torch.no_grad()
def sample(policy: TinyLM, prompts: torch.Tensor, max_new: int, gen: torch.Generator):
    """Sample responses; return tokens [B, T], behaviour log-probs [B, T], response mask [B, T]."""
    seq, logps, alive = prompts, [], torch.ones(len(prompts), dtype=torch.bool)
    mask = []
    for _ in range(max_new):
        logprobs = torch.log_softmax(policy(seq)[:, -1].float(), dim=-1)
        tok = torch.multinomial(logprobs.exp(), 1, generator=gen).squeeze(1)
        tok = torch.where(alive, tok, torch.full_like(tok, EOS))
        logps.append(logprobs.gather(1, tok[:, None]).squeeze(1))
        mask.append(alive.clone())
        alive = alive & (tok != EOS)
        seq = torch.cat([seq, tok[:, None]], dim=1)
    return seq[:, prompts.shape[1]:], torch.stack(logps, 1), torch.stack(mask, 1)


def score(prompts: torch.Tensor, responses: torch.Tensor, mask: torch.Tensor, max_new: int) -> torch.Tensor:
    """1 for "d EOS" with d the last digit of a + b, 0.5 for d followed by anything else, 0 otherwise;
    plus DAPO's overlong penalty for using the whole budget."""
    rewards = []
    for p, r in zip(prompts.tolist(), responses.tolist()):
        digit = (p[0] + p[1]) % 10
        rewards.append(0.0 if r[0] != digit else 1.0 if r[1] == EOS else 0.5)
    lengths = mask.sum(dim=1)
    return torch.tensor(rewards) + overlong_penalty(lengths, max_response_length=max_new, buffer_length=1,
                                                    penalty_factor=0.1)


def token_logprobs(policy: TinyLM, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    seq = torch.cat([prompts, responses], dim=1)
    logits = policy(seq[:, :-1])[:, prompts.shape[1] - 1:]
    return torch.log_softmax(logits.float(), dim=-1).gather(2, responses[..., None]).squeeze(-1)


def main(args: Args) -> list[float]:
    """Train; return the mean reward of every step."""
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    policy, reference = TinyLM(), TinyLM()
    reference.load_state_dict(policy.state_dict())
    reference.requires_grad_(False)
    optim = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    start, history = time.perf_counter(), []
    for step in range(args.steps):
        prompts = make_prompts(args.prompts_per_step, args.max_operand, gen).repeat_interleave(args.group_size, dim=0)
        group = torch.arange(args.prompts_per_step).repeat_interleave(args.group_size)
        responses, logp_behaviour, mask = sample(policy, prompts, args.max_new_tokens, gen)
        rewards = score(prompts, responses, mask, args.max_new_tokens)
        history.append(float(rewards.mean()))
        adv = grpo_advantage(rewards, group, mask).advantages
        with torch.no_grad():
            logp_ref = token_logprobs(reference, prompts, responses)
        for _ in range(args.ppo_epochs):
            logp = token_logprobs(policy, prompts, responses)
            pg = ppo_clip_loss(logp, logp_behaviour, adv, mask, clip_ratio_low=args.clip_ratio_low,
                               clip_ratio_high=args.clip_ratio_high)
            kl = agg_loss(kl_k3(logp, logp_ref), mask)
            optim.zero_grad()
            (pg.loss + args.kl_coef * kl).backward()
            nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optim.step()
        if step % 10 == 0 or step == args.steps - 1:
            accuracy = float((rewards > 0.999).float().mean())
            print(f"step {step:4d}  critic/score/mean {rewards.mean():+.3f}  accuracy {accuracy:.3f}  "
                  f"actor/pg_clipfrac {pg.clipfrac:.3f}  actor/kl_loss {kl:.4f}  "
                  f"{time.perf_counter() - start:6.1f}s", flush=True)
    return history


if __name__ == "__main__":
    main(tyro.cli(Args))
