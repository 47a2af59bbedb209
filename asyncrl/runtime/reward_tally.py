"""RewardTally: what the run's reward functions did, counted as scored groups arrive at rank 0.

    tally.add(group.info.rewards)   # per group: {"calls", "errors", "timeouts", "extras", "examples"}
    tally.window()                      # per version: reward/error_share, reward/timeouts, reward/<extra> means
    tally.totals()                      # for the summary: calls, errors, timeouts, first error messages

Counting at arrival (not at training) includes the groups that are later dropped, so a reward that fails
on every sample is visible even when DAPO's filter drops all its groups.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["RewardTally", "group_reward_info"]

MAX_EXAMPLES = 5


def group_reward_info(scored, examples: list[str]) -> dict:
    """The reward part of a group's `info`, from a `ScoredGroup` and the scorer's error examples."""
    extras = {key: sum(values) / len(values) for key, values in scored.extras.items() if values}
    return {"calls": len(scored.rewards), "errors": scored.errors, "timeouts": scored.timeouts,
            "extras": extras, "examples": list(examples) if scored.errors or scored.timeouts else []}


class RewardTally:
    def __init__(self):
        self.lock = threading.Lock()
        self.total = collections.Counter()
        self.examples: list[str] = []
        self._window = collections.Counter()
        self._extras: dict[str, list[float]] = collections.defaultdict(list)

    def add(self, info: dict | None) -> None:
        if not info:
            return
        with self.lock:
            for key in ("calls", "errors", "timeouts"):
                self.total[key] += int(info.get(key, 0))
                self._window[key] += int(info.get(key, 0))
            for key, value in (info.get("extras") or {}).items():
                self._extras[key].append(float(value))
            for example in info.get("examples") or ():
                if example not in self.examples and len(self.examples) < MAX_EXAMPLES:
                    self.examples.append(example)

    def window(self) -> dict:
        """Metrics of the groups that arrived since the last call; then starts a new window."""
        with self.lock:
            window, extras = self._window, self._extras
            self._window, self._extras = collections.Counter(), collections.defaultdict(list)
            total = dict(self.total)
        failed = window["errors"] + window["timeouts"]
        out = {"reward/error_share": failed / window["calls"] if window["calls"] else 0.0,
               "reward/errors": total.get("errors", 0), "reward/timeouts": total.get("timeouts", 0),
               "reward/calls": total.get("calls", 0)}
        out.update({f"reward/{key}": sum(values) / len(values) for key, values in extras.items()})
        return out

    def totals(self) -> dict:
        with self.lock:
            return {**{k: self.total.get(k, 0) for k in ("calls", "errors", "timeouts")},
                    "examples": list(self.examples)}
