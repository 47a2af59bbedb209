"""Fixtures of the learner tests that run the same two steps in one process and across ranks (FSDP2 over gloo,
with and without LoRA)."""

from __future__ import annotations

import pytest

from tests.dist_helpers import sample_groups


@pytest.fixture(scope="module")
def groups():
    """The first step's batch: 5 groups (odd) of 3 responses of varied lengths, sampled from the initial policy."""
    return sample_groups(5, seed=0, n=3)


@pytest.fixture(scope="module")
def next_groups():
    """The second step's: 5 more groups of 3, under other prompt ids."""
    return sample_groups(5, seed=0, n=3, first_id=100)
