"""Tests for asyncrl.algos.staleness: version lag, staleness masks, verl and AReaL admission budgets.

References: /work/shared/reference/verl.md §1.3 (verl's admission formula and counter reset),
/work/shared/reference/algos.md §4.2 (verl counter) and §4.3 (AReaL gate).
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncrl import algos
from asyncrl.algos.staleness import (
    VerlBudget,
    areal_capacity,
    staleness_mask,
    verl_admit,
    verl_max_required_samples,
    verl_on_new_version,
    version_lag,
)
from tests.strategies import masks, shapes

# --------------------------------------------------------------------------------------------------------------
# (a) golden values
# --------------------------------------------------------------------------------------------------------------


def test_verl_worked_example_768():
    # verl.md §1.3 worked example (128-GPU 7B run): required = 32 × 4 = 128 prompts per local step,
    # ×4 steps per sync = 512 prompts consumed per version; ×(1 + 0.5) = 768.
    assert verl_max_required_samples(32, 4, 0.5, 4) == 768


def test_verl_seed_experiment_307():
    # seeds.md: async GSM8K run with staleness 0.2, trigger 4, require_batches 1 and mini-batch 64 logged
    # "staleness_samples 307 >= max_required_samples 307": 64 × 1 = 64; 64 × 1.2 = 76.8; × 4 = 307.2 → int 307.
    assert verl_max_required_samples(64, 1, 0.2, 4) == 307
    # The same knobs with a mini-batch of 128: 128 × 1.2 × 4 = 614.4 → 614.
    assert verl_max_required_samples(128, 1, 0.2, 4) == 614


@pytest.mark.parametrize("mini, require, trigger", [(1, 1, 1), (32, 4, 4), (64, 1, 4), (7, 3, 2), (128, 2, 1)])
def test_verl_staleness_zero_is_synchronous(mini, require, trigger):
    # staleness 0 ⇒ (1 + 0) = 1 ⇒ exactly the prompts consumed per version: mini × require × trigger.
    assert verl_max_required_samples(mini, require, 0.0, trigger) == mini * require * trigger
    assert verl_max_required_samples(mini, require, 0, trigger) == mini * require * trigger


def test_verl_staleness_one_doubles_the_window():
    # (1 + 1) = 2: "basically one_step_off" (verl.md §1.5): 2 × 16 × 2 × 3 = 192.
    assert verl_max_required_samples(16, 2, 1.0, 3) == 192


def test_verl_float_rounding_follows_verls_order():
    # 1.15 is stored as 1.149999…; verl computes int(100 × 1 × (0.15 + 1) × 1) = int(114.99999999999999) = 114,
    # one less than the exact 115. The port promises verl's order, hence verl's rounding.
    verl = int(100 * 1 * (0.15 + 1) * 1)
    assert verl == 114
    assert verl_max_required_samples(100, 1, 0.15, 1) == verl
    # And the seed values evaluated literally in verl's expression give the same result as the port.
    for mini, req, s, trig in [(64, 1, 0.2, 4), (32, 4, 0.5, 4), (10, 3, 0.1, 3), (48, 2, 0.3, 3)]:
        assert verl_max_required_samples(mini, req, s, trig) == int(mini * req * (s + 1) * trig)


def test_verl_budget_golden_window():
    # 768-prompt window; at a publish 100 prompts are in flight and 200 queued ⇒ counter restarts at 300,
    # leaving 768 − 300 = 468 new prompts for this version.
    budget = verl_on_new_version(VerlBudget(768, staleness_samples=768), in_flight=100, queued=200)
    assert budget == VerlBudget(768, 300)
    assert budget.remaining == 468 and budget.can_admit
    budget = verl_admit(budget, 468)
    assert budget.staleness_samples == 768 and budget.remaining == 0 and not budget.can_admit
    with pytest.raises(ValueError, match="max_required_samples"):
        verl_admit(budget, 1)
    # Admitting 0 at a full window is a no-op, not an error.
    assert verl_admit(budget, 0) == budget


def test_verl_admit_raises_when_over_budget_or_negative():
    budget = VerlBudget(10, staleness_samples=7)
    assert verl_admit(budget, 3).staleness_samples == 10
    with pytest.raises(ValueError, match="11 > max_required_samples 10"):
        verl_admit(budget, 4)
    with pytest.raises(ValueError):
        verl_admit(budget, -1)
    with pytest.raises(ValueError, match="in_flight"):
        verl_on_new_version(budget, in_flight=-1, queued=0)
    with pytest.raises(ValueError, match="queued"):
        verl_on_new_version(budget, in_flight=0, queued=-2)
    # Over-full budgets report remaining 0, never negative.
    assert VerlBudget(5, 9).remaining == 0 and not VerlBudget(5, 9).can_admit


def _hand_example():
    # Row 0: a partial rollout begun at version 3, continued at 4 and 5; last slot is padding.
    # Row 1: generated entirely at version 4, two padding slots.
    # Row 2: empty (all padding); its padding holds junk versions 9 > current that must be ignored.
    versions = torch.tensor([[3, 3, 4, 5, 0],
                             [4, 4, 4, 0, 0],
                             [9, 9, 9, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 0],
                         [1, 1, 1, 0, 0],
                         [0, 0, 0, 0, 0]], dtype=torch.bool)
    return versions, mask


def test_version_lag_hand_example():
    versions, mask = _hand_example()
    lag = version_lag(versions, 5, mask)
    # lag = 5 − version at valid tokens, 0 at padding.
    assert torch.equal(lag.token, torch.tensor([[2, 2, 1, 0, 0],
                                                [1, 1, 1, 0, 0],
                                                [0, 0, 0, 0, 0]]))
    assert lag.token.dtype == torch.long
    assert torch.equal(lag.seq_max, torch.tensor([2, 1, 0]))  # oldest token: 5 − 3 = 2; 5 − 4 = 1; empty → 0
    assert torch.equal(lag.seq_min, torch.tensor([0, 1, 0]))  # newest token: 5 − 5 = 0; 5 − 4 = 1; empty → 0


def test_version_lag_accepts_float_01_mask_and_int32_versions():
    versions, mask = _hand_example()
    ref = version_lag(versions, 5, mask)
    other = version_lag(versions.to(torch.int32), 5, mask.float())
    assert all(torch.equal(a, b) for a, b in zip(ref, other))


def test_staleness_mask_token_vs_sequence_hand_example():
    versions, mask = _hand_example()
    # max lag 1: row 0 has two tokens with lag 2.
    tok = staleness_mask(versions, 5, mask, max_version_lag=1, level="token")
    seq = staleness_mask(versions, 5, mask, max_version_lag=1, level="sequence")
    assert torch.equal(tok, torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool))
    # sequence level drops all of row 0 (oldest lag 2 > 1) and keeps row 1 (lag 1) whole.
    assert torch.equal(seq, torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool))
    # Default level is "sequence".
    assert torch.equal(staleness_mask(versions, 5, mask, max_version_lag=1), seq)
    # max lag 0: only fresh tokens (token level) / no stale row survives (sequence level).
    assert torch.equal(staleness_mask(versions, 5, mask, max_version_lag=0, level="token"),
                       torch.tensor([[0, 0, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool))
    assert not staleness_mask(versions, 5, mask, max_version_lag=0).any()
    # max lag 2 keeps everything valid.
    assert torch.equal(staleness_mask(versions, 5, mask, max_version_lag=2), mask)
    assert tok.dtype == torch.bool and seq.dtype == torch.bool


def test_areal_capacity_golden():
    # (η + v + 1)·B − (accepted + running) = (0 + 0 + 1)·8 − 0 = 8 at the start of a synchronous run.
    assert areal_capacity(version=0, max_staleness=0, batch_size=8, accepted=0, running=0) == 8
    # ... capped by max_concurrent − running = 4 − 0.
    assert areal_capacity(version=0, max_staleness=0, batch_size=8, accepted=0, running=0, max_concurrent=4) == 4
    # Synchronous run after generating a full batch: (0 + 0 + 1)·8 − 8 = 0 until the version moves.
    assert areal_capacity(version=0, max_staleness=0, batch_size=8, accepted=8, running=0) == 0
    assert areal_capacity(version=1, max_staleness=0, batch_size=8, accepted=8, running=0) == 8
    # η = 2, v = 3, B = 4: (2 + 3 + 1)·4 = 24; 24 − (10 + 5) = 9; with max_concurrent 16: min(9, 16 − 5 = 11) = 9,
    # with max_concurrent 6: min(9, 6 − 5 = 1) = 1.
    assert areal_capacity(version=3, max_staleness=2, batch_size=4, accepted=10, running=5) == 9
    assert areal_capacity(version=3, max_staleness=2, batch_size=4, accepted=10, running=5, max_concurrent=16) == 9
    assert areal_capacity(version=3, max_staleness=2, batch_size=4, accepted=10, running=5, max_concurrent=6) == 1
    # Over either limit → floored at 0, never negative.
    assert areal_capacity(version=0, max_staleness=0, batch_size=4, accepted=3, running=5) == 0
    assert areal_capacity(version=9, max_staleness=1, batch_size=4, accepted=0, running=7, max_concurrent=5) == 0


# --------------------------------------------------------------------------------------------------------------
# (b) properties
# --------------------------------------------------------------------------------------------------------------


@st.composite
def lag_inputs(draw):
    b, t = draw(shapes(max_b=5, max_t=7))
    mask = draw(masks(b, t))
    current = draw(st.integers(0, 12))
    valid = draw(st.lists(st.integers(0, current), min_size=b * t, max_size=b * t))
    junk = draw(st.lists(st.integers(0, 40), min_size=b * t, max_size=b * t))  # anything at padding
    versions = torch.where(mask, torch.tensor(valid).reshape(b, t), torch.tensor(junk).reshape(b, t))
    return versions, current, mask


@given(lag_inputs())
def test_version_lag_properties(inputs):
    versions, current, mask = inputs
    lag = version_lag(versions, current, mask)
    assert bool((lag.token >= 0).all())
    assert bool((lag.token[~mask] == 0).all())
    assert bool((lag.seq_max >= lag.seq_min).all()) and bool((lag.seq_min >= 0).all())
    for i in range(versions.shape[0]):
        valid = [current - int(v) for v, m in zip(versions[i], mask[i]) if m]
        assert int(lag.seq_max[i]) == (max(valid) if valid else 0)
        assert int(lag.seq_min[i]) == (min(valid) if valid else 0)
        for j in range(versions.shape[1]):
            if mask[i, j]:
                assert int(lag.token[i, j]) == current - int(versions[i, j])


@given(lag_inputs(), st.integers(0, 14))
def test_staleness_mask_properties(inputs, max_lag):
    versions, current, mask = inputs
    tok = staleness_mask(versions, current, mask, max_version_lag=max_lag, level="token")
    seq = staleness_mask(versions, current, mask, max_version_lag=max_lag, level="sequence")
    assert not bool((tok & ~mask).any())  # never adds a token
    assert not bool((seq & ~mask).any())
    assert not bool((seq & ~tok).any())  # sequence level ⊆ token level
    lag = version_lag(versions, current, mask)
    assert torch.equal(tok, mask & (lag.token <= max_lag))
    for i in range(versions.shape[0]):  # each row is kept whole or dropped whole
        assert torch.equal(seq[i], mask[i]) or not bool(seq[i].any())
    # Monotone in the threshold; a threshold ≥ current version keeps every valid token.
    looser = staleness_mask(versions, current, mask, max_version_lag=max_lag + 1, level="token")
    assert not bool((tok & ~looser).any())
    if max_lag >= current:
        assert torch.equal(tok, mask) and torch.equal(seq, mask)


VERL_EVENTS = ["admit", "admit", "finish", "consume", "publish"]


@given(mini=st.integers(1, 8), require=st.integers(1, 3), staleness=st.floats(0.0, 2.0),
       trigger=st.integers(1, 4),
       events=st.lists(st.tuples(st.sampled_from(VERL_EVENTS), st.integers(1, 12)), max_size=250))
def test_verl_admission_property(mini, require, staleness, trigger, events):
    """Random interleavings of rollouter admission, completion, training and weight publication."""
    max_req = verl_max_required_samples(mini, require, staleness, trigger)
    required = mini * require
    assert max_req >= mini * require * trigger  # staleness ≥ 0 never shrinks the window below synchronous
    budget = VerlBudget(max_req)
    in_flight = queued = 0
    carry = admitted_in_window = 0
    for event, k in events:
        if event == "admit":  # admit up to k prompts, one at a time while allowed
            for _ in range(k):
                if not budget.can_admit:
                    assert budget.remaining == 0
                    with pytest.raises(ValueError):
                        verl_admit(budget, 1)
                    break
                budget = verl_admit(budget, 1)
                in_flight += 1
                admitted_in_window += 1
        elif event == "finish":  # in flight → queued
            n = min(k, in_flight)
            in_flight, queued = in_flight - n, queued + n
        elif event == "consume":  # the trainer takes one batch of `required` prompts when available
            if queued >= required:
                queued -= required
        else:  # publish: the counter restarts at the carried-over work
            budget = verl_on_new_version(budget, in_flight, queued)
            carry, admitted_in_window = in_flight + queued, 0
            assert budget.staleness_samples == carry
        assert 0 <= budget.staleness_samples <= max_req
        assert admitted_in_window <= max_req - carry
        assert budget.staleness_samples == carry + admitted_in_window
        assert in_flight + queued <= budget.staleness_samples  # outstanding work is always charged
        assert budget.remaining == max_req - budget.staleness_samples


@pytest.mark.parametrize("mini, require, trigger", [(4, 2, 3), (1, 1, 1), (3, 1, 4)])
def test_verl_synchronous_run_admits_exactly_one_versions_worth(mini, require, trigger):
    # staleness 0 ("on-policy"/"stream" modes): per version the rollouter starts exactly mini × require × trigger
    # prompts, then is paused until the trainer has consumed them all and published.
    max_req = verl_max_required_samples(mini, require, 0.0, trigger)
    budget = VerlBudget(max_req)
    for _version in range(3):
        admitted = 0
        while budget.can_admit:
            budget = verl_admit(budget, 1)
            admitted += 1
        assert admitted == mini * require * trigger
        queued = admitted  # all finish
        for _ in range(trigger):
            queued -= mini * require
        assert queued == 0
        budget = verl_on_new_version(budget, in_flight=0, queued=queued)
        assert budget.staleness_samples == 0


@given(batch=st.integers(1, 6), eta=st.integers(0, 3), max_concurrent=st.one_of(st.none(), st.integers(1, 20)),
       events=st.lists(st.tuples(st.sampled_from(["admit", "finish", "consume"]), st.integers(1, 10)),
                       max_size=250))
def test_areal_gate_property(batch, eta, max_concurrent, events):
    """Admit up to the capacity; finish FIFO; each train step consumes B samples and bumps the version."""
    version = 0
    running: deque[int] = deque()  # admission version of each running sample, oldest first
    queued: deque[int] = deque()
    accepted = 0  # finished so far (queued or trained)
    for event, k in events:
        if event == "admit":
            cap = areal_capacity(version=version, max_staleness=eta, batch_size=batch, accepted=accepted,
                                 running=len(running), max_concurrent=max_concurrent)
            assert cap >= 0
            # The capacity is tight: one more would break one of the two limits.
            over_total = accepted + len(running) + cap + 1 > (eta + version + 1) * batch
            over_conc = max_concurrent is not None and len(running) + cap + 1 > max_concurrent
            assert over_total or over_conc
            running.extend([version] * min(k, cap))
        elif event == "finish":
            for _ in range(min(k, len(running))):
                queued.append(running.popleft())
                accepted += 1
        elif len(queued) >= batch:  # consume one batch, then publish
            for _ in range(batch):
                admitted_at = queued.popleft()
                # With in-order completion the gate bounds the lag of consumed samples by η (algos.md §4.3).
                assert version - admitted_at <= eta
            version += 1
        assert accepted + len(running) <= (eta + version + 1) * batch
        if max_concurrent is not None:
            assert len(running) <= max_concurrent


def test_areal_gate_does_not_bound_one_slow_sample_but_staleness_mask_does():
    # η = 1, B = 1. A slow sample "A" keeps running while others finish and train; the gate only counts samples,
    # so A's lag grows with every version (module docstring: neither rule bounds one slow sample).
    eta, batch, version, accepted = 1, 1, 0, 0
    assert areal_capacity(version=0, max_staleness=eta, batch_size=batch, accepted=0, running=0) == 2
    running = {"A": 0, "B0": 0}  # admitted at version 0
    n = 0
    for _ in range(5):
        name = next(k for k in running if k != "A")
        running.pop(name)  # finishes, is consumed, version advances
        accepted += 1
        version += 1
        cap = areal_capacity(version=version, max_staleness=eta, batch_size=batch, accepted=accepted,
                             running=len(running))
        assert cap >= 1
        n += 1
        running[f"B{n}"] = version
    assert version == 5 and running["A"] == 0  # A is now 5 versions old > η = 1
    # A hard version-lag cap drops it: one row generated at version 0, lag 5.
    versions = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert not staleness_mask(versions, version, mask, max_version_lag=eta).any()


# --------------------------------------------------------------------------------------------------------------
# (d) bad input → ValueError naming the argument
# --------------------------------------------------------------------------------------------------------------


def test_version_lag_rejects_float_and_bool_versions():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="token_versions"):
        version_lag(torch.zeros(2, 3), 1, mask)
    with pytest.raises(ValueError, match="token_versions"):
        version_lag(torch.zeros(2, 3, dtype=torch.bool), 1, mask)
    with pytest.raises(ValueError, match="token_versions"):
        version_lag(torch.zeros(3, dtype=torch.long), 1, torch.ones(3, dtype=torch.bool))


def test_version_lag_rejects_token_from_the_future_only_if_valid():
    versions = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="current_version"):
        version_lag(versions, 2, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="current_version"):
        staleness_mask(versions, 2, torch.ones(1, 3, dtype=torch.bool), max_version_lag=5)
    # The future token at a padded position is ignored.
    lag = version_lag(versions, 2, torch.tensor([[True, True, False]]))
    assert torch.equal(lag.token, torch.tensor([[1, 0, 0]]))


def test_version_lag_rejects_bad_mask():
    versions = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="response_mask"):
        version_lag(versions, 0, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="response_mask"):
        version_lag(versions, 0, torch.full((2, 3), 0.5))


def test_staleness_mask_rejects_bad_arguments():
    versions = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="max_version_lag"):
        staleness_mask(versions, 0, mask, max_version_lag=-1)
    with pytest.raises(ValueError, match="level"):
        staleness_mask(versions, 0, mask, max_version_lag=1, level="row")


@pytest.mark.parametrize("args, name", [
    ((32, 4, -0.1, 4), "staleness_threshold"),
    ((32, 4, float("nan"), 4), "staleness_threshold"),
    ((0, 4, 0.5, 4), "mini_batch_size"),
    ((32.5, 4, 0.5, 4), "mini_batch_size"),
    ((-32, 4, 0.5, 4), "mini_batch_size"),
    ((32, 0, 0.5, 4), "require_batches"),
    ((32, 1.5, 0.5, 4), "require_batches"),
    ((32, 4, 0.5, 0), "trigger_parameter_sync_step"),
    ((32, 4, 0.5, 2.5), "trigger_parameter_sync_step"),
])
def test_verl_max_required_samples_rejects(args, name):
    with pytest.raises(ValueError, match=name):
        verl_max_required_samples(*args)


@pytest.mark.parametrize("kwargs", [
    dict(max_staleness=-1), dict(batch_size=0), dict(version=-1), dict(accepted=-1), dict(running=-1),
])
def test_areal_capacity_rejects(kwargs):
    args = dict(version=0, max_staleness=0, batch_size=4, accepted=0, running=0) | kwargs
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        areal_capacity(**args)


def test_lag_by_length_golden_values():
    assert [algos.length_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 8, 16, 1024, 2048]
    assert algos.lag_by_length([(3, 4, 0), (4, 4, 2), (100, 120, 5), (0, 7, 1)]) == {
        1: (1, 1, 0, 7), 4: (2, 2, 7, 8), 128: (1, 5, 100, 120)}
    assert algos.lag_by_length([(3, 4, 0)])[4].group_length_sum == 4
    assert algos.lag_by_length([]) == {}
    with pytest.raises(ValueError, match="lag must be >= 0"):
        algos.lag_by_length([(3, 3, -1)])
    with pytest.raises(ValueError, match="cannot be shorter"):
        algos.lag_by_length([(5, 4, 0)])
    with pytest.raises(ValueError, match="length must be >= 0"):
        algos.length_bucket(-1)


@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 500), st.integers(0, 50)), max_size=40))
def test_lag_by_length_counts_every_sample_once_in_the_bucket_that_holds_it(raw):
    samples = [(length, length + extra, lag) for length, extra, lag in raw]
    out = algos.lag_by_length(samples)
    for field, index in (("count", None), ("lag_sum", 2), ("length_sum", 0), ("group_length_sum", 1)):
        want = len(samples) if index is None else sum(s[index] for s in samples)
        assert sum(getattr(b, field) for b in out.values()) == want, field
    for length, _, _ in samples:
        bucket = algos.length_bucket(length)
        assert bucket in out and (bucket == 1 or bucket // 2 < length <= bucket)
    assert list(out) == sorted(out)
