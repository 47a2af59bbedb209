"""FSDP2 (`shard_model`, i.e. `fully_shard`) on 2 CPU processes over gloo against one unsharded process:
the policy gradient (packed micro-batches on the ranks, against packed and padded ones in one process), a
whole train_step (GRPO, and PPO with its critic; also with the shards offloaded to the host), and checkpoints
written by one layout and read by the other.

Each rank of a sharded learner takes the groups `balance_groups` deals it (token counts even). With 5 groups
the ranks hold different row counts and different numbers of micro-batches (the learner pads with empty ones so the FSDP2
collectives line up), and the one-group mini-batches of a train_step (mini_batch_size=2) leave rank 1
with no rows at all.

All sharded scenarios run in one launch of two workers (`dist_helpers.fsdp_worker`; a launch costs two
torch imports), under a hard time limit and with a 60 s collective timeout (both × the suite's time scale,
tests/timing.py), so a hang fails the tests.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from asyncrl.learner import balance_groups, policy_gradients, split_rows, train_step
from asyncrl.policies import load_pretrained
from tests.dist_helpers import (
    build, clipped_grads, fsdp_worker, known_grads, max_diff, recompute_config, run_distributed, tiny_policy,
    trainer_config, weights,
)
from tests.timing import limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORLD = 2
MODES = ["token-mean", "seq-mean-token-mean"]


@pytest.fixture(scope="module")
def single(groups, next_groups, tmp_path_factory):
    """The single-process PPO run: one step on `groups`, a checkpoint, one step on `next_groups`."""
    state, _ = train_step(build("ppo"), groups)
    path = save_checkpoint(tmp_path_factory.mktemp("single-run"), state, extra={"cursor": 5})
    saved = dict(policy=weights(state.policy), critic=weights(state.critic))
    state, _ = train_step(state, next_groups)
    return dict(path=path, saved=saved, continued=dict(policy=weights(state.policy), critic=weights(state.critic)))


@pytest.fixture(scope="module")
def sharded(groups, next_groups, single, tmp_path_factory):
    """The results of every rank of the sharded launch, and its run / export directories."""
    root = tmp_path_factory.mktemp("sharded")
    out, run_dir, export_dir = root / "out", root / "run", root / "export"
    out.mkdir()
    run_distributed(fsdp_worker, out, groups, next_groups, MODES, str(single["path"]), str(run_dir),
                    str(export_dir), world_size=WORLD, timeout=limit(90))
    return dict(ranks=[torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)], run_dir=run_dir,
                export_dir=export_dir)


def test_the_ranks_get_different_rows_and_micro_batch_counts(groups):
    """The premise of the gradient test: the split of the 5 groups is uneven in rows and micro-batches."""
    lengths = [len(g.prompt_ids) + len(c.token_ids) for g in groups for c in g.completions]
    group_of_row = [k for k, g in enumerate(groups) for _ in g.completions]
    tokens = {k: sum(n for n, g in zip(lengths, group_of_row) if g == k) for k in range(len(groups))}
    dealt = balance_groups(list(range(len(groups))), tokens, WORLD)
    rows = [[r for r, k in enumerate(group_of_row) if k in dealt[rank]] for rank in range(WORLD)]
    micros = [split_rows(r, lengths, trainer_config()) for r in rows]
    assert len(rows[0]) != len(rows[1])
    assert len(micros[0]) != len(micros[1]), micros
    assert len({len(c.token_ids) for g in groups for c in g.completions}) > 2  # varied response lengths


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_sharded_grad_norm_equals_the_unsharded_norm_and_clips_the_same(sharded, max_norm):
    """`grad_norm_` over FSDP2 shards (one all-reduce of a scalar) against the same gradients unsharded, and
    against torch's own clip_grad_norm_ on one process."""
    want = clipped_grads(sharded=False, max_norm=max_norm)
    params = [torch.nn.Parameter(g.clone()) for g in known_grads(tiny_policy()).values()]
    for p in params:
        p.grad = p.detach().clone()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))
    assert want["norm"] == pytest.approx(torch_norm, rel=1e-6)
    assert want["norm"] > 10  # clip 0.5 really scales, 1e6 really does not
    for rank, res in enumerate(sharded["ranks"]):
        got = res["clip"][max_norm]
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-6), rank
        assert max_diff(got["grads"], want["grads"]) <= 1e-6, rank
    if max_norm == 0.5:
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want["grads"].values()]))
        assert float(total) == pytest.approx(0.5, rel=1e-5)
        assert max_diff(want["grads"], {n: p.grad for n, p in zip(want["grads"], params)}) <= 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_sharded_policy_gradient_equals_the_single_process_gradient(groups, sharded, mode):
    want = policy_gradients(build("grpo", algo_kwargs=dict(loss_agg_mode=mode)), groups)
    scale = max(float(g.abs().max()) for g in want.values())
    assert scale > 1e-3  # a real gradient, not zeros
    for rank, res in enumerate(sharded["ranks"]):
        got = res["grads"][mode]
        assert got.keys() == want.keys()
        assert all(got[k].shape == want[k].shape for k in got)  # full_tensor(): unsharded shapes
        assert max_diff(got, want) <= 1e-6 * scale, (rank, max_diff(got, want), scale)
    # a wrong scale (FSDP2's average over ranks not undone) would be off by a factor of 2
    assert max_diff(sharded["ranks"][0]["grads"][mode], {k: v / 2 for k, v in want.items()}) > 0.1 * scale


