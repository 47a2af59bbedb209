"""The split planner's view in a running job: every version's metrics carry `plan/*` beside the measured idle
ratios (in-process run; and through `asyncrl train` with the local and the multi-process launcher, which pass
the run's layout). How often a better split is logged: tests/runtime/test_plan_view.py."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import AsyncConfig
from asyncrl.planning import Layout
from tests.rpc.helpers import TrainRecorder, local_run
from tests.run_helpers import NO_EVAL, cli, tiny_run
from tests.timing import limit

PLAN_KEYS = {"plan/trainer_idle_predicted", "plan/rollout_idle_predicted", "plan/trained_tok_s_predicted",
             "plan/trainer_tok_s_busy", "plan/rollout_tok_s_busy", "plan/split_gain_predicted"}


def test_every_version_carries_the_planners_view_of_its_own_busy_times():
    run = local_run(AsyncConfig(total_versions=3, trigger_parameter_sync_step=2, take_timeout_s=limit(60)),
                    layout=Layout("split", 1, 2))
    rec = TrainRecorder(run)
    summary = run.run()
    assert len(summary.history) == 3
    trained = [g for _, groups in rec.steps for g in groups]
    assert sum(m["perf/response_tokens"] for m in summary.history) == sum(
        len(c.token_ids) for g in trained for c in g.completions)
    for m in summary.history:
        assert PLAN_KEYS <= m.keys()
        assert 0 <= m["plan/trainer_idle_predicted"] <= 1 and 0 <= m["plan/rollout_idle_predicted"] <= 1
        # the rates are the version's own: trained tokens over the trainer's busy seconds, generated tokens over
        # the agents' mean busy seconds, per agent
        assert m["plan/trainer_tok_s_busy"] == pytest.approx(m["perf/total_num_tokens"] / m["timing_s/update_actor"])
        assert m["plan/rollout_tok_s_busy"] == pytest.approx(
            m["perf/response_tokens"] / (2 * m["rollouter/active_time"]))


def test_a_run_without_a_layout_logs_no_plan_metrics():
    run = local_run(AsyncConfig(total_versions=1, take_timeout_s=limit(60)))  # built from parts, no layout
    assert run.controller.plan is None
    assert not any(key.startswith("plan/") for m in run.run().history for key in m)


def _plan_rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.mark.e2e
def test_the_launchers_give_the_controller_the_runs_layout(tmp_path, tmp_path_factory):
    out = cli("train", "cpu-demo", "--model.path", "random:tiny-qwen2", "--data.task", "toy", "--placement.launcher",
              "local", "--async-training.total-versions", "2", "--wandb", "off", *NO_EVAL, "--run-dir", str(tmp_path / "local"),
              timeout=limit(240))
    assert out.returncode == 0, out.stderr[-3000:]
    for run_dir in (tmp_path / "local", tiny_run(tmp_path_factory)):  # the in-process and multi-process launchers
        rows = _plan_rows(run_dir)
        assert rows and all(PLAN_KEYS <= row.keys() for row in rows), run_dir
        assert all(row["plan/split_gain_predicted"] == 0 for row in rows)  # trainer and agent share the cpu: no advice
