"""The shared-prompt K/V layout (`--rollout.kv-layout shared-prompt`, `asyncrl.policies.shared_prompt_cache`):
a prompt stored once for its samples gives the tokens and log-probs of the per-slot layout in fp32, through every
RL control, and admits several times the groups of long prompts in the same memory."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config.speculation import SpeculationConfig
from asyncrl.policies import Engine, SamplingParams, named_weights
from asyncrl.policies.shared_prompt_cache import READER_WIDTH, SharedPromptKVCache
from tests.policies.helpers import (assert_same_output, drain, drain_across_an_update, logprob_tol, make_prompts,
                                    small_config, tiny_model)

SHARED = dict(kv_layout="shared-prompt", max_prompt_len=40)


def _engines(model, *, ahead: bool = True, max_prompts: int = 3, share_prefix: int = 0, **config):
    """The same engine in both layouts (slot first; each over its own copy of `model`, which weight updates
    change in place); the shared one with `max_prompts` prompt slots."""
    base = small_config(**{"max_slots": 12, "max_len": 104, "decode_ahead": ahead, **config})
    shared = dataclasses.replace(base, **SHARED, max_prompts=max_prompts, share_prefix=share_prefix)
    return Engine(copy.deepcopy(model), base), Engine(copy.deepcopy(model), shared)


def _requests(engine, prompts, params) -> list[str]:
    return [engine.add_request(p, sp) for p, sp in zip(prompts, params)]


def _assert_same(slot_done, shared_done, model, params) -> None:
    assert slot_done.keys() == shared_done.keys()
    for rid, sp in zip(slot_done, params):
        assert_same_output(slot_done[rid], shared_done[rid], model, sp)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("ahead", [False, True], ids=["one-step", "ahead"])
def test_shared_prompts_give_the_tokens_of_per_slot_prompts(temperature, ahead):
    """Groups of 1 to 9 samples (9: more than a reader's 8), prompts of 1 to 40 tokens (the prompt slot's size) and
    of 55 (its last 15 in each sample's own slot), samples ending at a stop token or their own budget, and more
    requests than prompt slots (they wait for one): the same tokens, finish reasons and log-probs."""
    model = tiny_model(perturb=True)
    prompts = make_prompts([1, 40, 17, 5, 29, 55], seed=3)
    params = [SamplingParams(n=n, temperature=temperature, max_new_tokens=m, seed=11 + i, stop_token_ids=[7, 9])
              for i, (n, m) in enumerate([(3, 50), (1, 64), (9, 30), (2, 64), (4, 12), (3, 49)])]
    slot, shared = _engines(model, ahead=ahead)
    for engine in (slot, shared):
        _requests(engine, prompts, params)
    slot_done, shared_done = drain(slot), drain(shared)
    _assert_same(slot_done, shared_done, model, params)
    assert any(c.finish_reason == "stop" for o in shared_done.values() for c in o.completions)
    assert shared.cache.free_prompts == 3 and not shared.num_running


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_partial_rollouts_over_shared_prompts_match_per_slot_ones(kv):
    """Pause, weight updates with kv keep or recompute, sleep / wake-up and an abort, mid-generation: the same tokens,
    log-probs and versions as the per-slot layout through the same calls (a 50-token prompt spilling past its
    40-position prompt slot included: recomputed as the slot's part, then each row's spill and responses)."""
    models = [tiny_model(seed=s, perturb=True) for s in (21, 22, 23)]
    prompts = make_prompts([9, 50, 4, 20], seed=5)
    params = [SamplingParams(n=n, max_new_tokens=40, seed=30 + i, ignore_eos=True)
              for i, n in enumerate([4, 2, 3, 1])]
    results = []
    for engine in _engines(tiny_model(seed=21, perturb=True), max_prompts=4):
        ids = _requests(engine, prompts, params)
        for version, (steps, colocated) in enumerate(((5, False), (7, True)), start=1):
            for _ in range(steps):
                engine.step()
            assert engine.pause("keep") == []
            if colocated:
                engine.sleep()
            engine.update_weights(named_weights(models[version]), version=version, kv=kv)
            if colocated:
                engine.wake_up()
            engine.resume()
        aborted = engine.abort([ids[1]])
        results.append((aborted, drain(engine)))
    (slot_aborted, slot_done), (shared_aborted, shared_done) = results
    _assert_same({o.request_id: o for o in slot_aborted}, {o.request_id: o for o in shared_aborted}, models[2],
                 [params[1]])
    _assert_same(slot_done, shared_done, models[2], [params[0], *params[2:]])
    versions = {v for o in shared_done.values() for c in o.completions for v in c.versions}
    assert versions == {0, 1, 2}


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_requests_sharing_a_system_prompt_read_it_from_one_prompt_slot(kv):
    """`share_prefix`: requests whose prompts begin with the same 24-token system prompt read it from the first one's
    prompt slot, which stays open after that request ended (its samples stop early) while others read it, and is
    recomputed from its tokens on wake-up; one sharer's own part spills past its prompt slot. The tokens, log-probs
    and versions of the per-slot layout through a sleep and a weight update."""
    system = make_prompts([24], seed=9)[0]
    prompts = [system + q for q in make_prompts([5, 12, 3, 30], seed=10)]
    params = [SamplingParams(n=n, max_new_tokens=m, seed=40 + i, ignore_eos=True)
              for i, (n, m) in enumerate([(2, 6), (3, 40), (2, 40), (1, 40)])]
    new = tiny_model(seed=12, perturb=True)
    results = []
    for engine in _engines(tiny_model(seed=11, perturb=True), max_prompts=4, share_prefix=16):
        _requests(engine, prompts, params)
        for _ in range(9):
            engine.step()
        engine.pause("keep")
        engine.sleep()
        engine.update_weights(named_weights(new), version=1, kv=kv)
        engine.wake_up()
        engine.resume()
        results.append((drain(engine), engine))
    (slot_done, _), (shared_done, shared) = results
    _assert_same(slot_done, shared_done, new, params)
    assert shared.stats["shared_prefix_tokens"] >= 3 * 24 and shared.cache.free_prompts == 4
    assert any(v == 1 for o in shared_done.values() for c in o.completions for v in c.versions)


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_requests_admitted_after_an_update_share_only_prefixes_of_the_new_weights(kv):
    """Requests keep arriving across a weight update (9 prompts with a common 12-token beginning, more samples than
    slots): with kv keep the prompt slots of older weights stay as they were for the rows reading them, and a request
    admitted after the update never reads them (it starts a prompt slot of the new weights, which later ones share);
    with recompute every open slot is of the new weights. The per-slot layout's tokens and versions either way."""
    common = make_prompts([12], seed=7)[0]
    prompts = [common + p for p in make_prompts([2, 19, 7, 11, 3, 15, 5, 9, 17], seed=6)]
    params = [SamplingParams(n=1 + (4 * i) % 9, temperature=0.9, max_new_tokens=30 + 3 * i, seed=i) for i in range(9)]
    new = tiny_model(seed=5, perturb=True)
    outs = []
    for engine in _engines(tiny_model(seed=4, perturb=True), max_prompts=9, share_prefix=8, max_slots=24):
        _requests(engine, prompts, params)
        outs.append(drain_across_an_update(engine, named_weights(new), at_step=25, kv=kv))
    for rid, a in outs[0].items():
        for ca, cb in zip(a.completions, outs[1][rid].completions):
            assert ca.token_ids == cb.token_ids and ca.versions == cb.versions
    late = [o for o in outs[1].values() if o.completions[0].versions[0] == 1]
    assert late, "no request was admitted after the update"


def test_a_long_prompt_group_takes_a_third_of_the_memory():
    """2,048-token prompts × n = 8 with 512-token responses: in the bytes of a per-slot cache of 2 groups the shared
    layout holds 6 groups' prompts and responses (3×), and the engine admits all 6 at once."""
    model = tiny_model(perturb=True)
    prompt_len, new, n = 2048, 512, 8
    per_slot = small_config(max_slots=2 * n, max_len=prompt_len + new, max_prefill_tokens=6 * prompt_len)
    shared = dataclasses.replace(per_slot, max_slots=6 * n, kv_layout="shared-prompt", max_prompt_len=prompt_len,
                                 max_prompts=6)
    engines = [Engine(model, config) for config in (per_slot, shared)]
    assert engines[1].cache.nbytes <= engines[0].cache.nbytes
    params = SamplingParams(n=n, max_new_tokens=new, seed=1)
    for engine in engines:
        for prompt in make_prompts([prompt_len] * 6, seed=8):
            engine.add_request(prompt, params)
        engine.step()
    assert [e.num_running // n for e in engines] == [2, 6]


def test_multi_turn_sessions_over_a_shared_prompt_continue_from_held_kv():
    """Sessions over shared prompts: the first turn's samples share the prompt; each finished sample is held (its own
    slot, and the prompt slot it reads, kept open), and the next turn (the whole conversation, past the prompt slot)
    prefills only its new tokens. The tokens equal the per-slot layout's."""
    done = []
    for engine in _engines(tiny_model(perturb=True)):
        first = engine.generate(make_prompts([30], seed=4), SamplingParams(n=2, max_new_tokens=12, seed=5,
                                                                           ignore_eos=True))[0]
        names = ["a", "b"]
        # the first turn again, held under names, then each conversation's next turn
        rid = engine.add_request(first.prompt_ids, SamplingParams(n=2, max_new_tokens=12, seed=5, ignore_eos=True),
                                 sessions=names)
        turn1 = drain(engine)[rid]
        nexts = [first.prompt_ids + c.token_ids + [11, 12, 13] for c in turn1.completions]
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=20, seed=6 + i, ignore_eos=True), sessions=[n])
               for i, (p, n) in enumerate(zip(nexts, names))]
        turn2 = drain(engine)
        done.append(([turn1] + [turn2[i] for i in ids], engine.stats["session_reused_tokens"]))
    (slot_outs, slot_reused), (shared_outs, shared_reused) = done
    for a, b in zip(slot_outs, shared_outs):
        assert_same_output(a, b, tiny_model(perturb=True), SamplingParams(temperature=1.0))
    assert slot_reused == shared_reused > 0


