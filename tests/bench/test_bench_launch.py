"""`asyncrl bench launch`: the medians and ratios it prints, its refusals, and a tiny-budget run of both start
methods (two real jobs)."""

from __future__ import annotations

import json

import pytest

from asyncrl_bench.launch import LaunchBenchArgs, bench_launch, summarize


def test_medians_per_method_and_the_spawn_over_forkserver_ratio():
    rows = [{"method": "spawn", "exit_s": 9.0}, {"method": "spawn", "exit_s": 6.0}, {"method": "spawn", "exit_s": 7.0},
            {"method": "forkserver", "exit_s": 4.0}, {"method": "forkserver", "exit_s": 2.0}]
    # spawn's median is 7 (of 6, 7, 9); forkserver's 3 (the mean of the middle two of 2, 4); 7 / 3
    assert summarize(rows, ("exit_s",)) == {"median_s": {"spawn": {"exit_s": 7.0}, "forkserver": {"exit_s": 3.0}},
                                            "spawn_over_forkserver": {"exit_s": pytest.approx(7 / 3)}}
    assert summarize(rows[:3], ("exit_s",))["spawn_over_forkserver"] == {}  # one method: no ratio


@pytest.mark.parametrize("field, flag", [("repeats", "--repeats"), ("versions", "--versions"),
                                         ("agents", "--agents")])
def test_bad_counts_are_refused_naming_the_flag(field, flag):
    with pytest.raises(ValueError, match=f"{flag} 0 is invalid: must be >= 1"):
        bench_launch(LaunchBenchArgs(**{field: 0}))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_tiny_budget_run_times_both_start_methods(tmp_path, capsys):
    out = tmp_path / "launch.json"
    result = bench_launch(LaunchBenchArgs(repeats=1, restart=False, out=str(out)))
    assert sorted(r["method"] for r in result["jobs"]) == ["forkserver", "spawn"]
    for row in result["jobs"]:
        assert 0 < row["first_version_s"] <= row["exit_s"] and row["cpu_s"] > 0, row
    assert result["spawn_over_forkserver"].keys() == {"first_version_s", "exit_s", "cpu_s"}
    assert json.loads(out.read_text())["median_s"] == result["median_s"]
    assert "spawn / forkserver:" in capsys.readouterr().out
