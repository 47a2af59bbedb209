"""Sessions of the embedded engine (multi-turn episodes): a finished sample's K/V is held; the next turn of
the same session prefills only its new tokens and gives what a fresh, whole prefill gives; held slots yield
to running sequences and never corrupt them."""

from __future__ import annotations

import random

import pytest
import torch

from asyncrl.policies import Engine, SamplingParams
from tests.policies.helpers import EOS, drain, forward_logprobs, logprob_tol, make_prompts, small_config, tiny_model

LAYOUTS = {"slot": {}, "shared-prompt": dict(kv_layout="shared-prompt", max_prompt_len=8, max_prompts=3)}
"""Every test on both K/V layouts; the shared one with prompt slots of 8 positions (conversations outgrow them and
continue in their own slots) and 3 of them (fewer than the slots: held sessions give theirs up to running prompts)."""


@pytest.fixture(params=list(LAYOUTS))
def config(request):
    return lambda **kw: small_config(**{**LAYOUTS[request.param], **kw})


def _turn(engine: Engine, prompt: list[int], params: SamplingParams, rid: str, session: str | None):
    engine.add_request(prompt, params, request_id=rid, sessions=None if session is None else [session])
    return drain(engine)[rid].completions[0]


def _conversation(engine: Engine, sessions: bool, turns: int = 3):
    """Three turns of one episode: each turn's prompt is the last one + its response + two 'environment' tokens."""
    seq = make_prompts([6], seed=3)[0]
    out = []
    for turn in range(turns):
        params = SamplingParams(n=1, max_new_tokens=5, seed=turn, stop_token_ids=[EOS])
        c = _turn(engine, seq, params, f"t{turn}", "episode" if sessions else None)
        out.append((list(seq), c))
        seq = seq + c.token_ids + [40 + turn, 41]
    return out


def test_a_continued_session_prefills_only_its_new_tokens_and_matches_a_whole_prefill(config):
    model = tiny_model(0)
    fresh = _conversation(Engine(model, config()), sessions=False)
    engine = Engine(model, config())
    continued = _conversation(engine, sessions=True)
    for (prompt, a), (prompt_b, b) in zip(fresh, continued):
        assert prompt == prompt_b and a.token_ids == b.token_ids
        atol = logprob_tol(model, prompt, a.token_ids)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=atol, rtol=0)
        torch.testing.assert_close(torch.tensor(b.logprobs), forward_logprobs(model, prompt, b.token_ids),
                                   atol=atol, rtol=0)
    # turn 1 and 2 reuse everything but the last sampled token and the two new ones
    reused = sum(len(p) + len(c.token_ids) - 1 for p, c in continued[:-1])
    assert engine.stats["session_reused_tokens"] == reused
    assert engine.stats["prefill_tokens"] == len(continued[0][0]) + 2 * 3  # first prompt, then 1 + 2 per turn
    assert engine.num_held == 1
    engine.end_sessions(["episode"])
    assert engine.num_held == 0


def test_a_prompt_that_does_not_extend_the_held_sequence_is_prefilled_whole(config):
    model = tiny_model(1)
    engine = Engine(model, config())
    prompt = make_prompts([5], seed=4)[0]
    params = SamplingParams(n=1, max_new_tokens=4, seed=1)
    first = _turn(engine, prompt, params, "a", "s")
    other = prompt[:-1] + [7] + first.token_ids  # differs inside the held sequence
    second = _turn(engine, other, params, "b", "s")
    assert "session_reused_tokens" not in engine.stats
    atol = logprob_tol(model, other, second.token_ids)
    torch.testing.assert_close(torch.tensor(second.logprobs), forward_logprobs(model, other, second.token_ids),
                               atol=atol, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs decode there)"))])
def test_many_interleaved_episodes_with_evictions_keep_every_log_prob_exact(device, config):
    """12 episodes of 3 turns on 6 slots, started at random times: held slots are evicted for running ones,
    continued or prefilled whole; every sampled token's log-prob equals a teacher-forced forward."""
    model = tiny_model(2).to(device)
    engine = Engine(model, config(max_slots=6))
    rng = random.Random(0)
    prompts = make_prompts([rng.randint(3, 9) for _ in range(12)], seed=5)
    state = {i: {"seq": p, "turn": 0} for i, p in enumerate(prompts)}
    waiting, checked = list(state), 0
    for _ in range(10_000):
        if waiting and rng.random() < 0.3:
            i = waiting.pop(0)
            s = state[i]
            params = SamplingParams(n=1, max_new_tokens=rng.randint(2, 6), seed=i * 10 + s["turn"])
            engine.add_request(s["seq"], params, request_id=f"e{i}.t{s['turn']}", sessions=[f"e{i}"])
        for out in engine.step():
            i = int(out.request_id[1:].split(".")[0])
            s, c = state[i], out.completions[0]
            atol = logprob_tol(model, s["seq"], c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs), forward_logprobs(model, s["seq"], c.token_ids),
                                       atol=atol, rtol=0)
            checked += 1
            s["seq"] = s["seq"] + c.token_ids + [50 + s["turn"]]
            s["turn"] += 1
            if s["turn"] < 3:
                waiting.append(i)
            else:
                engine.end_sessions([f"e{i}"])
        if not waiting and not engine.has_unfinished():
            break
    assert checked == 36, checked
    assert engine.stats["session_reused_tokens"] > 0 and engine.stats["sessions_evicted"] > 0
    assert engine.num_held == 0


