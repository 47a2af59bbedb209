"""FSDP2 on the HF path: a transformers model (`HFCausalLM`) sharded over 2 CPU processes (gloo), wrapped by its
`_no_split_modules`, takes the same GRPO step as one unsharded process, and publishes the same full weights under
its checkpoint's names (Qwen3-MoE: experts fused in memory, per expert in the publication)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
import torch.distributed as dist

from asyncrl.config import GRPO
from asyncrl.learner import build_learner, full_weights, shard_model, train_step
from asyncrl.policies.loading import load_model
from tests.dist_helpers import max_diff, run_distributed
from tests.learner_helpers import on_policy, synthetic_groups, trainer_config
from tests.timing import limit
from tests.tolerances import close_tol

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::UserWarning")]

TYPES = ("gemma3_text", "qwen3_moe")


def _groups(policy, *, routed: bool = False):
    """Four groups of four on-policy samples; `routed`: each sample carries engine routes (vLLM's layout, [positions,
    layers, top_k]) of random distinct experts, seeded, so every process sees the same."""
    groups = on_policy(policy, synthetic_groups(4, 4, seed=3, response_lens=(2, 6)))
    if not routed:
        return groups
    gen = torch.Generator().manual_seed(11)
    from asyncrl.policies.routing_replay import find_routers
    _, router = find_routers(policy)[0]
    layers, experts, top_k = policy.config.hf_config["num_hidden_layers"], int(router.num_experts), int(router.top_k)
    out = []
    for g in groups:
        completions = []
        for c in g.completions:
            positions = len(g.prompt_ids) + len(c.token_ids) - 1
            routes = torch.rand(positions, layers, experts, generator=gen).argsort(-1)[..., :top_k]
            completions.append(dataclasses.replace(c, routes=routes.to(torch.int16).numpy()))
        out.append(dataclasses.replace(g, completions=completions))
    return out


def _step(path: str, *, sharded: bool, replay: str = "off", epochs: int = 1) -> tuple[dict, dict]:
    """One GRPO step from the model at `path`: (full weights by checkpoint name after it, its metrics). With
    `replay` r3 the samples carry engine routes the step replays. `epochs` 2: shuffled mini-batches of 2 groups over
    2 epochs, so a rank trains rows whose forwards another rank ran (with r2, their recorded routes travel to it)."""
    policy = load_model(path)
    groups = _groups(policy, routed=replay == "r3")
    if sharded:
        shard_model(policy)
    batches = dict(ppo_epochs=2, mini_batch_size=2, shuffle=True) if epochs == 2 else {}
    state = build_learner(policy, trainer_config(lr=1e-2, routing_replay=replay, **batches), GRPO(),
                          group=dist.group.WORLD if sharded else None)
    state, metrics = train_step(state, groups)
    return {n: t.clone() for n, t in full_weights(state.policy)}, metrics


def hf_fsdp_worker(rank: int, world: int, out: pathlib.Path, paths: dict[str, str]) -> None:
    torch.manual_seed(0)
    results = {}
    for model_type, path in paths.items():
        weights, metrics = _step(path, sharded=True)
        results[model_type] = dict(weights=weights)
    weights, metrics = _step(paths["qwen3_moe"], sharded=True, replay="r3")
    results["qwen3_moe/r3"] = dict(weights=weights, disagreement=metrics.get("rollout_corr/routing_disagreement"))
    results["qwen3_moe/r2/epochs"] = dict(weights=_step(paths["qwen3_moe"], sharded=True, replay="r2", epochs=2)[0])
    torch.save(results, pathlib.Path(out) / f"rank{rank}.pt")


def test_a_sharded_hf_model_takes_the_step_of_one_process(hf_zoo, tmp_path):
    paths = {t: str(hf_zoo(t)) for t in TYPES}
    run_distributed(hf_fsdp_worker, tmp_path, paths, world_size=2, timeout=limit(120))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for model_type, path in paths.items():
        single, metrics = _step(path, sharded=False)
        for rank in ranks:
            got = rank[model_type]["weights"]
            assert got.keys() == single.keys()
            scale = max(float(t.abs().max()) for t in single.values())
            assert max_diff(got, single) <= close_tol(torch.float32, scale, terms=64, depth=8), model_type
        if model_type == "qwen3_moe":
            assert "model.layers.1.mlp.experts.2.down_proj.weight" in single
    # r3: each rank trains the rows dealt to it on the engine routes of those rows (random experts, so a route
    # read for another token would change the step): the group's step is the one process's
    single, metrics = _step(paths["qwen3_moe"], sharded=False, replay="r3")
    assert metrics["rollout_corr/routing_disagreement"] > 0.3  # the random routes differ from the router's choice
    scale = max(float(t.abs().max()) for t in single.values())
    assert ranks[0]["qwen3_moe/r3"]["disagreement"] == pytest.approx(metrics["rollout_corr/routing_disagreement"])
    for rank in ranks:
        got = rank["qwen3_moe/r3"]
        assert max_diff(got["weights"], single) <= close_tol(torch.float32, scale, terms=64, depth=8)
    # r2 over 2 shuffled epochs: a rank replays, for rows another rank ran the π_old pass of, the routes that pass
    # recorded there (they travel through rank 0)
    epochs, _ = _step(paths["qwen3_moe"], sharded=False, replay="r2", epochs=2)
    for rank in ranks:
        assert max_diff(rank["qwen3_moe/r2/epochs"]["weights"], epochs) <= close_tol(torch.float32, scale, terms=64,
                                                                                     depth=8)
    plain, _ = _step(paths["qwen3_moe"], sharded=False)
    assert max_diff(plain, single) > 10 * close_tol(torch.float32, scale, terms=64, depth=8)  # replay mattered
