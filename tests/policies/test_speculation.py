"""Lossless speculative decoding (`asyncrl.policies.speculation`, `asyncrl.policies.drafts`, the engine's
speculative step): with speculation on, a seeded request gives exactly the tokens it gives without, with log-probs
within 1e-5 in fp32; tokens carry the version that verified them; a stop token inside a kept draft ends the sample;
the drafts come from the prompt, the siblings and the row itself, in bounded memory."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.config.speculation import SpeculationConfig
from asyncrl.policies import Engine, SamplingParams
from asyncrl.policies.drafts import DraftIndex
from asyncrl.policies.speculation import accepted_length, draft_room
from tests.policies.helpers import (
    EOS, VOCAB, assert_follows_the_model, drain, forward_logprobs, make_prompts, small_config, tiny_model,
)

SPEC_LOGPROB_TOL = 1e-5
"""fp32, at temperature 1: a token's log-prob from the verifying forward (an extend over the slot) against a plain
decode step's, on these models' logits (up to ~15). At temperature T the log-probs come from logits / T, whose
rounding grows by 1 / T: the tolerance does too (`_assert_lossless`)."""


def spec_config(tokens: int = 4, max_rows: int = 64, **overrides):
    return small_config(speculation=SpeculationConfig(tokens=tokens, max_rows=max_rows), **overrides)


# ---------------------------------------------------------------- the acceptance rule
@pytest.mark.parametrize("draft, sampled, kept", [
    ([], [7], 1),
    ([5, 6, 7], [5, 6, 7, 8], 4),   # every draft token drawn: all kept, plus the draw after the last
    ([5, 6, 7], [5, 9, 7, 8], 2),   # the second draw differs: keep 5 and the 9 drawn in its place
    ([5, 6, 7], [4, 6, 7, 8], 1),   # the first draw differs: keep only it
])
def test_accepted_length_golden(draft, sampled, kept):
    assert accepted_length(draft, sampled) == kept


@given(st.lists(st.integers(0, 3), max_size=8), st.data())
def test_accepted_length_keeps_the_agreeing_prefix_and_one_draw(draft, data):
    sampled = data.draw(st.lists(st.integers(0, 3), min_size=len(draft) + 1, max_size=len(draft) + 1))
    kept = accepted_length(draft, sampled)
    assert 1 <= kept <= len(draft) + 1
    assert draft[:kept - 1] == sampled[:kept - 1]  # every kept token but the last was drafted and drawn
    assert kept == len(draft) + 1 or draft[kept - 1] != sampled[kept - 1]  # it stops at the first disagreement


def test_accepted_length_needs_one_draw_more_than_the_draft():
    with pytest.raises(ValueError, match="need one more"):
        accepted_length([1, 2], [1, 2])


@given(st.integers(0, 100), st.integers(0, 50), st.integers(1, 60), st.integers(8, 128), st.integers(0, 8))
def test_draft_room_stays_inside_the_budget_and_the_slot(position, generated, max_new, max_len, tokens):
    room = draft_room(position, generated, max_new, max_len, tokens)
    assert 0 <= room <= tokens
    assert generated + room + 1 <= max(max_new, generated + 1)  # a step keeps at most room + 1 tokens
    assert room == 0 or position + room < max_len - 1  # the slot's last position stays free for padding


# ---------------------------------------------------------------- drafts
def test_a_draft_follows_a_siblings_continuation():
    drafts = DraftIndex(min_match=2, max_match=3)
    prompt = [10, 11, 12]
    first, second = [20, 21, 22, 23, 24], [30, 21, 22]
    assert drafts.propose("p", prompt, [first, second], own=1, limit=2) == [23, 24]
    # the prompt's last tokens recur at the start of every sample: a fresh sample drafts its siblings' opening
    assert drafts.propose("p", prompt, [first, second, []], own=2, limit=3) == [30, 21, 22]


def test_a_draft_copies_from_the_prompt_and_repeats_the_row_itself():
    drafts = DraftIndex(min_match=2, max_match=4)
    assert drafts.propose("a", [5, 6, 7, 8, 9], [[1, 5, 6]], own=0, limit=3) == [7, 8, 9]
    assert drafts.propose("b", [1], [[3, 4, 5, 3, 4]], own=0, limit=5) == [5, 3, 4]
    assert drafts.propose("c", [1, 2], [[3, 4]], own=0, limit=4) == []  # nothing recurs
    assert drafts.propose("c", [1, 2], [[3, 4]], own=0, limit=0) == []


def test_the_longest_recurring_suffix_wins():
    drafts = DraftIndex(min_match=1, max_match=3)
    # "8" alone was last followed by 1; "7 8" by 2: the longer match is the better guess
    assert drafts.propose("k", [7, 8, 2, 0, 8, 1], [[7, 8]], own=0, limit=1) == [2]


def test_finished_samples_stay_as_recent_responses_and_memory_is_bounded():
    drafts = DraftIndex(min_match=2, max_match=2, max_pools=2, max_sequences=2)
    prompt = [1, 2]
    old = [9, 8, 7, 6]
    drafts.propose("p", prompt, [old], own=0, limit=1)
    assert drafts.propose("p", prompt, [[9, 8]], own=0, limit=2) == [7, 6]  # a later request of the same prompt
    for key in ("q", "r"):
        drafts.propose(key, [3, 4], [[5]], own=0, limit=1)
    assert len(drafts) == 2  # "p" was least recently used: forgotten
    assert drafts.propose("p", prompt, [[9, 8]], own=0, limit=2) == []
    pool = [[i, i + 1, i + 2] for i in range(40, 50, 3)]
    for sequence in pool:
        drafts.propose("s", prompt, [sequence], own=0, limit=1)
    assert drafts.propose("s", prompt, [[49, 50]], own=0, limit=1) == [51]  # the newest response is kept
    assert drafts.propose("s", prompt, [[40, 41]], own=0, limit=1) == []  # beyond max_sequences: the oldest went


@given(st.lists(st.lists(st.integers(0, 4), max_size=12), min_size=1, max_size=4),
       st.lists(st.integers(0, 4), max_size=6), st.integers(1, 5))
def test_a_draft_is_what_followed_the_rows_suffix_somewhere_in_its_pool(samples, prompt, limit):
    drafts = DraftIndex(min_match=1, max_match=3)
    for own in range(len(samples)):
        draft = drafts.propose("p", prompt, samples, own=own, limit=limit)
        assert len(draft) <= limit
        if not draft:
            continue
        row = prompt + samples[own]
        sequences = [prompt] + [prompt + s for s in samples]
        assert any(seq[end - m:end] == row[len(row) - m:] and seq[end:end + len(draft)] == draft
                   for seq in sequences for m in range(1, 4) if len(row) >= m
                   for end in range(m, len(seq))), f"draft {draft} for row {row} follows no match"


# ---------------------------------------------------------------- the engine
class OracleDrafter:
    """Drafts from reference completions (what the request generates without speculation), with a share of the
    drafted tokens changed and, past a reference's end, tokens it never had: every way a draft can be kept or cut."""

    def __init__(self, reference: dict[tuple[tuple[int, ...], int], list[int]], wrong: float, seed: int = 0):
        self.reference, self.wrong, self.rng = reference, wrong, random.Random(seed)
        self.calls = 0

    def propose(self, key, prompt, completions, own, limit):
        self.calls += 1
        want = self.reference[(tuple(prompt), own)]
        done = len(completions[own])
        draft = want[done:done + limit] + [self.rng.randrange(3, VOCAB) for _ in range(limit)]
        return [t if self.rng.random() >= self.wrong else (t + 1) % VOCAB for t in draft[:limit]]