def test_sharded_packed_gradient_equals_the_single_process_padded_gradient(groups, sharded):
    """The sharded learner packs its micro-batches (the default); one process padding its rows gets the
    same gradient."""
    want = policy_gradients(build("grpo", config=trainer_config(pack_sequences=False),
                                  algo_kwargs=dict(loss_agg_mode=MODES[0])), groups)
    scale = max(float(g.abs().max()) for g in want.values())
    for rank, res in enumerate(sharded["ranks"]):
        assert max_diff(res["grads"][MODES[0]], want) <= 1e-6 * scale, rank


def test_lm_head_chunk_counts_that_differ_between_ranks_keep_the_gradient(groups, sharded):
    """With 3-token LM-head chunks each rank runs as many chunks as its rows need, and the ranks hold different
    rows: the root's collectives must not depend on the chunk count (they did, and NCCL hung)."""
    want = policy_gradients(build("grpo"), groups)
    scale = max(float(g.abs().max()) for g in want.values())
    for rank, res in enumerate(sharded["ranks"]):
        assert max_diff(res["grads_chunked"], want) <= 1e-6 * scale, rank


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_sharded_train_step_updates_like_a_single_process(groups, sharded, algorithm):
    """6 optimizer steps (mini-batches of 2, 2 and 1 groups × 2 epochs), clipped gradients, warmup + cosine
    lr; PPO also updates its critic (sequentially with the actor when sharded)."""
    initial = build(algorithm)
    state, metrics = train_step(build(algorithm), groups)
    want = weights(state.policy)
    assert max_diff(want, weights(initial.policy)) > 1e-3  # the step moved the weights
    for rank, res in enumerate(sharded["ranks"]):
        got = res["train"][algorithm]
        assert max_diff(got["policy"], want) <= 1e-5, (rank, max_diff(got["policy"], want))
        if algorithm == "ppo":
            critic = weights(state.critic)
            assert max_diff(critic, weights(initial.critic)) > 1e-3  # the critic learned too
            assert max_diff(got["critic"], critic) <= 1e-5
        m = got["metrics"]
        assert m["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-5)
        assert m["actor/lr"] == pytest.approx(metrics["actor/lr"], rel=1e-9)
        assert m["training/global_step"] == metrics["training/global_step"] == 1
        if rank == 0:  # the rank holding the whole batch reports the batch's metrics; the others hold only a share
            assert m["critic/score/mean"] == pytest.approx(metrics["critic/score/mean"])
        else:
            assert "critic/score/mean" not in m
        # losses and token means are reduced over the group: every rank reports the single process's
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
            assert m[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), (rank, key)


def test_recomputed_old_log_probs_are_the_single_process_s_though_each_rank_runs_only_its_rows(groups, sharded):
    """π_old recomputed: each rank runs the no-grad forward of the rows dealt it, rank 0 gathers them and hands each
    rank its share back; the step (weights, the train–rollout mismatch rank 0 reports) is the single process's."""
    state, metrics = train_step(build("grpo", config=recompute_config()), groups)
    want = weights(state.policy)
    for rank, res in enumerate(sharded["ranks"]):
        got = res["train_recompute"]
        assert max_diff(got["policy"], want) <= 1e-5, (rank, max_diff(got["policy"], want))
    key = "rollout_corr/mismatch_kl"
    assert sharded["ranks"][0]["train_recompute"]["metrics"][key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7)


def test_cpu_offloaded_shards_train_like_a_single_process(groups, sharded):
    """`--trainer.offload params`: FSDP2 keeps the shards (the critic's too) and their optimizer state on the
    host; the PPO step is the single process's."""
    state, _ = train_step(build("ppo"), groups)
    for rank, res in enumerate(sharded["ranks"]):
        got = res["offloaded"]
        assert got["offloaded"], rank
        assert max_diff(got["policy"], weights(state.policy)) <= 1e-5, rank
        assert max_diff(got["critic"], weights(state.critic)) <= 1e-5, rank


def test_sharded_checkpoint_round_trips_and_matches_the_single_process_one(sharded, single):
    """Sharded save → sharded load: the same weights, then the same next step (optimizer state restored).
    A checkpoint written by one process → the sharded learner: the same, and the single run's next step."""
    (path,) = list_checkpoints(sharded["run_dir"])
    assert path.name == "step_00000001"
    assert sorted(p.name for p in path.iterdir()) == ["extra.json", "learner.pt", "meta.json"]
    for res in sharded["ranks"]:
        saved = res["train"]["ppo"]
        assert max_diff(res["loaded"]["policy"], saved["policy"]) == 0
        assert max_diff(res["loaded"]["critic"], saved["critic"]) == 0
        assert res["extra"] == {"cursor": 17, "rank": 0}  # rank 0 wrote it; every rank read it back
        assert res["loaded"]["counters"] == (1, 6, 0)
        assert res["loaded"]["lr"] == [pytest.approx(saved["metrics"]["actor/lr"], rel=1e-12)]
        for part in ("policy", "critic"):
            assert max_diff(res["loaded_continued"][part], res["continued"][part]) <= 1e-6, part
            assert max_diff(res["from_single"][part], single["saved"][part]) == 0, part
            assert max_diff(res["from_single_continued"][part], single["continued"][part]) <= 1e-5, part


def test_a_restored_shard_snapshot_takes_the_same_step_again(sharded):
    """Each rank's `ShardSnapshot` (its shards, their AdamW moments, schedules, counters, RNG) taken at a version
    boundary and restored after the next step: the weights of the boundary, and the same step again, bitwise; the
    same from the packed snapshot loaded into a fresh sharded learner; the ring exchange of packed snapshots."""
    for res in sharded["ranks"]:
        for part in ("policy", "critic"):
            assert max_diff(res["restored"][part], res["train"]["ppo"][part]) == 0, part
            assert max_diff(res["restored_continued"][part], res["continued"][part]) == 0, part
            assert max_diff(res["continued"][part], res["train"]["ppo"][part]) > 1e-4, part  # the step moved them
        assert res["restored"]["step"] == 1
        for part in ("policy", "critic"):  # a replacement's path: the packed shard into a fresh sharded learner
            assert max_diff(res["fresh_from_packed"][part], res["continued"][part]) == 0, part
    for rank, res in enumerate(sharded["ranks"]):  # rank r holds its predecessor's packed snapshot, byte for byte
        text, flat = sharded["ranks"][(rank - 1) % WORLD]["ring"]["own"]
        got_text, got_flat = res["ring"]["replica"]
        assert got_text == text and torch.equal(got_flat, flat)
    assert not torch.equal(sharded["ranks"][0]["ring"]["own"][1], sharded["ranks"][1]["ring"]["own"][1])


def test_a_single_process_loads_the_sharded_checkpoint(sharded, next_groups):
    """The sharded checkpoint holds full (unsharded) tensors: one process loads it and takes the same
    next step as the sharded run."""
    (path,) = list_checkpoints(sharded["run_dir"])
    res = sharded["ranks"][0]
    fresh = build("ppo", seed=3)
    assert load_checkpoint(path, fresh) == {"cursor": 17, "rank": 0}
    assert max_diff(weights(fresh.policy), res["train"]["ppo"]["policy"]) == 0
    assert max_diff(weights(fresh.critic), res["train"]["ppo"]["critic"]) == 0
    assert (fresh.step, fresh.optimizer_steps) == (1, 6)
    fresh, _ = train_step(fresh, next_groups)
    assert max_diff(weights(fresh.policy), res["continued"]["policy"]) <= 1e-5
    assert max_diff(weights(fresh.critic), res["continued"]["critic"]) <= 1e-5


def test_export_hf_from_a_sharded_learner(sharded):
    """Every rank called export_hf; rank 0 wrote the full model."""
    exported = load_pretrained(sharded["export_dir"])
    assert max_diff(weights(exported), sharded["ranks"][0]["train"]["ppo"]["policy"]) == 0


def test_count_all_reduce_uses_the_groups_device(monkeypatch):
    """NCCL reduces only accelerator tensors: the learner's count all-reduce must follow the group's backend
    (a host tensor stopped every multi-rank GPU run at its first step)."""
    import torch.distributed as dist

    from asyncrl.learner import update as learner
    seen = []

    class State:
        group = object()
        device = torch.device("meta")  # stands in for the trainer's GPU

    monkeypatch.setattr(learner, "world", lambda state: (0, 2))
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: seen.append(t.device))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: [0.0])
    for backend, expected in (("nccl", "meta"), ("gloo", "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group, b=backend: b)
        learner._all_reduce(State(), [1.0])
        assert seen[-1].type == expected, backend
