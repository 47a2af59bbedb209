"""Async against sync in wall-clock (asyncrl_bench/wallclock.py): a run's held-out curve at the publication times of
its versions, the time to a target, and the race's median ratio with its bootstrap interval."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from asyncrl_bench.wallclock import CurvePoint, held_out_curve, race_summary, time_to_target

KEY = "val-core/arithmetic/reward/mean@4"


def rows() -> list[dict]:
    """Versions 1–4 published at 10, 15, 22, 30 s; evaluations of versions 0, 2 and 4, each logged in a later
    version's row (as an evaluation that ends during the next window is)."""
    out = [{"step": v, "wall_s": w} for v, w in ((1, 10.0), (2, 15.0), (3, 22.0), (4, 30.0))]
    out[0].update({KEY: 0.05, "val/version": 0})
    out[2].update({KEY: 0.40, "val/version": 2})
    out.append({"step": 4, "wall_s": 31.0, KEY: 0.65, "val/version": 4})  # the evaluation at the end
    return out


def test_the_curve_is_at_publication_times_from_the_first_version():
    curve = held_out_curve(rows())
    assert curve == [CurvePoint(5.0, 0.40, 2), CurvePoint(20.0, 0.65, 4)]  # version 0: nothing trained yet
    assert time_to_target(curve, 0.4) == 5.0 and time_to_target(curve, 0.5) == 20.0
    assert time_to_target(curve, 0.9) is None
    assert held_out_curve([{"step": 1, "wall_s": 1.0}]) == []  # no evaluation logged
    two = rows() + [{"step": 4, "wall_s": 32.0, "val-core/other/reward/mean@4": 0.1, "val/version": 4}]
    with pytest.raises(ValueError, match="2 held-out metrics"):
        held_out_curve(two)
    assert held_out_curve(two, key=KEY) == held_out_curve(rows())


def test_race_summary_golden_values():
    even = race_summary([100, 120, 140], [100, 120, 140])
    assert even.ratio == 1.0 and even.ci_low <= 1.0 <= even.ci_high
    faster = race_summary([100, 110, 120], [50, 55, 60])
    assert faster.ratio == 0.5 and faster.ci_high < 1.0 and faster.async_median == 55.0
    assert (faster.sync_reached, faster.async_reached) == (3, 3)
    never = race_summary([100, None, None], [60, 70, 80])  # a sync median that never got there
    assert never.ratio == 0.0 and never.sync_reached == 1 and math.isinf(never.sync_median)
    with pytest.raises(ValueError, match="at least one run of each mode"):
        race_summary([], [1.0])


@given(sync=st.lists(st.floats(1, 1e4), min_size=1, max_size=6), scale=st.floats(0.1, 10))
def test_scaling_every_async_time_scales_the_ratio(sync, scale):
    race = race_summary(sync, [t * scale for t in sync], resamples=500)
    assert race.ratio == pytest.approx(scale, rel=1e-9)
    assert race.ci_low <= race.ratio * (1 + 1e-9) and race.ratio <= race.ci_high * (1 + 1e-9)
