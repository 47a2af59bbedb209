"""`asyncrl.policies.engine`: behaviour log-probs equal the training forward, greedy equals transformers'
`generate`, continuous batching (late joins, queueing, seeds independent of the batch), bad input."""

from __future__ import annotations

import pytest
import torch

from asyncrl.policies import Engine, EngineConfig, RolloutEngine, SamplingParams, save_pretrained
from tests.policies.helpers import (
    EOS, VOCAB, assert_consistent, assert_follows_the_model, assert_same_output, drain, forward_logprobs, logprob_tol,
    make_prompts, run_alone, small_config, tiny_model,
)


@pytest.fixture
def model():
    return tiny_model(seed=0)


def test_engine_is_a_rollout_engine(model):
    engine = Engine(model, small_config())
    assert isinstance(engine, RolloutEngine)
    assert engine.version == 0 and not engine.is_paused and not engine.is_sleeping
    assert not engine.has_unfinished() and engine.step() == []


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_the_training_forward(model, temperature):
    prompts = make_prompts([4, 19, 33], seed=1)
    params = SamplingParams(n=3, temperature=temperature, max_new_tokens=40, seed=11)
    outs = Engine(model, small_config()).generate(prompts, params)
    lengths = set()
    for prompt, out in zip(prompts, outs):
        assert out.finished and out.prompt_ids == prompt and len(out.completions) == 3
        assert_consistent(out)
        tokens = [c.token_ids for c in out.completions]
        assert len({tuple(t) for t in tokens}) == 3, "the n samples of one prompt should differ"
        for c in out.completions:
            assert c.versions == [0] * len(c.token_ids)
            assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS else "length")
            assert EOS not in c.token_ids[:-1]
            lengths.add(len(c.token_ids))
            ref = forward_logprobs(model, prompt, c.token_ids, temperature)
            diff = (torch.tensor(c.logprobs) - ref).abs().max().item()
            atol = logprob_tol(model, prompt, c.token_ids, temperature)  # ~3e-4 here; a stale K/V is O(0.1)
            assert diff <= atol, f"engine vs training log-probs differ by {diff:.3g} > {atol:.3g}"
    assert 40 in lengths  # at least one ran the full budget (so decode got past several attention buckets)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_samples_follow_the_model_distribution(model, temperature):
    """Randomised probability integral transform: for a token t drawn from p, F(t−1) + w·p(t) with w ~ U(0, 1)
    is U(0, 1) (whatever the order of the vocabulary) and independent across tokens. A sampler that reuses
    one uniform, ignores the temperature or samples from the wrong row fails this KS test."""
    prompts = make_prompts([5, 17, 30], seed=12)
    outs = Engine(model, small_config()).generate(prompts, SamplingParams(n=8, temperature=temperature,
                                                                          max_new_tokens=30, seed=3))
    assert_follows_the_model(model, prompts, outs, temperature)


def test_greedy_equals_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = tiny_model(seed=3, initializer_range=0.3)
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos on both sides
    prompts = make_prompts([3, 11, 26, 41, 7], seed=2)
    n_new = 48
    engine = Engine(model, small_config(max_slots=4))  # 5 prompts, 4 slots: the last one joins later
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n_new, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        c = out.completions[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=n_new, pad_token_id=0)[0, len(prompt):].tolist()
        assert len(ref) == n_new
        assert c.token_ids == ref, f"prompt of {len(prompt)} tokens: engine greedy != HF greedy"
        assert c.finish_reason == "length" and len(set(c.token_ids)) > 10  # not a degenerate repetition
        torch.testing.assert_close(torch.tensor(c.logprobs), forward_logprobs(model, prompt, c.token_ids),
                                   atol=logprob_tol(model, prompt, c.token_ids), rtol=0)


def _params(seed: int, max_new: int, **kw) -> SamplingParams:
    return SamplingParams(seed=seed, max_new_tokens=max_new, ignore_eos=True, **kw)


