"""Fixtures of the `asyncrl.rpc` tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread while a test runs (restored after): the tiny model gains nothing from more, and
    the trainer plus several agent threads sharing 2 cores would otherwise oversubscribe them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
