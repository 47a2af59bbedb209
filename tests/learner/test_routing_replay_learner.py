"""`--trainer.routing-replay r2` in the learner: routes recorded in the pass that computes π_old travel with their
tokens through any micro-batch layout (the route grid of asyncrl/learner/routes.py), are replayed in the updates,
and `actor/routing_disagreement` reports how many choices the updated routers would have changed; configurations
that cannot replay are refused naming the flag."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config import GRPO, TrainerConfig
from asyncrl.learner import build_learner, collate, plan_micro_batches, split_rows, train_step
from asyncrl.learner.forward import micro_logprobs, row_lengths
from asyncrl.learner.layout import RowLengths
from asyncrl.learner.prepare import prepare
from asyncrl.learner.routes import empty_routes, micro_routes, real_tokens, store_routes
from asyncrl.policies import load_model
from tests.learner_helpers import on_policy, synthetic_groups, tiny_policy, trainer_config


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=8),
       st.integers(4, 40), st.integers(4, 40), st.booleans(), st.booleans())
def test_routes_written_in_one_layout_are_read_by_their_tokens_in_another(rows, budget_a, budget_b, packed_a,
                                                                           packed_b):
    """Each token's route is its own grid cell's number: written through layout A's micro-batches, read through
    B's (packed or padded, other splits), every real token reads its own number."""
    prompt, response = [p for p, _ in rows], [r for _, r in rows]
    width = max(p + r for p, r in rows) + 2
    lengths = RowLengths(prompt, response, width)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    totals = [lengths.total(r) for r in range(len(rows))]
    grid = empty_routes(len(rows), width, routers=1, top_k=1, device="cpu")
    for packed, budget, write in ((packed_a, budget_a, True), (packed_b, budget_b, False)):
        cfg = TrainerConfig(max_tokens_per_micro_batch=budget, pack_sequences=packed)
        for micro in plan_micro_batches(tokens, split_rows(list(range(len(rows))), totals, cfg), lengths,
                                        packed=packed):
            if write:
                store_routes(grid, micro, micro.token_index.view(-1, 1, 1))
                continue
            read = micro_routes(grid, micro).view(-1)
            real = real_tokens(micro, lengths)
            assert torch.equal(read[real].long(), micro.token_index[real])


@pytest.fixture(scope="module")
def moe_policy(hf_zoo):
    return load_model(str(hf_zoo("qwen3_moe")))


def test_r2_routes_follow_their_tokens_from_the_packed_pass_into_padded_updates(moe_policy):
    """π_old's pass (packed, 64-token micro-batches) records the routes; a padded layout of other micro-batches
    replays them: no router's choice differs from the replayed one, and the log-probs equal the unreplayed ones."""
    groups = on_policy(moe_policy, synthetic_groups(3, 3, seed=4, prompt_lens=(2, 9), response_lens=(1, 12)))
    state = build_learner(moe_policy, trainer_config(routing_replay="r2", use_dynamic_bsz=True,
                                                     max_tokens_per_micro_batch=64), GRPO())
    batch = collate(groups)
    prep = prepare(state, batch)
    assert prep.routes is not None and prep.routes.shape[1:] == (2, 2)
    lengths = row_lengths(batch)
    padded = TrainerConfig(max_tokens_per_micro_batch=100, pack_sequences=False)
    for micro in plan_micro_batches(batch.tokens, split_rows(list(range(batch.num_rows)), prep.totals(), padded),
                                    lengths, packed=False):
        with torch.no_grad():
            plain, _ = micro_logprobs(state.policy, micro, batch.response_mask.shape[1])
            with state.moe.replaying(micro_routes(prep.routes, micro), real_tokens(micro, lengths)) as replayed:
                again, _ = micro_logprobs(state.policy, micro, batch.response_mask.shape[1])
        assert replayed.disagreement() == 0.0
        assert torch.allclose(again, plain, atol=1e-5)