def test_requests_added_while_others_run_match_running_alone(model):
    prompts = make_prompts([6, 21, 9, 14, 30], seed=3)
    # different budgets, so sequences finish at different steps and slots get compacted under the others
    params = [_params(1, 12), _params(2, 30, n=2), _params(3, 5), _params(4, 25, temperature=0.7),
              _params(5, 18, n=3, top_k=20)]
    engine = Engine(model, small_config())
    ids = [engine.add_request(prompts[0], params[0]), engine.add_request(prompts[1], params[1])]
    for _ in range(3):
        assert engine.step() == []
    assert engine.num_running == 3
    ids.append(engine.add_request(prompts[2], params[2]))
    done = {}
    for _ in range(4):
        done.update({o.request_id: o for o in engine.step()})
    ids += [engine.add_request(prompts[3], params[3]), engine.add_request(prompts[4], params[4])]
    done.update(drain(engine))
    assert set(done) == set(ids) and not engine.has_unfinished() and engine.num_running == 0
    for rid, prompt, p in zip(ids, prompts, params):
        out = done[rid]
        assert_consistent(out)
        assert [len(c.token_ids) for c in out.completions] == [p.max_new_tokens] * p.n
        assert_same_output(out, run_alone(model, prompt, p), model, p)


def test_more_requests_than_slots_are_queued_and_all_finish(model):
    prompts = make_prompts([5 + 3 * i for i in range(10)], seed=4)
    params = [_params(100 + i, 6 + 2 * i, n=1 + i % 2) for i in range(10)]
    engine = Engine(model, small_config(max_slots=4, max_prefill_tokens=40))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    assert engine.num_waiting == 10
    done, max_running = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
        max_running = max(max_running, engine.num_running)
        assert engine.num_running <= 4
    assert max_running == 4 and engine.num_waiting == 0 and list(done) != []
    assert sorted(done) == sorted(ids)
    for rid, prompt, p in zip(ids, prompts, params):
        assert_same_output(done[rid], run_alone(model, prompt, p), model, p)


def test_a_seed_gives_the_same_tokens_whatever_the_batch(model):
    prompt = make_prompts([12], seed=5)[0]
    target = SamplingParams(n=2, seed=42, max_new_tokens=24, temperature=0.9)
    alone = run_alone(model, prompt, target)
    others = make_prompts([3, 25, 8, 16], seed=6)
    for trial, (before, after) in enumerate([(0, 2), (2, 0), (4, 0), (1, 3)]):
        engine = Engine(model, small_config(max_slots=6))
        for i in range(before):
            engine.add_request(others[i], SamplingParams(max_new_tokens=10 + 5 * i, top_p=0.9 if i % 2 else 1.0))
        engine.step()  # the others are already decoding (or queued) when the target arrives
        rid = engine.add_request(prompt, target)
        for i in range(after):
            engine.add_request(others[i], SamplingParams(temperature=0.5, max_new_tokens=30, top_k=5))
        assert_same_output(drain(engine)[rid], alone, model, target)
    # a different seed gives different tokens
    other = run_alone(model, prompt, SamplingParams(n=2, seed=43, max_new_tokens=24, temperature=0.9))
    assert other.completions[0].token_ids != alone.completions[0].token_ids


def test_requests_without_seed_differ_and_follow_the_engine_seed(model):
    prompt = make_prompts([8], seed=7)[0]
    p = SamplingParams(max_new_tokens=16)
    a = Engine(model, small_config(seed=1)).generate([prompt, prompt], p)
    b = Engine(model, small_config(seed=1)).generate([prompt, prompt], p)
    c = Engine(model, small_config(seed=2)).generate([prompt], p)
    assert a[0].completions[0].token_ids != a[1].completions[0].token_ids
    assert [o.completions[0].token_ids for o in a] == [o.completions[0].token_ids for o in b]
    assert c[0].completions[0].token_ids != a[0].completions[0].token_ids


