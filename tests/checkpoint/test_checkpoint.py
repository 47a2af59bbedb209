"""`asyncrl.checkpoint`: a resumed sync run reproduces the uninterrupted one (GRPO with a KL to a rebuilt
reference, PPO with its critic); layout, pruning and crash leftovers; failed saves (full disk, any other
error) leave no trace and name the disk; `learner.pt` loads under `weights_only=True` and `extra` is JSON;
what a checkpoint restores (extra, counters, schedule, optimizer, RNG); export to a directory `transformers`
opens.

The run loop is built from public pieces only, colocated and synchronous: a deterministic prompt stream
with a cursor, an `Engine` on a copy of the policy with per-request seeds from (run seed, prompt index), a
pure reward, `train_step`, then the new weights published to the engine.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import random
import re
import shutil

import numpy as np
import pytest
import torch

from asyncrl.checkpoint import (
    CheckpointError, describe_checkpoint, export_hf, latest_checkpoint, list_checkpoints, load_checkpoint,
    save_checkpoint,
)
from asyncrl.learner import full_weights, train_step
from asyncrl.types import Completion, Group, GroupInfo
from tests.dist_helpers import build, max_diff, prompt_for, rollout, small_engine, weights
from tests.tolerances import forward_tol

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
        "extra.json", "learner.pt", "meta.json"]
    meta = json.loads((tmp_path / "checkpoints" / "step_00000011" / "meta.json").read_text())
    assert (meta["step"], meta["version"], meta["algorithm"]) == (11, 0, "GRPO")
    assert describe_checkpoint(tmp_path / "checkpoints" / "step_00000011") == meta
    with pytest.raises(ValueError, match="meta.json"):
        describe_checkpoint(tmp_path)

    # a crash while writing step 12 left its temporary directory (and a stray file) behind
    leftover = tmp_path / "checkpoints" / "step_00000012.tmp"
    leftover.mkdir()
    (leftover / "extra.json").write_bytes(b'{"half": "writ')
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
                    data_source="gsm8k", admitted_version=2, info=GroupInfo(index=3, agent="agent1", texts=["4", "2"], env={"turns": 2}))
    groups = [dataclasses.asdict(g) for g in in_flight + [partial]]  # the run loop hands over JSON data
    extra = {"cursor": 11, "in_flight": groups, "queue": [], "lag": {"2": [8, 9], "3": [10]},
             "nested": {"ids": (1, 2), "none": None, "flag": True, "text": "é\n"}, "scores": [0.1, -1e-30, 3.5]}
    path = save_checkpoint(tmp_path, state, extra=extra)
    after_save = (torch.rand(5), random.random(), np.random.rand())
    saved_weights, saved_opt = weights(state.policy), copy.deepcopy(state.optimizer.state_dict())
    saved_sched = state.scheduler.state_dict()

    fresh = build("grpo", seed=1, algo_kwargs=dict(kl_loss_coef=0.05))
    assert max_diff(weights(fresh.policy), saved_weights) > 1e-2
    got = load_checkpoint(path, fresh)
    after_load = (torch.rand(5), random.random(), np.random.rand())
    assert torch.equal(after_load[0], after_save[0]) and after_load[1:] == after_save[1:]
    assert got == json.loads(json.dumps(extra))  # parsed JSON: the tuple comes back as a list
    assert got["nested"]["ids"] == [1, 2] and got["scores"] == [0.1, -1e-30, 3.5]  # floats exact
    rebuilt = [Group(**{**g, "completions": [Completion(**c) for c in g["completions"]],
                         "info": GroupInfo.from_json(g["info"])}) for g in got["in_flight"]]
    assert rebuilt == in_flight + [partial]
    assert rebuilt[-1].completions[0].finish_reason is None  # still generating when saved

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


# ------------------------------------------------------------------------------------ failed saves
def _files(run_dir) -> dict[str, bytes]:
    """Every file under run_dir/checkpoints with its bytes: what a failed save must leave untouched."""
    root = run_dir / "checkpoints"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tmp_dirs(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("*.tmp"))


def _half_written_then(error: BaseException):
    """A torch.save that writes part of the file, as a write that dies midway does, then raises `error`."""
    def save(obj, f, *args, **kwargs):
        with open(f, "wb") as out:
            out.write(b"PK\x03\x04 half a zip")
        raise error
    return save


def _saved_twice(run_dir):
    state = build("grpo")
    for step in (1, 2):
        state.step = step
        save_checkpoint(run_dir, state, extra={"cursor": step})
    return state


def test_a_full_disk_during_the_write_is_named_and_leaves_no_tmp(tmp_path, monkeypatch):
    state = _saved_twice(tmp_path)
    before = _files(tmp_path)
    monkeypatch.setattr("asyncrl.checkpoint.files.torch.save",
                        _half_written_then(OSError(errno.ENOSPC, "No space left on device")))
    state.step = 3
    with pytest.raises(CheckpointError, match="no space left on device") as caught:
        save_checkpoint(tmp_path, state, extra={"cursor": 3})
    assert str(tmp_path / "checkpoints" / "step_00000003") in str(caught.value)
    assert "free space or point --run-dir elsewhere" in str(caught.value)
    assert isinstance(caught.value, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert _tmp_dirs(tmp_path) == [] and _files(tmp_path) == before
    assert load_checkpoint(latest_checkpoint(tmp_path), build("grpo")) == {"cursor": 2}


def test_torch_saves_unexpected_pos_on_a_full_disk_is_named_too(tmp_path, monkeypatch):
    """torch.save reports a full disk as RuntimeError('[enforce fail at inline_container.cc] unexpected
    pos'), with no errno: the free space left after the failure tells."""
    state = _saved_twice(tmp_path)
    before = _files(tmp_path)
    real_usage = shutil.disk_usage
    disk_full = []  # set once the write has failed

    def usage(path):
        return real_usage(path)._replace(free=4096) if disk_full else real_usage(path)

    def save(obj, f, *args, **kwargs):
        disk_full.append(True)
        _half_written_then(RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 1"))(obj, f)

    monkeypatch.setattr("asyncrl.checkpoint.files.shutil.disk_usage", usage)
    monkeypatch.setattr("asyncrl.checkpoint.files.torch.save", save)
    state.step = 3
    with pytest.raises(CheckpointError, match="no space left on device") as caught:
        save_checkpoint(tmp_path, state)
    assert "0.0 MB free" in str(caught.value) and "unexpected pos" in str(caught.value.__cause__)
    assert _tmp_dirs(tmp_path) == [] and _files(tmp_path) == before


def test_too_little_free_space_refuses_before_writing_anything(tmp_path, monkeypatch):
    state = build("grpo")
    disk = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("asyncrl.checkpoint.files.shutil.disk_usage", lambda path: disk._replace(free=10**6))
    monkeypatch.setattr("asyncrl.checkpoint.files.torch.save", lambda *a, **k: pytest.fail("wrote despite no space"))
    with pytest.raises(CheckpointError, match=r"needs ~\d+\.\d MB, 1\.0 MB free") as caught:
        save_checkpoint(tmp_path / "run", state)
    assert str(tmp_path / "run" / "checkpoints" / "step_00000000") in str(caught.value)
    assert not (tmp_path / "run").exists()  # not even the checkpoints directory

    # the estimate covers every tensor (weights and both Adam moments after a step) plus the margin
    run = SyncRun("grpo")
    run.step()
    nbytes = sum(p.numel() * p.element_size() for p in run.state.policy.parameters())
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(tmp_path / "run", run.state)
    needed_mb = float(str(caught.value).split("needs ~")[1].split(" MB")[0])
    assert 3 * nbytes / 1e6 < needed_mb < 3 * nbytes / 1e6 + 2 + 17  # + 2%-ish + the 16 MiB margin


def test_any_other_failure_propagates_unchanged_and_leaves_the_old_checkpoints(tmp_path, monkeypatch):
    state = _saved_twice(tmp_path)
    before = _files(tmp_path)
    monkeypatch.setattr("asyncrl.checkpoint.files.torch.save", _half_written_then(RuntimeError("serialiser bug")))
    for step in (3, 2):  # a new step, and a re-save over an existing one
        state.step = step
        with pytest.raises(RuntimeError, match="serialiser bug") as caught:
            save_checkpoint(tmp_path, state, extra={"cursor": 99})
        assert type(caught.value) is RuntimeError
        assert _tmp_dirs(tmp_path) == [] and _files(tmp_path) == before
    monkeypatch.setattr("asyncrl.checkpoint.files.torch.save", _half_written_then(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, state)
    assert _tmp_dirs(tmp_path) == [] and _files(tmp_path) == before
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert load_checkpoint(latest_checkpoint(tmp_path), build("grpo")) == {"cursor": 2}


def test_a_stale_tmp_from_a_crashed_save_is_ignored_then_removed_by_the_next_save(tmp_path):
    state = _saved_twice(tmp_path)
    stale = tmp_path / "checkpoints" / "step_00000005.tmp"  # another step than the next save's
    stale.mkdir()
    (stale / "learner.pt").write_bytes(b"PK\x03\x04 half a zip")
    assert latest_checkpoint(tmp_path).name == "step_00000002"
    state.step = 3
    save_checkpoint(tmp_path, state)
    assert not stale.exists() and _tmp_dirs(tmp_path) == []
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002", "step_00000003"]


# ----------------------------------------------------------------------- weights_only, JSON extra
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_learner_pt_loads_with_weights_only_and_round_trips(tmp_path, algorithm):
    run = SyncRun(algorithm)
    run.step()
    path = save_checkpoint(tmp_path, run.state, extra={"cursor": run.cursor})
    saved = torch.load(path / "learner.pt", weights_only=True)  # unpickles no arbitrary objects
    want = {"policy", "optimizer", "scheduler", "counters", "config", "rng"}
    assert saved.keys() == want | ({"critic", "critic_optimizer", "critic_scheduler"} if algorithm == "ppo" else set())
    assert saved["config"] == dataclasses.asdict(run.state.policy.config)
    assert saved["counters"]["step"] == 1 and set(saved["rng"]) >= {"torch", "python", "numpy"}

    fresh = build(algorithm, seed=1, algo_kwargs=ALGORITHMS[algorithm])
    assert load_checkpoint(path, fresh) == {"cursor": PROMPTS_PER_STEP}
    assert max_diff(weights(fresh.policy), weights(run.state.policy)) == 0
    if algorithm == "ppo":
        assert max_diff(weights(fresh.critic), weights(run.state.critic)) == 0
        assert fresh.critic_scheduler.state_dict() == run.state.critic_scheduler.state_dict()
        assert torch.equal(fresh.critic_optimizer.state_dict()["state"][0]["exp_avg"],
                           run.state.critic_optimizer.state_dict()["state"][0]["exp_avg"])

    from asyncrl.policies import load_model
    exported = load_model(str(export_hf(path, tmp_path / "hf")))
    architecture = [dataclasses.replace(c, hf_config={}) for c in (exported.config, run.state.policy.config)]
    assert architecture[0] == architecture[1]  # hf_config gains the keys save_pretrained writes
    ids = torch.tensor([prompt_for(0) + [40, 41, 42]])
    with torch.no_grad():
        want, got = run.state.policy.logits(run.state.policy(ids)), exported.logits(exported(ids))
    assert torch.equal(got, want)  # the same weights through the same code, in float32


def test_extra_that_is_not_json_data_raises_naming_the_key_and_writes_nothing(tmp_path):
    state = build("grpo")
    group = Group(10, prompt_for(10), [Completion([5, 6], [-1.5, -2.0], [2, 3], "stop")], [1.0])
    bad = [({"cursor": 1, "queue": {"queue": [group]}}, "extra['queue']['queue'][0]: Group is not JSON-serialisable"),
           ({"tensor": torch.arange(3)}, "extra['tensor']: Tensor is not JSON-serialisable"),
           ({"seen": {3, 4}}, "extra['seen']: set is not JSON-serialisable"),
           ({"count": np.int64(3)}, "extra['count']: int64 is not JSON-serialisable"),
           ({"lag": {2: [8, 9]}}, "extra['lag']: key 2 is a int, JSON keys are str")]
    for extra, message in bad:
        with pytest.raises(TypeError, match=re.escape(message)):
            save_checkpoint(tmp_path, state, extra=extra)
    assert not (tmp_path / "checkpoints").exists()


def test_older_checkpoints_load_only_when_weights_only_can_read_them(tmp_path):
    path = save_checkpoint(tmp_path, build("grpo"), extra={"cursor": 5})
    (path / "extra.json").unlink()
    torch.save({"cursor": 5, "lag": [1, 2]}, path / "extra.pt")  # the older layout, plain data: readable
    assert load_checkpoint(path, build("grpo")) == {"cursor": 5, "lag": [1, 2]}
    group = Group(10, prompt_for(10), [Completion([5], [-1.5], [2], "stop")], [1.0])
    torch.save({"queue": [group]}, path / "extra.pt")  # pickled objects: refused, naming the file
    with pytest.raises(ValueError, match=re.escape(str(path / "extra.pt"))):
        load_checkpoint(path, build("grpo"))
    (path / "extra.pt").unlink()
    with pytest.raises(ValueError, match="extra.json"):
        load_checkpoint(path, build("grpo"))
    # an older learner.pt pickled the model config as its dataclass: refused, naming the file and the class
    (path / "extra.json").write_text("{}")
    state = build("grpo")
    torch.save({**torch.load(path / "learner.pt", weights_only=True), "config": state.policy.config},
               path / "learner.pt")
    for load in (lambda: load_checkpoint(path, state), lambda: export_hf(path, tmp_path / "hf")):
        with pytest.raises(ValueError, match=re.escape(str(path / "learner.pt")) + ".*TransformerConfig"):
            load()


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
        # transformers' kernels against ours: rounding only (~1e-4 at most); a wrong weight is O(0.1)
        torch.testing.assert_close(got, want, rtol=0, atol=forward_tol(want, state.policy.config))
    assert (live / "model.safetensors").read_bytes() == (from_ckpt / "model.safetensors").read_bytes()


def test_group_info_of_an_older_checkpoint_keeps_the_fields_it_knows():
    # before GroupInfo, a group's info was a free-form dict: unknown keys are left out, known ones kept
    raw = {"agent": "agent0", "texts": ["a", "b"], "answer": "42", "env": {"turns": 4}}
    assert GroupInfo.from_json(raw) == GroupInfo(agent="agent0", texts=["a", "b"], env={"turns": 4})