def _generate(engine: Engine, prompts, params_of) -> dict[str, object]:
    ids = [engine.add_request(p, params_of(i)) for i, p in enumerate(prompts)]
    done = drain(engine)
    return [done[i] for i in ids]


def _assert_lossless(plain, spec, temperature: float = 1.0):
    tol = SPEC_LOGPROB_TOL / (temperature or 1.0)
    for a, b in zip(plain, spec):
        for ca, cb in zip(a.completions, b.completions):
            assert cb.token_ids == ca.token_ids
            assert cb.finish_reason == ca.finish_reason and cb.versions == ca.versions
            diff = (torch.tensor(ca.logprobs) - torch.tensor(cb.logprobs)).abs().max().item()
            assert diff <= tol, f"log-probs differ by {diff:.3g} > {tol:.3g}"


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_speculation_gives_the_tokens_of_plain_decoding(temperature):
    model = tiny_model(seed=3)
    prompts = make_prompts([3, 9, 17, 30, 5, 12], seed=int(temperature * 10))
    params_of = lambda i: SamplingParams(n=3, temperature=temperature, max_new_tokens=48, seed=100 + i)  # noqa: E731
    plain = _generate(Engine(model, small_config(max_slots=18, max_len=96)), prompts, params_of)
    reference = {(tuple(o.prompt_ids), j): c.token_ids for o in plain for j, c in enumerate(o.completions)}
    for wrong in (0.0, 0.3):
        oracle = OracleDrafter(reference, wrong)
        engine = Engine(model, spec_config(max_slots=18, max_len=96), drafter=oracle)
        spec = _generate(engine, prompts, params_of)
        _assert_lossless(plain, spec, temperature)
        assert engine.stats["spec_accepted_tokens"] > 0
        assert engine.stats["spec_steps"] < engine.stats["generated_tokens"] / 2, "drafts should save steps"
    index = Engine(model, spec_config(max_slots=18, max_len=96))  # the engine's own drafts
    _assert_lossless(plain, _generate(index, prompts, params_of), temperature)
    assert index.stats["spec_steps"] > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_samples_follow_the_model_distribution(temperature):
    """Lossless in distribution, whatever the drafts: a drafter that is right half the time, and the engine's own
    (where a large vocabulary's rounding may flip a token that lies within rounding of its neighbour's CDF
    boundary, each kept token is still drawn from the verifying forward's distribution)."""
    model = tiny_model(seed=9)
    prompts = make_prompts([5, 17, 30], seed=12)
    params = SamplingParams(n=8, temperature=temperature, max_new_tokens=30, seed=3)
    reference = {(tuple(o.prompt_ids), j): c.token_ids
                 for o in Engine(model, small_config(max_slots=24)).generate(prompts, params)
                 for j, c in enumerate(o.completions)}
    for drafter in (OracleDrafter(reference, 0.5, seed=1), None):
        engine = Engine(model, spec_config(max_slots=24), drafter=drafter)
        outs = engine.generate(prompts, params)
        assert engine.stats["spec_accepted_tokens"] > 0
        assert_follows_the_model(model, prompts, outs, temperature)