def test_stop_tokens_and_length_limits(model):
    prompt = make_prompts([10], seed=8)[0]
    free = run_alone(model, prompt, SamplingParams(seed=9, max_new_tokens=30, ignore_eos=True))
    tokens = free.completions[0].token_ids
    stop = tokens[7]
    first = tokens.index(stop)
    out = run_alone(model, prompt, SamplingParams(seed=9, max_new_tokens=30, ignore_eos=True, stop_token_ids=(stop,)))
    c = out.completions[0]
    assert c.token_ids == tokens[:first + 1] and c.finish_reason == "stop"  # the stop token is kept
    # max_len caps the budget: prompt + response never exceed the KV slot
    capped = run_alone(model, prompt, SamplingParams(seed=9, max_new_tokens=500, ignore_eos=True),
                       small_config(max_len=24))
    assert capped.completions[0].token_ids == tokens[:14] and capped.completions[0].finish_reason == "length"


BAD_REQUESTS = [
    ([], SamplingParams(), "empty"),
    (list(range(3, 3 + 64)), SamplingParams(), "max_len"),
    ([5, VOCAB, 7], SamplingParams(), r"\[0, 256\)"),
    ([5, -1, 7], SamplingParams(), r"\[0, 256\)"),
    ([5, 6], SamplingParams(n=5), r"n=5.*max_slots"),
    ([5, 6], SamplingParams(n=0), r"SamplingParams\.n="),
    ([5, 6], SamplingParams(temperature=-0.5), "temperature"),
    ([5, 6], SamplingParams(top_p=0.0), "top_p"),
    ([5, 6], SamplingParams(top_k=-5), "top_k"),
    ([5, 6], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ([5, 6], SamplingParams(stop_token_ids=(1000,)), "stop_token_ids"),
]


def test_bad_input_raises_and_the_engine_keeps_serving(model):
    prompt = make_prompts([9], seed=9)[0]
    params = SamplingParams(n=2, seed=3, max_new_tokens=20)
    alone = run_alone(model, prompt, params, small_config(max_slots=4, max_len=64))
    engine = Engine(model, small_config(max_slots=4, max_len=64))
    rid = engine.add_request(prompt, params, request_id="keep-me")
    engine.step()
    engine.step()
    for bad_prompt, bad_params, field in BAD_REQUESTS:
        with pytest.raises(ValueError, match=field):
            engine.add_request(bad_prompt, bad_params)
        assert engine.num_waiting == 0 and engine.num_running == 2  # nothing was queued
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request([5, 6], SamplingParams(), request_id="keep-me")
    with pytest.raises(ValueError, match="mode"):
        engine.pause("later")
    with pytest.raises(ValueError, match="kv"):
        engine.update_weights([], kv="reuse")
    assert not engine.is_paused
    done = drain(engine)
    assert list(done) == [rid]
    assert_same_output(done[rid], alone, model, params)
    # a prompt of max_len − 1 tokens is fine: room for exactly one token
    out = Engine(model, small_config(max_len=16)).generate([list(range(3, 18))], SamplingParams(ignore_eos=True))
    assert len(out[0].completions[0].token_ids) == 1 and out[0].completions[0].finish_reason == "length"


def test_engine_config_is_validated(model):
    for field in ("max_slots", "max_len", "max_prefill_tokens", "attend_bucket"):
        with pytest.raises(ValueError, match=field):
            Engine(model, EngineConfig(**{field: 0}))


def test_sliding_window_models_refuse_longer_slots():
    # sliding-window attention is not implemented: a Mistral whose window is shorter than the KV slot
    # must be refused up front rather than silently attending past the window
    from tests.policies.helpers import tiny_model
    model = tiny_model(model_type="mistral", sliding_window=32)
    with pytest.raises(ValueError, match="sliding_window=32"):
        Engine(model, EngineConfig(max_slots=2, max_len=64))
    engine = Engine(model, EngineConfig(max_slots=2, max_len=32))  # fits inside the window: fine
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(out[0].completions[0].token_ids) == 4
    qwen = tiny_model(model_type="qwen2", sliding_window=8, use_sliding_window=False)
    assert qwen.config.sliding_window is None  # Qwen2 ignores the field unless use_sliding_window
