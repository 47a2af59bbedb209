"""RL controls of `asyncrl.policies.Engine`: pause / resume, abort, update_weights (versions, kv keep vs
recompute), sleep / wake_up."""

from __future__ import annotations

import pytest
import torch

from asyncrl.policies import Engine, KVCache, SamplingParams, named_weights, save_pretrained
from tests.policies.helpers import (
    assert_consistent, assert_same_output, drain, forward_logprobs, logprob_tol, make_prompts, manual_greedy,
    run_alone, small_config, tiny_model,
)


def _params(seed: int, max_new: int, **kw) -> SamplingParams:
    return SamplingParams(seed=seed, max_new_tokens=max_new, ignore_eos=True, **kw)


# ------------------------------------------------------------------------------------------- pause / resume
def test_pause_keep_then_resume_equals_an_uninterrupted_run():
    model = tiny_model(seed=1)
    prompts = make_prompts([7, 15, 22], seed=1)
    params = [_params(1, 20, n=2), _params(2, 14), _params(3, 25, temperature=0.8)]
    reference = Engine(model, small_config()).generate(prompts, params)

    engine = Engine(model, small_config())
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(4):
        engine.step()
    assert engine.pause("keep") == []
    assert engine.is_paused and engine.has_unfinished() and engine.num_running == 4
    before = dict(engine.stats)
    late = engine.add_request(make_prompts([5], seed=2)[0], _params(4, 6))  # queued while paused
    for _ in range(3):
        assert engine.step() == []
    assert engine.stats == before, "step() while paused must not generate"
    assert engine.num_waiting == 1
    with pytest.raises(ValueError, match="paused"):
        engine.generate([[5, 6]])
    engine.resume()
    assert not engine.is_paused
    done = drain(engine)
    assert set(done) == set(ids) | {late}
    for rid, ref, p in zip(ids, reference, params):
        out = done[rid]
        assert_same_output(out, ref, model, p)  # the same tokens; log-probs up to rounding (a late request joined)
        assert all(c.finish_reason == "length" for c in out.completions)


@pytest.mark.parametrize("ahead", [False, True], ids=["one-step", "ahead"])
def test_pause_abort_returns_partial_outputs(ahead):
    """With `decode_ahead`, a step's tokens are appended at the next step: one token fewer after k steps."""
    model = tiny_model(seed=2)
    prompts = make_prompts([6, 12, 9], seed=3)
    params = [_params(5, 30, n=2), _params(6, 30), _params(7, 30)]
    engine = Engine(model, small_config(max_slots=3, decode_ahead=ahead))  # the third request waits
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(5):
        engine.step()
    assert engine.num_running == 3 and engine.num_waiting == 1
    outs = engine.pause("abort")
    assert engine.is_paused and not engine.has_unfinished()
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert [o.request_id for o in outs] == ids
    for out, prompt, p in zip(outs, prompts, params):
        assert out.finished and out.prompt_ids == prompt
        assert_consistent(out)
        full = run_alone(model, prompt, p)
        for c, fc in zip(out.completions, full.completions):
            assert c.finish_reason == "abort"
            assert c.token_ids == fc.token_ids[:len(c.token_ids)]
    # a request admitted at step 1 has its prefill token plus one decode token per step
    assert [len(c.token_ids) for o in outs for c in o.completions] == [6 - ahead] * 3 + [0]
    assert engine.step() == []
    engine.resume()
    out = engine.generate([prompts[0]], params[0])[0]  # the engine serves again, from a clean state
    assert_same_output(out, run_alone(model, prompts[0], params[0]), model, params[0])


def test_pause_wait_drains_running_requests_and_keeps_the_queue():
    model = tiny_model(seed=3)
    prompts = make_prompts([5, 9, 13, 4], seed=4)
    params = [_params(8, 6), _params(9, 10), _params(10, 8), _params(11, 5, n=2)]
    engine = Engine(model, small_config(max_slots=2))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 2
    assert engine.pause("wait") == []
    assert not engine.is_paused  # still draining
    done, steps = {}, 0
    while not engine.is_paused:
        outs = engine.step()
        steps += 1
        assert engine.num_waiting == 2, "no admission while draining"
        done.update({o.request_id: o for o in outs})
        assert steps < 50
    assert set(done) == set(ids[:2]) and engine.num_running == 0 and engine.has_unfinished()
    assert all(c.finish_reason == "length" for o in done.values() for c in o.completions)
    before = dict(engine.stats)
    assert engine.step() == [] and engine.stats == before
    engine.resume()
    done.update(drain(engine))
    assert set(done) == set(ids)
    for rid, prompt, p in zip(ids, prompts, params):
        assert_same_output(done[rid], run_alone(model, prompt, p), model, p)
    # with nothing running, pause("wait") pauses at once
    engine.add_request(prompts[0], params[0])
    engine.pause("wait")
    assert engine.is_paused and engine.num_waiting == 1
    engine.resume()
    assert len(drain(engine)) == 1


