"""`asyncrl.checkpoint`: a resumed sync run reproduces the uninterrupted one (GRPO with a KL to a rebuilt
reference, PPO with its critic); layout, pruning and crash leftovers; what a checkpoint restores (extra,
counters, schedule, optimizer, RNG); export to a directory `transformers` opens.

The run loop is built from public pieces only, colocated and synchronous: a deterministic prompt stream
with a cursor, an `Engine` on a copy of the policy with per-request seeds from (run seed, prompt index), a
pure reward, `train_step`, then the new weights published to the engine.
"""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch

from asyncrl.checkpoint import export_hf, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from asyncrl.learner import full_weights, train_step
from asyncrl.types import Completion, Group
from tests.dist_helpers import build, max_diff, prompt_for, rollout, small_engine, weights

RUN_SEED = 7
PROMPTS_PER_STEP = 4
ALGORITHMS = {"grpo": dict(kl_loss_coef=0.05), "ppo": {}}  # GRPO with a KL loss: the reference is rebuilt


class SyncRun:
    """Colocated synchronous RL: sample the next prompts of the stream, score, train, publish."""

    def __init__(self, algorithm: str, *, seed: int = 0):
        self.state = build(algorithm, seed=seed, algo_kwargs=ALGORITHMS[algorithm])
        self.engine = small_engine(copy.deepcopy(self.state.policy))
        self.cursor = 0  # index of the next prompt of the stream

    def step(self) -> tuple[list[int], dict]:
        ids = list(range(self.cursor, self.cursor + PROMPTS_PER_STEP))
        self.cursor += PROMPTS_PER_STEP
        groups = rollout(self.engine, ids, run_seed=RUN_SEED, admitted_version=self.state.version)
        self.state, metrics = train_step(self.state, groups)
        self.publish(self.state.step)
        return ids, metrics

    def publish(self, version: int) -> None:
        self.engine.update_weights(full_weights(self.state.policy), version=version)
        self.state.version = version


def _losses(metrics: dict) -> dict[str, float]:
    return {k: metrics[k] for k in ("actor/pg_loss", "actor/entropy", "critic/vf_loss") if k in metrics}


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_resumed_sync_run_reproduces_the_uninterrupted_run(tmp_path, algorithm):
    full = SyncRun(algorithm)
    history = [full.step() for _ in range(6)]
    assert len({m["actor/pg_loss"] for _, m in history}) == 6  # the loss moves from step to step

    # interrupted after step 3: checkpoint, then throw everything away
    first = SyncRun(algorithm)
    for k in range(3):
        ids, metrics = first.step()
        assert ids == history[k][0] and _losses(metrics) == _losses(history[k][1])
    save_checkpoint(tmp_path, first.state, extra={"cursor": first.cursor, "run_seed": RUN_SEED})
    del first

    # a new process: fresh model from the same seed, fresh engine, then resume
    resumed = SyncRun(algorithm)
    extra = load_checkpoint(latest_checkpoint(tmp_path), resumed.state)
    assert extra == {"cursor": 3 * PROMPTS_PER_STEP, "run_seed": RUN_SEED}
    resumed.cursor = extra["cursor"]
    assert (resumed.state.step, resumed.state.version, resumed.state.optimizer_steps) == (3, 3, 12)
    resumed.publish(resumed.state.version)
    assert resumed.engine.version == 3

    # control: the same weights, cursor and step but a fresh optimizer and schedule end elsewhere
    control = SyncRun(algorithm)
    control.state.policy.load_state_dict(resumed.state.policy.state_dict())
    control.cursor = extra["cursor"]
    control.publish(3)
    control.state.step = 3

    for k in range(3, 6):
        ids, metrics = resumed.step()
        assert ids == history[k][0], f"step {k + 1} trained other prompts"
        for name, value in _losses(metrics).items():
            assert value == pytest.approx(history[k][1][name], abs=1e-6), (k + 1, name)
        control.step()
    assert max_diff(weights(resumed.state.policy), weights(full.state.policy)) <= 1e-6
    assert max_diff(weights(resumed.engine.model), weights(full.engine.model)) <= 1e-6
    if algorithm == "ppo":
        assert max_diff(weights(resumed.state.critic), weights(full.state.critic)) <= 1e-6
    assert max_diff(weights(control.state.policy), weights(full.state.policy)) > 1e-4