def test_what_the_shared_layout_cannot_take_is_refused_with_the_flag():
    with pytest.raises(ValueError, match="speculation"):
        small_config(**SHARED, speculation=SpeculationConfig(tokens=2)).validate()
    with pytest.raises(ValueError, match="max_prompt_len"):
        small_config(kv_layout="shared-prompt").validate()


def test_a_response_budget_is_capped_by_the_responses_room():
    """Responses get max_len − max(prompt, max_prompt_len) positions: the own slot's room."""
    _, shared = _engines(tiny_model())
    short, long = shared.generate(make_prompts([2, 50]), SamplingParams(max_new_tokens=500, ignore_eos=True, seed=0))
    assert len(short.completions[0].token_ids) == 104 - 40 and len(long.completions[0].token_ids) == 104 - 50


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 16), st.integers(0, 16)), min_size=1, max_size=5),
       st.data())
def test_the_reader_tables_cover_every_bound_row_once(groups, data):
    """Prompt slots opened (some sharing the beginning of an earlier one) and rows bound, released and moved (as the
    engine's slot compaction does), in any order: at each level every bound row is in exactly one reader of its own
    segment, with that segment's length; idle readers read nothing; a prompt slot is free again when its last
    reader goes, a shared one only after its sharers."""
    slots = sum(n for n, _, _ in groups)
    cache = SharedPromptKVCache(1, slots, 1, 40, 4, torch.float32, "cpu", max_prompt_len=16,
                                num_prompts=len(groups), share_prefix=3)
    rows, segments_of, opened = list(range(slots)), {}, []
    for i, (n, length, shared) in enumerate(groups):
        prompt = [100 + i] * length  # distinct from every other prompt ...
        if opened and shared:  # ... unless it begins with an earlier one's first tokens
            earlier = opened[shared % len(opened)]
            prompt = list(earlier[:max(shared, 4)]) + prompt
        share = cache.match(prompt, 0)
        slot = cache.open(prompt[share[1] if share else 0:], parent=share)
        opened.append(tuple(prompt))
        bound, rows = rows[:n], rows[n:]
        cache.bind(bound, slot)
        own = min(len(prompt) - (share[1] if share else 0), 16)
        segments_of.update({r: ((share,) if share else ()) + ((slot, own),) for r in bound})
    running = sorted(segments_of)
    for _ in range(data.draw(st.integers(0, slots))):
        gone = data.draw(st.sampled_from(running))
        cache.release_row(gone)
        del segments_of[gone]
        last = running.pop()
        if last != gone:  # the last running row moves into the hole
            cache.move_row(last, gone, written=sum(n for _, n in segments_of[last]) + 1)
            segments_of[gone] = segments_of.pop(last)
    cache.prepare()
    t = cache.tables
    for level in range(t.levels):
        seen = {}
        for slot, length, members in zip(t.reader_slot[level].tolist(), t.reader_len[level].tolist(),
                                         t.reader_rows[level].tolist()):
            for row in (m for m in members if m >= 0):
                assert row not in seen
                seen[row] = (slot, length)
            if all(m < 0 for m in members):
                assert length == 0
        assert seen == {r: segs[level] for r, segs in segments_of.items() if len(segs) > level}
    assert {r: t.row_start[r].item() for r in segments_of} == {
        r: sum(n for _, n in segs) for r, segs in segments_of.items()}
    used = {slot for segs in segments_of.values() for slot, _ in segs}
    assert cache.free_prompts == len(groups) - len(used)