# ------------------------------------------------------------------------------------------------- abort
@pytest.mark.parametrize("ahead", [False, True], ids=["one-step", "ahead"])
def test_abort_returns_tokens_so_far_and_others_continue(ahead):
    model = tiny_model(seed=4)
    prompts = make_prompts([8, 14, 5, 11, 17], seed=5)
    params = [_params(12, 24, n=2), _params(13, 24), _params(14, 24), _params(15, 24), _params(16, 24)]
    engine = Engine(model, small_config(max_slots=4, decode_ahead=ahead))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(6):
        engine.step()
    assert engine.num_running == 4 and engine.num_waiting == 2
    # abort the first (slot 0 and 1: the survivors get moved into its slots), a waiting one, an unknown id
    outs = engine.abort([ids[0], ids[4], "no-such-request"])
    assert [o.request_id for o in outs] == [ids[0], ids[4]]
    running, waiting = outs
    assert_consistent(running)
    k = 7 - ahead  # tokens after 6 steps
    for c, fc in zip(running.completions, run_alone(model, prompts[0], params[0]).completions):
        assert c.finish_reason == "abort" and len(c.token_ids) == k
        assert c.token_ids == fc.token_ids[:k]
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(fc.logprobs[:k]),
                                   atol=logprob_tol(model, prompts[0], fc.token_ids[:k]), rtol=0)
        assert c.versions == [0] * k
    assert [(c.token_ids, c.logprobs, c.versions, c.finish_reason) for c in waiting.completions] == \
        [([], [], [], "abort")]
    assert engine.abort([ids[0]]) == []  # already gone
    done = drain(engine)
    assert set(done) == set(ids[1:4])
    for i in (1, 2, 3):
        assert_same_output(done[ids[i]], run_alone(model, prompts[i], params[i]), model, params[i])


# ---------------------------------------------------------------------------------------- update_weights
def _keep_reference(old, new, prompt, tokens, m):
    """Log-probs of tokens[m:] when positions < len(prompt) + m − 1 hold K/V of `old` and everything from the
    update on is computed by `new` (what kv="keep" means), built from CausalLM's own cache API."""
    cfg = old.config
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, 128, cfg.head_dim, torch.float32, "cpu")
    seq = prompt + tokens
    with torch.no_grad():
        old(torch.tensor([seq[:len(prompt) + m - 1]]), cache=cache, cache_slots=torch.tensor([0]))
        out = []
        for pos in range(len(prompt) + m - 1, len(seq) - 1):
            hidden = new(torch.tensor([[seq[pos]]]), torch.tensor([[pos]]), cache=cache, decode=True)
            out.append(torch.log_softmax(new.logits(hidden[:, 0])[0], -1)[seq[pos + 1]])
    return torch.stack(out)


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_pause_keep_update_resume_loses_no_token_and_keeps_the_budget(kv):
    """The agent's update sequence, repeated: pause("keep") → update_weights → resume, three times at different
    points. No token is lost or repeated: every sample ends at exactly its budget, its versions run 0, 1, 2, 3
    in order, and (kv="recompute") each stretch of tokens has the log-probs of the weights it is stamped with."""
    models = [tiny_model(seed=s) for s in (5, 6, 7, 8)]
    prompts = make_prompts([6, 17], seed=6)
    params = [_params(17, 24, n=2), _params(18, 24)]
    engine = Engine(tiny_model(seed=5), small_config())
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for version, steps in ((1, 4), (2, 7), (3, 5)):
        for _ in range(steps):
            engine.step()
        assert engine.pause("keep") == []
        engine.update_weights(named_weights(models[version]), version=version, kv=kv)
        engine.resume()
    done = drain(engine)
    for rid, prompt in zip(ids, prompts):
        for c in done[rid].completions:
            assert len(c.token_ids) == 24 and c.finish_reason == "length"
            assert c.versions == sorted(c.versions) and set(c.versions) == {0, 1, 2, 3}
            lp = torch.tensor(c.logprobs)
            for version in ({0, 1, 2, 3} if kv == "recompute" else {0}):
                at = [j for j, v in enumerate(c.versions) if v == version]
                upto = at[-1] + 1
                expected = forward_logprobs(models[version], prompt, c.token_ids[:upto])[at]
                torch.testing.assert_close(lp[at], expected, rtol=0,
                                           atol=logprob_tol(models[version], prompt, c.token_ids[:upto]))


