"""The per-version console line, the ETA and the end-of-run summary lines."""

import io
import pickle

import hypothesis.strategies as st
from hypothesis import given

from asyncrl.tracking.console import LINE_WIDTH, Console, eta_seconds, format_seconds, version_line
from asyncrl.runtime.controller import RunSummary

FULL = {"critic/score/mean": 0.875, "response_length/mean": 123.4, "actor/entropy": 0.0123,
        "training/version_lag/max": 2, "actor/behaviour_k1": 2.1e-4, "timing_s/param_sync": 0.68,
        "perf/throughput": 12345.6, "reward/error_share": 0.0}


def test_line_shows_progress_eta_and_the_main_numbers():
    line = version_line(FULL, version=12, total=20, wall_s=96.0, eta_s=64.0)
    assert line.startswith("v 12/20   1m36s  ETA 1m04s")
    for part in ("reward 0.875", "len 123.4", "lag 2", "drift 2.1e-04", "sync 0.68s", "12346 tok/s"):
        assert part in line, part
    assert "rewards failed" not in line


@given(version=st.integers(0, 10**7), total=st.integers(1, 10**7), wall=st.floats(0, 1e7),
       eta=st.one_of(st.none(), st.floats(0, 1e7)), share=st.floats(0, 1), big=st.floats(-1e12, 1e12))
def test_line_never_exceeds_the_width(version, total, wall, eta, share, big):
    metrics = {**{k: big for k in FULL}, "reward/error_share": share}
    line = version_line(metrics, version=version, total=total, wall_s=wall, eta_s=eta, color=True)
    assert len(line.replace("\033[31m", "").replace("\033[0m", "")) < LINE_WIDTH


def test_failed_rewards_beyond_the_share_are_flagged():
    line = version_line({**FULL, "reward/error_share": 0.75}, version=3, total=5, wall_s=1, eta_s=1, warn_share=0.5)
    assert line.endswith("! 75% of rewards failed")
    colored = version_line({**FULL, "reward/error_share": 0.75}, version=3, total=5, wall_s=1, eta_s=1, color=True)
    assert "\033[31m! 75% of rewards failed\033[0m" in colored
    assert "failed" not in version_line({**FULL, "reward/error_share": 0.5}, version=3, total=5, wall_s=1, eta_s=1)


def test_eta_from_the_rate_since_the_start_capped_by_the_budget():
    assert eta_seconds(version=0, total=10, wall_s=5.0) is None
    assert eta_seconds(version=4, total=10, wall_s=40.0) == 60.0
    assert eta_seconds(version=14, total=20, wall_s=140.0, first_version=10, start_s=100.0) == 60.0  # resumed
    assert eta_seconds(version=4, total=10, wall_s=40.0, time_budget_s=50.0) == 10.0
    assert eta_seconds(version=10, total=10, wall_s=40.0) == 0.0
    assert [format_seconds(s) for s in (0, 45.4, 185, 7620)] == ["0s", "45s", "3m05s", "2h07m"]


def test_console_prints_lines_and_remembers_failed_versions():
    out = io.StringIO()
    console = Console(total=4, out=out, interactive=False, warn_share=0.5)
    console.version(FULL, 1, 10.0)
    console.version({**FULL, "reward/error_share": 0.9}, 2, 20.0)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("v 1/4") and "ETA" not in lines[0]  # start-up time is not a version's
    assert lines[1].startswith("v 2/4") and "ETA 20s" in lines[1] and lines[1].endswith("! 90% of rewards failed")
    assert console.warned_versions == [(2, 0.9)]
    again = pickle.loads(pickle.dumps(console))  # travels to rank 0 before printing
    assert again.total == 4 and again.warned_versions == [(2, 0.9)]


def test_summary_lines_name_drop_reasons_reward_failures_and_bad_versions():
    summary = RunSummary(
        versions=3, steps=3, dead_agents=["agent1"],
        ledger={"admitted": 20, "trained": 12, "dropped": 8, "in_flight": 0, "pending": 0, "queued": 0,
                "dropped/run_end": 6, "dropped/stale": 2},
        history=[{"version": 1, "reward/error_share": 0.1}, {"version": 2, "reward/error_share": 0.8},
                 {"version": 3, "reward/error_share": 0.9}],
        rewards={"calls": 96, "errors": 40, "timeouts": 3,
                 "examples": ["bad.py:score raised ValueError('no') for data_source 'x', row 3"]})
    text = summary.done_lines(warn_share=0.5)
    assert "done: 3 versions, 3 learner steps" in text
    assert "prompts: 20 admitted, 12 trained, 8 dropped (run_end 6, stale 2)" in text
    assert "rewards: 96 scored, 40 errors, 3 timeouts" in text and "bad.py:score raised ValueError" in text
    assert "more than 50% of the rewards failed in 2 versions (2, 3)" in text
    assert "dead agents: agent1" in text