def test_the_run_gives_the_engine_shared_prompts_and_refuses_what_they_cannot_serve():
    from asyncrl.config import EnvConfig
    from asyncrl.config.presets import CPU_DEMO
    from asyncrl.launch.model_checks import implementation_problems
    from asyncrl.launch.run_spec import build_spec
    rollout = dataclasses.replace(CPU_DEMO.rollout, kv_layout="shared-prompt")
    cfg = dataclasses.replace(CPU_DEMO, rollout=rollout)
    built = build_spec(cfg)
    engine = built.engine_config(built.agents[0], 0)
    assert (engine.kv_layout, engine.max_prompt_len, engine.max_prompts) == (
        "shared-prompt", rollout.max_prompt_length, rollout.concurrent_prompts)
    built = build_spec(dataclasses.replace(cfg, rollout=dataclasses.replace(rollout, max_prompts=2, share_prefix=64)))
    assert (built.engine_config(built.agents[0], 0).max_prompts, built.engine_config(built.agents[0], 0).share_prefix
            ) == (2, 64)
    with pytest.raises(ValueError, match="--rollout.share-prefix 64 is invalid: .*--rollout.kv-layout shared-prompt"):
        dataclasses.replace(CPU_DEMO.rollout, share_prefix=64).validate()
    with pytest.raises(ValueError, match="--rollout.share-prefix -1 is invalid"):
        dataclasses.replace(rollout, share_prefix=-1).validate()
    assert not [p for p in implementation_problems(cfg) if "kv-layout" in p]
    with pytest.raises(ValueError, match="--rollout.kv-layout shared-prompt is invalid: .*--rollout.backend vllm"):
        dataclasses.replace(rollout, backend="vllm").validate()
    vllm = dataclasses.replace(cfg, rollout=dataclasses.replace(rollout, backend="vllm"))  # as auto resolving to it
    (problem,) = [p for p in implementation_problems(vllm) if "kv-layout" in p]
    assert problem.startswith("--rollout.kv-layout shared-prompt is the embedded engine's") and "slot" in problem
    with pytest.raises(ValueError, match="--rollout.speculation.tokens 2 is invalid: .*--rollout.kv-layout shared"):
        dataclasses.replace(rollout, speculation=SpeculationConfig(tokens=2)).validate()
    with pytest.raises(ValueError, match="--rollout.max-prompts 0 is invalid"):
        dataclasses.replace(rollout, max_prompts=0).validate()
    dataclasses.replace(cfg, env=EnvConfig(fn="retry")).validate()  # episodes' later turns: prefilled whole


