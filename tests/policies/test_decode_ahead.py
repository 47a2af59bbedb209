"""The engine's decode steps launched one ahead of the host (`EngineConfig.decode_ahead`) generate exactly what
steps run one at a time do: through stops, queued requests admitted while a step is in flight, slot moves,
rows that filter (top-k / top-p), pauses, aborts and weight updates."""

from __future__ import annotations

import pytest

from asyncrl.policies import Engine, SamplingParams, named_weights
from tests.policies.helpers import EOS, assert_consistent, assert_same_output, drain, make_prompts, small_config, tiny_model


def _workload(filtered: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    """More samples than slots, EOS on (rows finish at different steps and their slots are refilled)."""
    prompts = make_prompts([5, 11, 3, 17, 8, 9, 14, 6], seed=21)
    params = [SamplingParams(n=1 + i % 3, temperature=0.6 + 0.1 * i, max_new_tokens=10 + 7 * i, seed=100 + i)
              for i in range(len(prompts))]
    if filtered:
        params[3] = SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.9, max_new_tokens=30, seed=7)
    return prompts, params


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "with-top-k-rows"])
def test_ahead_generates_what_one_step_at_a_time_does(filtered):
    model = tiny_model(seed=3)
    prompts, params = _workload(filtered)
    outs = {}
    for ahead in (False, True):
        engine = Engine(model, small_config(max_slots=6, decode_ahead=ahead))
        outs[ahead] = engine.generate(prompts, params)
    stops = 0
    for one, two, p in zip(outs[False], outs[True], params):
        assert_consistent(two)
        assert_same_output(two, one, model, p)
        stops += sum(c.finish_reason == "stop" for c in two.completions)
    assert stops >= 2, "no sample stopped at EOS: the workload does not test rows that finish in flight"
    assert EOS in {t for o in outs[True] for c in o.completions for t in c.token_ids}


def test_no_step_is_launched_after_every_row_ends_with_the_one_in_flight():
    """Rows that reach their length together: the step that samples their last token is the last one launched
    (ahead or not, a batch of N-token samples takes N - 1 decode steps after the prefill's token)."""
    model = tiny_model(seed=3)
    prompts = make_prompts([5, 9, 3], seed=4)
    params = SamplingParams(n=2, max_new_tokens=12, ignore_eos=True, seed=5)
    outs = {}
    for ahead in (False, True):
        engine = Engine(model, small_config(max_slots=6, decode_ahead=ahead))
        outs[ahead] = engine.generate(prompts, params)
        assert engine.stats["decode_steps"] == 11, (ahead, engine.stats)
    for one, two in zip(outs[False], outs[True]):
        assert_same_output(two, one, model, params)


def test_pause_abort_and_update_with_a_step_in_flight():
    """Controls between steps drop the step in flight: after the same tokens, the same update and abort, both engines
    go on alike (every sample fits at once, so both admit the same rows at the same time)."""
    new = tiny_model(seed=4)
    prompts, params = _workload(False)
    reference = {}
    engines = {ahead: Engine(tiny_model(seed=3), small_config(max_slots=16, decode_ahead=ahead)) for ahead in (0, 1)}
    for ahead, engine in engines.items():
        ids = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        for _ in range(3 + ahead):  # the same tokens appended in both engines before the pause
            engine.step()
        engine.pause("keep")
        aborted = engine.abort([ids[1]])
        engine.update_weights(named_weights(new), version=1)
        engine.resume()
        reference[ahead] = (aborted, drain(engine))
    (aborted0, done0), (aborted1, done1) = reference[0], reference[1]
    assert [c.token_ids for c in aborted1[0].completions] == [c.token_ids for c in aborted0[0].completions]
    assert set(done1) == set(done0)
    for rid, out in done1.items():
        assert_consistent(out)
        assert_same_output(out, done0[rid], new, params[int(rid[1:])])
        assert all(c.versions == sorted(c.versions) for c in out.completions)
