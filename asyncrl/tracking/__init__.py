"""What a run shows: console lines (`console`), metrics to JSONL and wandb (`tracker`), plots and a summary of
a run directory (`report`).

    from asyncrl.tracking import Tracker, TrackingConfig, read_metrics
"""

from asyncrl.tracking.tracker import Tracker, TrackingConfig, read_metrics

__all__ = ["Tracker", "TrackingConfig", "read_metrics"]