def test_episodes_over_shared_prompts_are_the_per_slot_engines_episodes():
    """Multi-turn episodes (`EpisodeRunner`, an environment answering each turn) on both layouts: the same tokens,
    masks and log-probs, and both continue each later turn from the held K/V (the shared engine's conversations
    outgrow their 8-position prompt slot)."""
    from asyncrl.envs import EpisodeRunner
    from asyncrl.types import Prompt
    from tests.envs.helpers import Echo, Recording, run_episodes, runtime
    model = tiny_model(perturb=True)
    base = small_config(max_slots=8, max_len=64)
    groups, engines = [], []
    for config in (base, dataclasses.replace(base, kv_layout="shared-prompt", max_prompt_len=8, max_prompts=2)):
        engine = Recording(Engine(copy.deepcopy(model), config))
        runner = EpisodeRunner(engine, runtime(Echo, max_turn_tokens=4))
        prompts = [Prompt([5, 9, 11, 13], data_source="toy", index=0), Prompt([7, 3, 8], data_source="toy", index=1)]
        groups.append(run_episodes(runner, engine, prompts, SamplingParams(n=3, max_new_tokens=40, seed=7)))
        runner.close()
        engines.append(engine)
    assert groups[0].keys() == groups[1].keys()
    for key in groups[0]:
        for a, b in zip(groups[0][key].completions, groups[1][key].completions):
            assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0,
                                       atol=logprob_tol(model, [5, 9, 11, 13], a.token_ids))
    assert engines[0].stats["session_reused_tokens"] == engines[1].stats["session_reused_tokens"] > 0