def test_an_r2_step_reports_the_routers_disagreement(hf_zoo):
    """Two epochs at a large learning rate move the routers: the step trains, and the metric is a share."""
    policy = load_model(str(hf_zoo("qwen3_moe")))
    groups = on_policy(policy, synthetic_groups(4, 4, seed=5, prompt_lens=(2, 9), response_lens=(2, 12)))
    state = build_learner(policy, trainer_config(routing_replay="r2", ppo_epochs=2, lr=5e-2, mini_batch_size=2),
                          GRPO())
    _, metrics = train_step(state, groups)
    assert 0.0 <= metrics["actor/routing_disagreement"] <= 1.0
    assert metrics["actor/routing_disagreement"] > 0  # the first update moved the routers of the later ones


def test_configurations_that_cannot_replay_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--trainer.routing-replay r2: .*no mixture-of-experts router"):
        build_learner(tiny_policy(), trainer_config(routing_replay="r2"), GRPO())
    with pytest.raises(ValueError, match="--trainer.cuda-graphs"):
        TrainerConfig(routing_replay="r2", cuda_graphs=True).validate()


def test_the_checks_before_launch_refuse_replay_without_moe_routers(hf_zoo):
    """Before any process: an own model and a dense HF-path model are refused naming the flag; a MoE passes."""
    import dataclasses

    from asyncrl.config.presets import CPU_DEMO
    from asyncrl.launch.model_checks import implementation_problems

    def problems(path: str) -> list[str]:
        trainer = dataclasses.replace(CPU_DEMO.trainer, routing_replay="r2", freeze_router=True,
                                      router_aux_loss_coef=0.01)
        cfg = dataclasses.replace(CPU_DEMO, model=dataclasses.replace(CPU_DEMO.model, path=path), trainer=trainer)
        return [p for p in implementation_problems(cfg) if "mixture-of-experts" in p]

    assert problems(str(hf_zoo("qwen3_moe"))) == []
    replay, freeze, aux = problems(str(hf_zoo("olmo2")))
    assert aux.startswith("--trainer.router-aux-loss-coef 0.01: ")
    assert replay.startswith("--trainer.routing-replay r2: ") and "(olmo2) is not a mixture-of-experts model" in replay
    assert freeze.startswith("--trainer.freeze-router: ") and replay.endswith("; leave it off")
    own = problems("random:tiny-qwen2")
    assert len(own) == 3 and "runs on asyncrl's own model, which has no mixture-of-experts routers" in own[0]


def test_frozen_routers_keep_their_weights_while_the_experts_train(hf_zoo):
    policy = load_model(str(hf_zoo("qwen3_moe")))
    from asyncrl.policies.routing_replay import find_routers
    before = {name: r.weight.detach().clone() for name, r in find_routers(policy)}
    experts = policy.hf.model.layers[0].mlp.experts.down_proj.detach().clone()
    groups = on_policy(policy, synthetic_groups(2, 4, seed=6, prompt_lens=(2, 6), response_lens=(2, 8)))
    state = build_learner(policy, trainer_config(freeze_router=True, lr=1e-2), GRPO())
    train_step(state, groups)
    for name, router in find_routers(policy):
        assert torch.equal(router.weight, before[name]) and not router.weight.requires_grad
    assert not torch.equal(policy.hf.model.layers[0].mlp.experts.down_proj, experts)
    with pytest.raises(ValueError, match="--trainer.freeze-router: CausalLM has no mixture-of-experts router"):
        build_learner(tiny_policy(), trainer_config(freeze_router=True), GRPO())


def test_a_moe_step_reports_expert_load_and_the_aux_loss_trains_the_routers(hf_zoo):
    from asyncrl.learner import policy_gradients
    from asyncrl.policies.routing_replay import find_routers
    policy = load_model(str(hf_zoo("qwen3_moe")))
    groups = on_policy(policy, synthetic_groups(2, 4, seed=7, prompt_lens=(2, 6), response_lens=(2, 8)))
    grads = {}
    for coef in (0.0, 0.5):
        state = build_learner(load_model(str(hf_zoo("qwen3_moe"))), trainer_config(router_aux_loss_coef=coef), GRPO())
        grads[coef] = policy_gradients(state, groups)
    routers = [f"{name}.weight" for name, _ in find_routers(policy)]
    assert routers == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert all(not torch.allclose(grads[0.0][k], grads[0.5][k]) for k in routers)
    _, metrics = train_step(build_learner(policy, trainer_config(), GRPO()), groups)
    assert 1.0 <= metrics["actor/moe/expert_load_max"] <= 4.0 and metrics["actor/moe/aux_loss"] > 0
    with pytest.raises(ValueError, match="--trainer.router-aux-loss-coef 0.1: CausalLM has no mixture-of-experts"):
        build_learner(tiny_policy(), trainer_config(router_aux_loss_coef=0.1), GRPO())