def test_interruptions_mixing_sleep_wake_and_updates_keep_every_sample_at_its_budget():
    """A colocated engine's cycle (pause, sleep, update, wake, resume) interleaved with plain keep-mode updates,
    four times at different points: the cumulative length of each partial rollout is exactly its budget (never
    more, however often it was interrupted), and its versions only go forward."""
    models = [tiny_model(seed=s) for s in (15, 16, 17, 18, 19)]
    prompts = make_prompts([5, 11, 3], seed=9)
    params = [_params(31, 20, n=2), _params(32, 20), _params(33, 20, n=3)]
    engine = Engine(tiny_model(seed=15), small_config())
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for version, (steps, colocated) in enumerate(((3, True), (4, False), (2, True), (5, True)), start=1):
        for _ in range(steps):
            engine.step()
        assert engine.pause("keep") == []
        if colocated:
            engine.sleep()
        engine.update_weights(named_weights(models[version]), version=version)
        if colocated:
            engine.wake_up()
        engine.resume()
    done = drain(engine)
    for rid in ids:
        for c in done[rid].completions:
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == 20 and c.finish_reason == "length"
            assert c.versions == sorted(c.versions) and set(c.versions) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("ahead", [False, True], ids=["one-step", "ahead"])
@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_update_weights_mid_generation(kv, ahead):
    old, new = tiny_model(seed=5), tiny_model(seed=6)
    prompts = make_prompts([6, 17], seed=6)
    params = [_params(17, 24, n=2), _params(18, 24)]
    engine = Engine(tiny_model(seed=5), small_config(decode_ahead=ahead))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(5):
        engine.step()
    m = 6 - ahead  # tokens per sample before the update (the step in flight is dropped by it)
    engine.update_weights(named_weights(new), version=1, kv=kv)
    assert engine.version == 1
    done = drain(engine)
    for rid, prompt in zip(ids, prompts):
        out = done[rid]
        assert_consistent(out)
        for c in out.completions:
            assert len(c.token_ids) == 24 and c.finish_reason == "length"
            assert c.versions == [0] * m + [1] * (24 - m)
            lp = torch.tensor(c.logprobs)
            torch.testing.assert_close(lp[:m], forward_logprobs(old, prompt, c.token_ids[:m]),
                                       atol=logprob_tol(old, prompt, c.token_ids[:m]), rtol=0)
            after_full = forward_logprobs(new, prompt, c.token_ids)[m:]
            atol = logprob_tol(new, prompt, c.token_ids)  # a few 1e-4 at most: 20x below the 1e-2 below
            if kv == "recompute":
                diff = (lp[m:] - after_full).abs().max().item()
                assert diff <= atol, f"recompute: continued log-probs differ from the new model by {diff:.3g}"
            else:
                # sampled from logits that attended over old-weight K/V: not the new model's forward …
                assert (lp[m:] - after_full).abs().max().item() > 1e-2
                # … but exactly the mixed-K/V computation
                torch.testing.assert_close(lp[m:], _keep_reference(old, new, prompt, c.token_ids, m),
                                           atol=atol, rtol=0)


def test_greedy_after_update_equals_the_new_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    old = tiny_model(seed=7, initializer_range=0.3, tie_word_embeddings=False)
    new = tiny_model(seed=8, initializer_range=0.3, tie_word_embeddings=False)
    engine = Engine(tiny_model(seed=7, initializer_range=0.3, tie_word_embeddings=False), small_config())
    prompt = make_prompts([10], seed=7)[0]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    before = engine.generate([prompt], greedy)[0].completions[0]
    assert before.token_ids == manual_greedy(old, prompt, 30)  # the engine starts from `old`
    engine.update_weights(named_weights(new), version=3)
    after = engine.generate([prompt], greedy)[0].completions[0]
    assert after.versions == [3] * 30
    save_pretrained(new, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=30, pad_token_id=0)[0, len(prompt):].tolist()
    assert after.token_ids == ref
    assert after.token_ids != before.token_ids
    assert torch.equal(engine.model.lm_head.weight, new.lm_head.weight)