def test_speculation_with_top_k_and_top_p_rows_is_lossless():
    model = tiny_model(seed=4)
    prompts = make_prompts([6, 11, 20], seed=4)
    params_of = lambda i: SamplingParams(n=2, temperature=0.8, top_k=[-1, 20, 5][i], top_p=[0.9, 1.0, 0.7][i],  # noqa: E731
                                         max_new_tokens=30, seed=7 + i)
    plain = _generate(Engine(model, small_config()), prompts, params_of)
    reference = {(tuple(o.prompt_ids), j): c.token_ids for o in plain for j, c in enumerate(o.completions)}
    engine = Engine(model, spec_config(), drafter=OracleDrafter(reference, 0.2))
    _assert_lossless(plain, _generate(engine, prompts, params_of), 0.8)
    assert engine.stats["spec_accepted_tokens"] > 0


def test_a_stop_token_inside_a_kept_draft_ends_the_sample():
    model = tiny_model(seed=5)
    prompts = make_prompts([4, 8, 13, 21, 6, 9, 15, 2], seed=5)
    params_of = lambda i: SamplingParams(n=2, max_new_tokens=60, seed=i)  # noqa: E731
    plain = _generate(Engine(model, small_config(max_slots=16)), prompts, params_of)
    stopped = [c for o in plain for c in o.completions if c.finish_reason == "stop"]
    assert stopped, "this model and seed should stop some samples at EOS"
    reference = {(tuple(o.prompt_ids), j): c.token_ids for o in plain for j, c in enumerate(o.completions)}
    # the oracle drafts through each EOS and beyond it: the step must keep the EOS and nothing after
    engine = Engine(model, spec_config(tokens=8, max_slots=16), drafter=OracleDrafter(reference, 0.0))
    spec = _generate(engine, prompts, params_of)
    _assert_lossless(plain, spec)
    for o in spec:
        for c in o.completions:
            assert EOS not in c.token_ids[:-1]