def test_a_model_that_repads_packed_rows_trains_and_replays_only_unpacked(hf_zoo):
    """Qwen3-Next (linear attention: packing off by its probe) runs a packed micro-batch as padded rows of its own:
    a step still reports its routers' load; r2 asks for --trainer.no-pack-sequences, with which it replays."""
    policy = load_model(str(hf_zoo("qwen3_next")))
    assert not policy.features.packing
    groups = on_policy(policy, synthetic_groups(2, 2, seed=8, prompt_lens=(2, 6), response_lens=(2, 6)))
    _, metrics = train_step(build_learner(policy, trainer_config(), GRPO()), groups)
    assert metrics["actor/moe/expert_load_max"] >= 1.0
    with pytest.raises(ValueError, match="packing probe failed.*add --trainer.no-pack-sequences"):
        build_learner(policy, trainer_config(routing_replay="r2", pack_sequences=True, use_dynamic_bsz=True), GRPO())
    state = build_learner(policy, trainer_config(routing_replay="r2", pack_sequences=False), GRPO())
    _, metrics = train_step(state, groups)
    assert metrics["actor/routing_disagreement"] >= 0.0


def _engine_routes(state, groups, *, flip: float = 0.0, seed: int = 0) -> list:
    """Per completion, what vLLM returns for it: the experts each layer chose for each position but the last
    ([total − 1, layers, top_k], here the policy's own choices), with a share `flip` of positions sent to other
    experts (an engine whose kernels routed them otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    experts = int(state.moe.routers[0][1].num_experts)
    out = []
    for g in groups:
        for c in g.completions:
            row = torch.tensor([g.prompt_ids + c.token_ids])
            with torch.no_grad(), state.moe.recording() as recorded:
                state.policy.hf(input_ids=row, use_cache=False)
            routes = recorded.routes()[:-1].clone()  # [positions, routers (= layers here), top_k]
            flipped = torch.rand(routes.shape[0], generator=gen) < flip
            routes[flipped] = (routes[flipped] + 1) % experts  # distinct experts, all of them others
            out.append(routes.to(torch.int16).numpy())
    return out


def _with_routes(groups, routes: list) -> list:
    import dataclasses
    it = iter(routes)
    return [dataclasses.replace(g, completions=[dataclasses.replace(c, routes=next(it)) for c in g.completions])
            for g in groups]


def test_r3_replays_the_engines_own_routes_to_the_same_logprobs_and_keeps_them_in_the_grid(hf_zoo):
    """Routes an engine running the same weights returns: π_old replayed on them equals the unreplayed π_old (fp32),
    no router disagrees, the grid holds them, and every position but each row's last came from the engine."""
    policy = load_model(str(hf_zoo("qwen3_moe")))
    groups = on_policy(policy, synthetic_groups(3, 2, seed=9, prompt_lens=(2, 9), response_lens=(1, 12)))
    plain = prepare(build_learner(policy, trainer_config(routing_replay="r2", use_dynamic_bsz=True,
                                                         max_tokens_per_micro_batch=48), GRPO()), collate(groups))
    state = build_learner(policy, trainer_config(routing_replay="r3", use_dynamic_bsz=True,
                                                 max_tokens_per_micro_batch=48), GRPO())
    batch = collate(_with_routes(groups, _engine_routes(state, groups)))
    assert batch.rollout_routes.dtype == torch.int16 and batch.rollout_routes.shape[1:] == (2, 2)
    prep = prepare(state, batch)
    assert prep.metrics["rollout_corr/routing_disagreement"] == 0.0
    rows = prep.totals()
    assert prep.metrics["rollout_corr/routed_fraction"] == pytest.approx(1 - len(rows) / sum(rows))
    assert torch.allclose(prep.logp_old, plain.logp_old, atol=1e-6)
    assert torch.equal(prep.routes, plain.routes)  # the engine's routes, and the learner's at each last position
    assert abs(prep.metrics["rollout_corr/mismatch_kl"]) < 1e-5


