"""Shared pieces of the `asyncrl.rpc` tests: the toy task, builders of in-process runs, recorders and the
ledger checks.

The toy task: prompts `[5 + i % 40, 9, 11]`; the reward is the fraction of even token ids in the response
(the scorer's text is the ids joined by spaces). A tiny random Qwen2 (initializer_range 0.1, so sampled
tokens vary) learns it within a few versions.

Everything a `RunSpec` references (`source`, `scorer`) lives at module level here so it pickles into the
spawned processes of `launch()`.
"""

from __future__ import annotations

import collections

import torch

from asyncrl.config import GRPO, AsyncConfig, OptimConfig, RolloutConfig, TrainerConfig
from asyncrl.data import GeneratedSource, Scorer
from asyncrl.learner import build_learner
from asyncrl.policies import ARCH_PRESETS, Engine, EngineConfig, random_model
from asyncrl.rpc import LocalRun
from asyncrl.runtime.controller import CheckpointPolicy
from tests.rpc.faults import SlowEngine
from asyncrl.types import Group, Prompt

MODEL_CONFIG = dict(ARCH_PRESETS["tiny-qwen2"], initializer_range=0.1)
MODEL_SEED = 1


# ------------------------------------------------------------------------------------------ the toy task
def even_fraction(text: str, ground_truth: str) -> float:
    toks = [int(t) for t in text.split()]
    return sum(t % 2 == 0 for t in toks) / max(len(toks), 1)


def make_prompt(i: int) -> Prompt:
    return Prompt([5 + i % 40, 9, 11], data_source="toy", index=i)


def source() -> GeneratedSource:
    return GeneratedSource(make_prompt)


def scorer(reward=even_fraction, *, workers=None) -> Scorer:
    """A RunSpec.scorer_factory (the agent passes its worker pool; a reward given as a Python object runs here)."""
    return Scorer({"toy": reward}, workers=workers)


def tiny_model():
    return random_model(MODEL_CONFIG, seed=MODEL_SEED)


# ------------------------------------------------------------------------------------- in-process runs
def build_state(mini_batch_size: int = 2, lr: float = 3e-3):
    return build_learner(tiny_model(), TrainerConfig(mini_batch_size=mini_batch_size, optim=OptimConfig(lr=lr)),
                         GRPO())


def local_run(config: AsyncConfig, *, engines: int = 2, step_delays: list[float] | None = None,
              max_new_tokens: int = 8, kv_on_update: str = "keep", mini_batch_size: int = 2, n: int = 4,
              max_slots: int = 16, concurrent_prompts: int | None = None, lr: float = 3e-3, seed: int = 0,
              run_dir: str | None = None, checkpoint_every: int = 0, state=None,
              resume_extra: dict | None = None, reward=even_fraction, env_setup=None, evals=None,
              eval_slots: int = 0, layout=None) -> LocalRun:
    """A LocalRun of the toy task: `engines` engines on CPU, each agent keeping `concurrent_prompts` prompts
    in flight (default max_slots // n); `env_setup` makes every prompt's samples multi-turn episodes; `layout`
    gives the controller the planner's view."""
    state = state if state is not None else build_state(mini_batch_size, lr)
    max_len = 8 + max_new_tokens
    engine_list = [Engine(tiny_model(), EngineConfig(max_slots=max_slots, max_len=max_len, attend_bucket=16,
                                                     seed=100 + i)) for i in range(engines)]
    delays = step_delays or [0.0] * engines
    engine_list = [SlowEngine(e, d) if d else e for e, d in zip(engine_list, delays)]
    rollout = RolloutConfig(n=n, max_new_tokens=max_new_tokens, max_slots=max_slots, max_prompt_length=8,
                            max_concurrent_prompts=concurrent_prompts, kv_on_update=kv_on_update)
    return LocalRun(state, engine_list, source(), scorer(reward), rollout, config, seed=seed,
                    checkpoints=CheckpointPolicy(run_dir, checkpoint_every), resume_extra=resume_extra,
                    env_setup=env_setup, evals=evals, eval_slots=eval_slots, layout=layout)


class TrainRecorder:
    """Stands in for the controller's trainer group: records, for every learner step, the learner's version at
    train time and the groups trained (before the queue marks them trained), then lets the real one train."""

    def __init__(self, run: LocalRun):
        self.steps: list[tuple[int, list[Group]]] = []
        self.inner = run.controller.trainers
        run.controller.trainers = self

    def step(self, state, groups):
        self.steps.append((state.version, list(groups)))
        return self.inner.step(state, groups)

    def checkpoint(self, *args):
        return self.inner.checkpoint(*args)

    def keep_books(self, *args):
        return self.inner.keep_books(*args)

    @property
    def groups(self) -> list[Group]:
        return [g for _, groups in self.steps for g in groups]

    @property
    def trained_ids(self) -> list[int]:
        return [g.prompt_id for g in self.groups]

    @property
    def lags(self) -> list[int]:
        """Version lag of every trained group at train time: learner version − oldest token version."""
        return [version - g.min_version for version, groups in self.steps for g in groups]


def allowed_lag(config: AsyncConfig) -> int | None:
    """The largest version lag a trained group may have under `config` (None: no bound is promised).

    * a cap (drop or wait) bounds it by the cap;
    * staleness 0 leaves nothing outstanding at a publication, partial or not: lag 0;
    * otherwise nothing bounds it: even without partial rollout, a slow agent's group may still be in flight
      when the trainer takes the fast agents' newer groups, and the next window charges it again (verl's
      window restarts at in flight + queued), so it can be trained any number of versions late."""
    bounds = []
    if config.max_version_lag is not None:
        bounds.append(config.max_version_lag)
    if config.staleness_threshold == 0:
        bounds.append(0)
    return min(bounds) if bounds else None


def check_books(ledger, summary_ledger: dict, trained_ids: list[int], *, expect_closed: bool = True,
                stale_drops_allowed: bool = True) -> None:
    """Every admitted prompt id ended exactly once: trained or dropped, never both, never trained twice."""
    states = ledger.state
    by_state = collections.Counter(states.values())
    assert summary_ledger["admitted"] == len(states)
    if expect_closed:
        assert summary_ledger["in_flight"] == summary_ledger["pending"] == summary_ledger["queued"] == 0, summary_ledger
        assert summary_ledger["admitted"] == summary_ledger["trained"] + summary_ledger["dropped"], summary_ledger
        assert set(by_state) <= {"trained", "dropped"}, by_state
    # no id trained twice, and the learner trained exactly the ids the ledger calls trained
    dup = [pid for pid, c in collections.Counter(trained_ids).items() if c > 1]
    assert not dup, f"prompt ids trained twice: {dup}"
    assert set(trained_ids) == set(ledger.ids("trained"))
    assert ledger.counts["trained"] == len(trained_ids)
    # dropped ids carry one reason each, and nothing else does
    assert set(ledger.dropped) == set(ledger.ids("dropped"))
    reasons = set(ledger.dropped.values())
    assert reasons <= ({"stale", "run_end"} if stale_drops_allowed else {"run_end"}), reasons
    # ids are handed out densely from 0: none was skipped or lost
    assert set(states) == set(range(len(states)))


@torch.no_grad()
def full_forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probs of `tokens` (temperature 1) from one forward of `model` over prompt + tokens."""
    from asyncrl.policies.model import token_logprobs
    ids = torch.tensor([prompt + tokens])
    logits = model.logits(model(ids))[0, len(prompt) - 1:-1]
    return token_logprobs(logits.float(), torch.tensor(tokens), 1.0)