def test_update_weights_tied_embedding_moves_lm_head_and_buckets_keep_the_version():
    new = tiny_model(seed=9)
    engine = Engine(tiny_model(seed=10), small_config())
    weights = list(named_weights(new))
    assert "lm_head.weight" not in dict(weights)  # tied: sent once, as embed_tokens
    engine.update_weights(weights[:5])  # a partial bucket: version unchanged
    assert engine.version == 0
    engine.update_weights(weights[5:], version=2)
    assert engine.version == 2
    for name, tensor in new.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    prompt = make_prompts([9], seed=8)[0]
    c = engine.generate([prompt], _params(19, 12))[0].completions[0]
    ref = run_alone(new, prompt, _params(19, 12)).completions[0]
    assert c.token_ids == ref.token_ids and c.versions == [2] * 12
    torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref.logprobs),
                               atol=logprob_tol(new, prompt, ref.token_ids), rtol=0)


@pytest.mark.parametrize("bad", ["unknown name", "wrong shape", "wrong shape last"])
def test_update_weights_rejects_bad_names_and_shapes_without_copying(bad):
    engine = Engine(tiny_model(seed=11), small_config())
    snapshot = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = list(named_weights(tiny_model(seed=12)))
    if bad == "unknown name":
        items, match = good + [("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))], "unknown parameter"
    elif bad == "wrong shape":
        items, match = [("model.norm.weight", torch.ones(65))] + good, "shape"
    else:
        # everything valid but the last tensor, a transposed matrix: the check must precede every copy
        good = [(n, t) for n, t in good if n != "model.layers.1.mlp.down_proj.weight"]
        down = tiny_model(seed=12).model.layers[1].mlp.down_proj.weight  # [64, 128]
        items, match = good + [("model.layers.1.mlp.down_proj.weight", down.T.contiguous())], "shape"
    prompt = make_prompts([6], seed=9)[0]
    rid = engine.add_request(prompt, _params(20, 10))
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.update_weights(items, version=5, kv="recompute")
    assert engine.version == 0
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, snapshot[name]), f"{name} changed although the update was rejected"
    out = drain(engine)[rid]
    assert out.completions[0].versions == [0] * 10
    same = tiny_model(seed=11)
    assert_same_output(out, run_alone(same, prompt, _params(20, 10)), same, _params(20, 10))


# ----------------------------------------------------------------------------------------- sleep / wake_up
def test_sleep_frees_the_cache_and_wake_up_recomputes_kv():
    model = tiny_model(seed=13)
    prompts = make_prompts([5, 19, 11], seed=10)
    params = [_params(21, 26, n=2), _params(22, 26, temperature=0.7), _params(23, 26)]
    reference = Engine(model, small_config()).generate(prompts, params)
    engine = Engine(model, small_config(max_prefill_tokens=30))  # recompute in several prefill batches
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(7):
        engine.step()
    assert engine.cache.allocated
    engine.sleep()
    assert engine.is_sleeping and not engine.cache.allocated
    assert engine.cache.k is None and engine.cache.v is None
    before = dict(engine.stats)
    assert engine.step() == [] and engine.step() == []
    assert engine.stats == before
    with pytest.raises(ValueError, match="asleep"):
        engine.generate([[5, 6]])
    engine.wake_up()
    assert not engine.is_sleeping and engine.cache.allocated
    assert engine.stats["recomputed_tokens"] > 0
    done = drain(engine)
    for rid, prompt, p, ref in zip(ids, prompts, params, reference):
        out = done[rid]
        assert_same_output(out, ref, model, p)
        for c in out.completions:
            torch.testing.assert_close(torch.tensor(c.logprobs), forward_logprobs(model, prompt, c.token_ids,
                                                                                  p.temperature),
                                       atol=logprob_tol(model, prompt, c.token_ids, p.temperature), rtol=0)


@pytest.mark.parametrize("ahead", [False, True], ids=["one-step", "ahead"])
def test_abort_while_asleep_then_wake_up(ahead):
    """Aborting the first request while asleep moves the others into its slots without a cache to copy;
    wake_up must rebuild their K/V in the new slots."""
    model = tiny_model(seed=14)
    prompts = make_prompts([9, 13, 6], seed=11)
    params = [_params(24, 20, n=2), _params(25, 20), _params(26, 20)]
    engine = Engine(model, small_config(decode_ahead=ahead))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(4):
        engine.step()
    engine.sleep()
    (aborted,) = engine.abort([ids[0]])
    assert all(c.finish_reason == "abort" and len(c.token_ids) == 5 - ahead for c in aborted.completions)
    engine.wake_up()
    done = drain(engine)
    for i in (1, 2):
        assert_same_output(done[ids[i]], run_alone(model, prompts[i], params[i]), model, params[i])