def test_speculation_waits_until_few_rows_run():
    model = tiny_model(seed=6)
    prompts = make_prompts([5, 7, 9, 11], seed=6)
    params_of = lambda i: SamplingParams(n=2, max_new_tokens=[4, 8, 16, 40][i], seed=i, ignore_eos=True)  # noqa: E731
    plain = _generate(Engine(model, small_config()), prompts, params_of)
    reference = {(tuple(o.prompt_ids), j): c.token_ids for o in plain for j, c in enumerate(o.completions)}
    oracle = OracleDrafter(reference, 0.0)
    engine = Engine(model, spec_config(max_rows=2), drafter=oracle)
    seen: list[int] = []
    ids = [engine.add_request(p, params_of(i)) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        before = oracle.calls
        running = engine.num_running
        engine.step()
        if oracle.calls > before:
            seen.append(running)
    assert seen and max(seen) <= 2, f"drafted with {max(seen)} rows running (max_rows 2)"
    assert len(ids) == 4


def test_tokens_carry_the_version_that_verified_them():
    """Weights change between steps (kv recompute): every token's log-prob is that of the weights its version
    names, over the whole sequence before it; and the run pauses and resumes mid-draft without losing a token."""
    first, second = tiny_model(seed=7), tiny_model(seed=8)
    engine = Engine(tiny_model(seed=7), spec_config(max_slots=8, max_len=128))
    prompts = make_prompts([5, 9], seed=7)
    ids = [engine.add_request(p, SamplingParams(n=2, max_new_tokens=60, seed=i, ignore_eos=True))
           for i, p in enumerate(prompts)]
    outputs = {}
    for step in range(400):
        if not engine.has_unfinished():
            break
        if step == 6:
            engine.pause("keep")
            assert engine.step() == []
            engine.resume()
        if step == 9:
            engine.update_weights(list(second.state_dict().items()), version=1, kv="recompute")
        outputs.update({o.request_id: o for o in engine.step()})
    assert engine.stats["spec_steps"] > 0
    models = {0: first, 1: second}
    for rid in ids:
        out = outputs[rid]
        for c in out.completions:
            assert len(c.token_ids) == 60 and set(c.versions) == {0, 1}
            assert c.versions == sorted(c.versions)
            for version, model in models.items():
                at = [i for i, v in enumerate(c.versions) if v == version]
                ref = forward_logprobs(model, out.prompt_ids, c.token_ids)[at]
                diff = (torch.tensor(c.logprobs)[at] - ref).abs().max().item()
                assert diff <= 1e-4, f"version {version}: log-probs differ from its weights' by {diff:.3g}"


def test_speculation_is_validated_with_the_flags_the_user_types():
    with pytest.raises(ValueError, match="--rollout.speculation.tokens -1"):
        SpeculationConfig(tokens=-1).validate()
    with pytest.raises(ValueError, match="--rollout.speculation.max-match 1 .*min-match 2"):
        SpeculationConfig(tokens=2, min_match=2, max_match=1).validate()
    with pytest.raises(ValueError, match="--rollout.speculation.max-rows"):
        Engine(tiny_model(seed=0), spec_config(max_rows=0))


def test_the_run_gives_the_engine_its_speculation_and_refuses_it_for_vllm():
    import dataclasses

    from asyncrl.config.presets import CPU_DEMO
    from asyncrl.launch.model_checks import implementation_problems
    from asyncrl.launch.run_spec import build_spec
    spec = SpeculationConfig(tokens=3, max_rows=4)
    cfg = dataclasses.replace(CPU_DEMO, rollout=dataclasses.replace(CPU_DEMO.rollout, speculation=spec))
    built = build_spec(cfg)
    assert built.engine_config(built.agents[0], 0).speculation == spec
    assert not [p for p in implementation_problems(cfg) if "speculation" in p]
    with pytest.raises(ValueError, match="--rollout.speculation.tokens 3 is invalid: .*--rollout.backend vllm"):
        dataclasses.replace(cfg.rollout, backend="vllm").validate()
    vllm = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, backend="vllm"))  # as auto resolving to it
    (problem,) = [p for p in implementation_problems(vllm) if "speculation" in p]
    assert problem.startswith("--rollout.speculation.tokens 3: ") and "leave it at 0" in problem


def test_a_rows_run_ends_at_its_first_stop_token():
    from asyncrl.policies.speculation import Verified
    verified = Verified(tokens=[[5, 2, 7, 9], [4, 6], [1]], logprobs=[[-0.1, -0.2, -0.3, -0.4], [-1.0, -2.0], [-3.0]],
                        kept=[4, 1, 1])
    assert verified.runs([frozenset({2}), frozenset({6}), frozenset()]) == [
        ([5, 2], [-0.1, -0.2]),  # the stop drawn second ends the row there, though the draft was kept past it
        ([4], [-1.0]),  # only the first draw kept: the stop after it is not reached
        ([1], [-3.0])]


def test_rows_at_their_slots_end_stay_lossless():
    """Slots exactly as long as prompt + budget: the last steps' fixed width would pass the slot's end, so those rows
    are verified by the eager path with shorter drafts (`draft_room`), and the tokens still equal plain decoding's."""
    model = tiny_model(seed=10)
    prompts = make_prompts([6, 9], seed=10)
    params = SamplingParams(n=2, max_new_tokens=30, seed=4, ignore_eos=True)
    config = dict(max_slots=4, max_len=9 + 30)
    plain = Engine(model, small_config(**config)).generate(prompts, params)
    reference = {(tuple(o.prompt_ids), j): c.token_ids for o in plain for j, c in enumerate(o.completions)}
    engine = Engine(model, spec_config(tokens=6, **config), drafter=OracleDrafter(reference, 0.0))
    _assert_lossless(plain, engine.generate(prompts, params))
    assert all(len(c.token_ids) == 30 for o in plain for c in o.completions)