def test_r3_keeps_the_engines_experts_where_the_learner_would_choose_others(hf_zoo):
    """A third of the positions routed otherwise by the engine: the π_old pass replays them (its disagreement is
    that share), they stay in the grid for the updates, and the step's updates replay them with gradients reaching
    the routers; a sample without routes (resumed from a checkpoint) is routed by the learner."""
    policy = load_model(str(hf_zoo("qwen3_moe")))
    groups = on_policy(policy, synthetic_groups(3, 2, seed=10, prompt_lens=(3, 9), response_lens=(4, 12)))
    state = build_learner(policy, trainer_config(routing_replay="r3", lr=1e-2), GRPO())
    routes = _engine_routes(state, groups, flip=1 / 3, seed=1)
    routes[0] = None  # this sample brings none
    batch = collate(_with_routes(groups, routes))
    prep = prepare(state, batch)
    share = prep.metrics["rollout_corr/routing_disagreement"]
    assert 0.15 < share < 0.6
    width = batch.tokens.shape[1]
    for i, r in enumerate(routes):
        cells = prep.routes[i * width:i * width + prep.totals()[i] - 1]
        if r is not None:
            assert torch.equal(cells, torch.as_tensor(r))
    own = _engine_routes(state, groups[:1])[0]
    assert torch.equal(prep.routes[:own.shape[0]], torch.as_tensor(own))  # the learner's own choices
    from asyncrl.policies.routing_replay import find_routers
    before = {name: r.weight.detach().clone() for name, r in find_routers(policy)}
    _, metrics = train_step(state, groups=_with_routes(groups, routes))
    assert metrics["rollout_corr/routing_disagreement"] == pytest.approx(share)
    assert all(not torch.equal(r.weight, before[name]) for name, r in find_routers(policy))


def test_collate_places_each_samples_routes_at_its_own_positions_and_refuses_mixed_shapes():
    import numpy as np
    groups = synthetic_groups(2, 2, seed=11, prompt_lens=(2, 5), response_lens=(1, 6))
    totals = [len(g.prompt_ids) + len(c.token_ids) for g in groups for c in g.completions]
    routes = [np.full((t - 1, 3, 2), i, dtype=np.int16) for i, t in enumerate(totals)]
    routes[1] = routes[1][:1]  # an engine that ran fewer positions
    routes[2] = np.full((totals[2] + 4, 3, 2), 2, dtype=np.int16)  # more than the row has: cut
    routes[3] = None
    batch = collate(_with_routes(groups, routes))
    width = batch.tokens.shape[1]
    known = batch.routed.view(-1, width)
    assert known.sum(1).tolist() == [totals[0] - 1, 1, totals[2] - 1, 0]
    for i in range(3):
        assert (batch.rollout_routes.view(-1, width, 3, 2)[i][known[i]] == i).all()
    with pytest.raises(ValueError, match="routes disagree in shape"):
        collate(_with_routes(groups, [np.zeros((1, 3, 2)), np.zeros((1, 4, 2)), None, None]))
    assert collate(groups).rollout_routes is None


def test_r3_is_refused_before_launch_without_vllm_on_gpus(hf_zoo):
    import dataclasses

    from asyncrl.config.presets import CPU_DEMO
    from asyncrl.launch.model_checks import implementation_problems

    def problems(**rollout) -> list[str]:
        cfg = dataclasses.replace(CPU_DEMO, model=dataclasses.replace(CPU_DEMO.model, path=str(hf_zoo("qwen3_moe"))),
                                  trainer=dataclasses.replace(CPU_DEMO.trainer, routing_replay="r3"),
                                  rollout=dataclasses.replace(CPU_DEMO.rollout, **rollout))
        return [p for p in implementation_problems(cfg) if p.startswith("--trainer.routing-replay r3")]

    (cpu,) = problems(backend="vllm")
    assert "vLLM returns routes on GPUs only" in cpu and "use --trainer.routing-replay r2 on CPU" in cpu
    with pytest.raises(ValueError, match="no decoder layer index"):
        from asyncrl.policies.routing_replay import router_layers
        router_layers(["model.mlp.gate"])