# ------------------------------------------------------------------------------------ layout, pruning
def test_keep_last_prunes_latest_picks_the_newest_and_crash_leftovers_are_ignored(tmp_path):
    state = build("grpo")
    assert list_checkpoints(tmp_path) == [] and latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3, 9, 10, 11):
        state.step = step
        path = save_checkpoint(tmp_path, state, keep_last=3)
        assert path == tmp_path / "checkpoints" / f"step_{step:08d}" and path.is_dir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000009", "step_00000010", "step_00000011"]
    assert latest_checkpoint(tmp_path).name == "step_00000011"  # 11 after 9 and 10: numeric, not lexical
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step_00000011").iterdir()) == [
        "extra.pt", "learner.pt", "meta.json"]
    meta = json.loads((tmp_path / "checkpoints" / "step_00000011" / "meta.json").read_text())
    assert (meta["step"], meta["version"], meta["algorithm"]) == (11, 0, "GRPO")

    # a crash while writing step 12 left its temporary directory (and a stray file) behind
    leftover = tmp_path / "checkpoints" / "step_00000012.tmp"
    leftover.mkdir()
    (leftover / "extra.pt").write_bytes(b"half written")
    (tmp_path / "checkpoints" / "step_00000013").write_text("not a directory")
    assert [p.name for p in list_checkpoints(tmp_path)][-1] == "step_00000011"
    assert latest_checkpoint(tmp_path).name == "step_00000011"
    for bad in (leftover, tmp_path, tmp_path / "checkpoints" / "missing"):
        with pytest.raises(ValueError, match="learner.pt"):
            load_checkpoint(bad, state)
    # the next save of step 12 replaces the leftover; keep_last=1 prunes everything older
    state.step = 12
    save_checkpoint(tmp_path, state, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000012"]
    assert not leftover.exists()
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, state, keep_last=0)


def test_extra_counters_schedule_optimizer_and_rng_round_trip(tmp_path):
    run = SyncRun("grpo")
    for _ in range(2):
        run.step()
    state = run.state
    state.kl_coef, state.skipped_updates, state.critic_skipped_updates, state.version = 0.125, 2, 1, 5
    in_flight = rollout(run.engine, [8, 9], run_seed=RUN_SEED, admitted_version=2)
    partial = Group(10, prompt_for(10), [Completion([5, 6], [-1.5, -2.0], [2, 3], None)], [0.0],
                    data_source="gsm8k", admitted_version=2, info={"answer": "42"})
    extra = {"cursor": 11, "in_flight": in_flight + [partial], "queue": [], "lag": {2: [8, 9], 3: [10]},
             "nested": {"ids": (1, 2), "seen": {3, 4}}, "tensor": torch.arange(4.0)}
    path = save_checkpoint(tmp_path, state, extra=extra)
    after_save = (torch.rand(5), random.random(), np.random.rand())
    saved_weights, saved_opt = weights(state.policy), copy.deepcopy(state.optimizer.state_dict())
    saved_sched = state.scheduler.state_dict()

    fresh = build("grpo", seed=1, algo_kwargs=dict(kl_loss_coef=0.05))
    assert max_diff(weights(fresh.policy), saved_weights) > 1e-2
    got = load_checkpoint(path, fresh)
    after_load = (torch.rand(5), random.random(), np.random.rand())
    assert torch.equal(after_load[0], after_save[0]) and after_load[1:] == after_save[1:]
    assert got.keys() == extra.keys()
    assert got["in_flight"] == extra["in_flight"] and isinstance(got["in_flight"][0], Group)
    assert got["in_flight"][-1].completions[0].finish_reason is None  # still generating when saved
    assert all(got[k] == extra[k] for k in ("cursor", "queue", "lag", "nested"))
    assert torch.equal(got["tensor"], extra["tensor"])

    assert (fresh.step, fresh.version, fresh.kl_coef, fresh.optimizer_steps, fresh.skipped_updates,
            fresh.critic_skipped_updates) == (2, 5, 0.125, 8, 2, 1)
    assert fresh.scheduler.get_last_lr() == state.scheduler.get_last_lr()
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [g["lr"] for g in state.optimizer.param_groups]
    assert fresh.scheduler.state_dict()["last_epoch"] == saved_sched["last_epoch"] == 8
    assert max_diff(weights(fresh.policy), saved_weights) == 0
    opt = fresh.optimizer.state_dict()
    assert len(opt["state"]) == len(saved_opt["state"]) > 0
    for key, saved in saved_opt["state"].items():
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt["state"][key][field], saved[field]), (key, field)


def test_torch_rng_after_load_equals_torch_rng_after_save(tmp_path):
    state = build("grpo")
    path = save_checkpoint(tmp_path, state)
    want = torch.rand(8)
    torch.manual_seed(12345)
    load_checkpoint(path, build("grpo", seed=1))
    assert torch.equal(torch.rand(8), want)


def test_loading_a_checkpoint_without_critic_into_ppo_raises(tmp_path):
    path = save_checkpoint(tmp_path, build("grpo"))
    with pytest.raises(ValueError, match="critic"):
        load_checkpoint(path, build("ppo"))


# ------------------------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def test_export_hf_from_a_live_learner_and_from_a_checkpoint(tmp_path, transformers):
    run = SyncRun("grpo")
    run.step()  # trained weights, not the initial ones
    state = run.state
    live = export_hf(state, tmp_path / "live")
    from_ckpt = export_hf(save_checkpoint(tmp_path / "run", state), tmp_path / "from_checkpoint")
    assert state.policy.training and all(p.requires_grad for p in state.policy.parameters())  # left as it was

    ids = torch.tensor([prompt_for(0) + [40, 41, 42], prompt_for(5) + [50, 51, 52]])  # 3 + 3 tokens each
    with torch.no_grad():
        want = state.policy.logits(state.policy(ids))
    for out in (live, from_ckpt):
        assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        assert hf.config.model_type == "qwen2" and hf.config.tie_word_embeddings
        with torch.no_grad():
            got = hf(ids).logits
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (live / "model.safetensors").read_bytes() == (from_ckpt / "model.safetensors").read_bytes()