@pytest.mark.parametrize("how", ["recompute", "sleep"])
def test_held_sessions_are_dropped_when_their_kv_goes_stale_or_is_freed(how, config):
    model = tiny_model(3)
    engine = Engine(model, config())
    prompt = make_prompts([5], seed=6)[0]
    params = SamplingParams(n=1, max_new_tokens=3, seed=2)
    first = _turn(engine, prompt, params, "a", "s")
    assert engine.num_held == 1
    if how == "recompute":
        named = [(n, p.detach() * 1.01) for n, p in model.named_parameters()]
        engine.update_weights(named, version=1, kv="recompute")
    else:
        engine.sleep()
        engine.wake_up()
    assert engine.num_held == 0
    nxt = prompt + first.token_ids + [9]
    second = _turn(engine, nxt, params, "b", "s")
    atol = logprob_tol(model, nxt, second.token_ids)
    torch.testing.assert_close(torch.tensor(second.logprobs), forward_logprobs(model, nxt, second.token_ids),
                               atol=atol, rtol=0)


def test_a_full_engine_holds_every_session_and_continues_each_without_evicting(config):
    """Every slot runs a session and all finish in the same step (turns of equal length): each is held
    (in a copy until the slots are released), and each next turn continues where it is held, even with no
    free slot, swapping with the held block's bottom instead of evicting another session."""
    model = tiny_model(5)
    engine = Engine(model, config(max_slots=4))
    prompt = make_prompts([6], seed=9)[0]
    first = SamplingParams(n=4, max_new_tokens=3, seed=4, ignore_eos=True)
    engine.add_request(prompt, first, request_id="t0", sessions=[f"e{i}" for i in range(4)])
    turns = drain(engine)["t0"].completions
    assert engine.num_held == 4
    for i in (2, 0, 3, 1):  # not in slot order: most continuations are not the block's bottom
        seq = prompt + turns[i].token_ids + [40, 41]
        engine.add_request(seq, SamplingParams(n=1, max_new_tokens=3, seed=i), request_id=f"e{i}.t1",
                           sessions=[f"e{i}"])
        out = drain(engine)[f"e{i}.t1"]
        assert out.cached_prompt_tokens == len(seq) - 3  # all but the last sampled token and the two new ones
        atol = logprob_tol(model, seq, out.completions[0].token_ids)
        torch.testing.assert_close(torch.tensor(out.completions[0].logprobs),
                                   forward_logprobs(model, seq, out.completions[0].token_ids), atol=atol, rtol=0)
    assert "sessions_evicted" not in engine.stats and engine.num_held == 4


def test_sessions_continued_together_share_one_forward_of_uneven_rows(config):
    """Four sessions of different lengths continue in the same step with 1 to 5 new tokens each: one padded
    forward over their slots gives each exactly what a whole prefill gives (a prompt slot for each: none of the
    four held sessions gives its up)."""
    model = tiny_model(6)
    engine = Engine(model, config(max_slots=8, max_prompts=4))
    prompts = make_prompts([4, 9, 6, 12], seed=10)
    firsts = [_turn(engine, p, SamplingParams(n=1, max_new_tokens=2 + i, seed=i, ignore_eos=True), f"a{i}", f"s{i}")
              for i, p in enumerate(prompts)]
    seqs = [p + f.token_ids + list(range(30, 30 + extra)) for p, f, extra in zip(prompts, firsts, (1, 5, 3, 2))]
    steps, prefilled = engine.stats["steps"], engine.stats["prefill_tokens"]
    for i, seq in enumerate(seqs):
        engine.add_request(seq, SamplingParams(n=1, max_new_tokens=4, seed=10 + i), request_id=f"b{i}",
                           sessions=[f"s{i}"])
    engine.step()  # admits all four: one extension forward, each row's first token
    assert engine.stats["prefill_tokens"] - prefilled == sum(1 + extra for extra in (1, 5, 3, 2))
    outs = drain(engine)
    for i, seq in enumerate(seqs):
        out = outs[f"b{i}"]
        assert out.cached_prompt_tokens == len(seq) - (1 + (1, 5, 3, 2)[i])
        tokens = out.completions[0].token_ids
        torch.testing.assert_close(torch.tensor(out.completions[0].logprobs), forward_logprobs(model, seq, tokens),
                                   atol=logprob_tol(model, seq, tokens), rtol=0)
    assert engine.stats["steps"] > steps


def test_sessions_end_outside_the_decode_step_after_a_wake_up(config):
    """After sleep / wake_up the cache is allocated again inside a decode step (in inference mode); ending a
    session from outside it (the episode runner does) moves a held slot and must not raise."""
    model = tiny_model(4)
    engine = Engine(model, config())
    engine.sleep()
    engine.wake_up()
    prompts = make_prompts([5, 6], seed=8)
    params = SamplingParams(n=1, max_new_tokens=3, seed=3)
    firsts = [_turn(engine, p, params, f"r{i}", f"s{i}") for i, p in enumerate(prompts)]
    assert engine.num_held == 2
    engine.end_sessions(["s0"])  # not the held block's bottom: s1's K/V moves into its slot
    assert engine.num_held == 1
    nxt = prompts[1] + firsts[1].token_ids + [9]
    second = _turn(engine, nxt, params, "r2", "s1")
    assert engine.stats["session_reused_tokens"] == len(nxt) - 2
    atol = logprob_tol(model, nxt, second.token_ids)
    torch.testing.assert_close(torch.tensor(second.logprobs), forward_logprobs(model, nxt, second.token_ids),
                               atol=atol, rtol=0)


def test_session_names_must_match_the_samples(config):
    engine = Engine(tiny_model(0), config())
    with pytest.raises(ValueError, match="2 session names for n=3 samples"):
        engine.add_request([5, 6], SamplingParams(n=3), sessions=["a", "b"])
    assert not engine.has_unfinished()
