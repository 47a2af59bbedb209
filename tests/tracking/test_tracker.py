"""The command line's run log (`asyncrl.tracking.Tracker`): one JSON row per call, a resume drops the rows the
interrupted run logged after its checkpoint, it pickles before it opens anything, and closing twice is
harmless (a torchrun rank 0 closes it where it logs and where it was made: the same object)."""

from __future__ import annotations

import pickle

import pytest

from asyncrl.tracking import Tracker, TrackingConfig, read_metrics


def test_rows_a_resume_and_closing_twice(tmp_path):
    tracker = Tracker(TrackingConfig(run_dir=str(tmp_path), wandb="off", console=False))
    copy = pickle.loads(pickle.dumps(tracker))  # what a spawned rank 0 receives
    for step in (1, 2, 3):
        copy({"critic/score/mean": step / 10}, step)
    copy.close()
    copy.close()
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
    resumed = Tracker(TrackingConfig(run_dir=str(tmp_path), wandb="off", console=False))
    resumed.resume(version=2, wall_s=50.0)  # the checkpoint was at version 2
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2]
    assert 50.0 <= resumed.wall_s() < 60.0
    resumed({"critic/score/mean": 0.3}, 3)
    resumed.close()
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
    assert read_metrics(tmp_path)[-1]["wall_s"] >= 50.0


def test_a_live_runs_metrics_leave_out_the_line_being_written(tmp_path):
    """A reader beside a running job (`live=True`) sees the rows written so far: not a half-written last line, and
    none before the file exists; a finished run's malformed line is named."""
    assert read_metrics(tmp_path, live=True) == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "actor/pg_l')
    assert [row["step"] for row in read_metrics(tmp_path, live=True)] == [1, 2]
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: not a JSON line"):
        read_metrics(tmp_path)