@pytest.mark.slow
def test_a_short_run_trains_on_shared_prompts(tmp_path):
    """`asyncrl train --rollout.kv-layout shared-prompt` (in this process, the local launcher) on the toy task: every
    version trains on finite metrics."""
    import json
    import math

    from tests.run_helpers import NO_EVAL, train_here
    run_dir = tmp_path / "shared"
    train_here("cpu-demo", "--model.path", "random:tiny-qwen2", "--data.task", "toy", "--wandb", "off", *NO_EVAL,
               "--rollout.kv-layout", "shared-prompt", "--async-training.total-versions", "2",
               "--run-dir", str(run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows)


def test_the_memory_check_counts_each_prompt_once():
    """The check before launch sizes a shared-prompt cache as its two pools: responses for every slot, a prompt for
    every prompt in flight (`--rollout.max-prompts`, else the slots' prompts), so it fits ~3× the groups of long
    prompts where the per-slot cache would not."""
    from asyncrl.config.presets import CPU_DEMO
    from asyncrl.launch.memory_checks import _engine
    from asyncrl.planning.predict import ModelShape
    from asyncrl.policies.model_configs import hf_config
    shape = ModelShape.from_hf(hf_config("qwen3-1.7b"))
    rollout = dataclasses.replace(CPU_DEMO.rollout, n=8, max_prompt_length=2048, max_new_tokens=512)
    slot = dataclasses.replace(CPU_DEMO, rollout=rollout, model=dataclasses.replace(CPU_DEMO.model,
                                                                                   engine_dtype="bfloat16"))
    shared = dataclasses.replace(slot, rollout=dataclasses.replace(rollout, kv_layout="shared-prompt"))
    a, b = _engine(slot, shape, 256), _engine(shared, shape, 256)
    per_position = shape.kv_bytes(1)
    assert a.kv_cache == 256 * 2560 * per_position
    assert b.kv_cache == (256 * 512 + 32 * 2048) * per_position and b.weights == a.weights
    capped = dataclasses.replace(shared, rollout=dataclasses.replace(shared.rollout, max_prompts=4))
    assert _engine(capped, shape, 256).kv_cache == (256 * 512 + 4 * 2048) * per_position
