"""The suite's own settings: every deadline scales with the machine's scale and the number of xdist workers
sharing the machine (tests/timing.py), pyproject's per-test hang guard included (tests/conftest.py); files run
cheapest first in one process and costliest first in an xdist worker."""

from __future__ import annotations

import importlib.util
import pathlib

from tests.conftest import order_files_by_cost
from tests.timing import limit


def _timing_under(monkeypatch, scale: str, workers: str | None):
    """A fresh copy of tests/timing.py, read under these settings (the suite's own copy stays as it is)."""
    monkeypatch.setenv("ASYNCRL_TEST_TIME_SCALE", scale)
    if workers is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    spec = importlib.util.spec_from_file_location("timing_under_test", pathlib.Path(__file__).parent / "timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_deadlines_scale_with_the_machine_and_with_the_workers_sharing_it(monkeypatch):
    alone = _timing_under(monkeypatch, "3", None)
    shared = _timing_under(monkeypatch, "3", "2")
    assert (alone.limit(10), alone.detection_margin(), alone.agent_timeout()) == (30, 15, 30)
    # two workers: each test has about half the machine; the agent timeout is waited out, so it stays
    assert (shared.limit(10), shared.detection_margin(), shared.agent_timeout()) == (60, 30, 30)


def test_a_test_without_its_own_timeout_gets_pyprojects_scaled_like_every_deadline(request):
    ini = float(request.config.getini("timeout"))
    assert ini > 0 and request.node.get_closest_marker("timeout").args == (limit(ini),)


class _Item:
    def __init__(self, path: str, *marks: str):
        self.path, self.marks = pathlib.Path(path), marks

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None

    def __repr__(self) -> str:
        return f"{self.path}{list(self.marks)}"


def test_files_run_cheapest_first_in_one_process_and_costliest_first_in_a_worker():
    unit, later_unit = _Item("unit.py"), _Item("later_unit.py")
    model = _Item("model.py", "slow")
    run_marked, run_plain = _Item("run.py", "e2e"), _Item("run.py")
    soak = _Item("soak.py", "e2e", "slow")
    collected = [soak, unit, run_marked, run_plain, model, later_unit]
    serial = list(collected)
    order_files_by_cost(serial, costliest_first=False)
    assert serial == [unit, later_unit, model, run_marked, run_plain, soak]
    worker = list(collected)
    order_files_by_cost(worker, costliest_first=True)
    assert worker == [soak, run_marked, run_plain, model, unit, later_unit]  # a file's own order stands
