"""Fixtures of the multi-process run tests."""

from __future__ import annotations

import pytest

from tests.rpc.jobs import Job


@pytest.fixture
def jobs():
    """Jobs a test starts (append them): each is ended, with every process of it, when the test ends."""
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()
