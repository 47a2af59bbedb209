"""scripts/draft_acceptance.py: the lockstep replay of a group's samples under the drafts (no model needed)."""

from __future__ import annotations

import pytest

from scripts.draft_acceptance import replay


def test_siblings_that_share_nothing_keep_no_draft():
    row = replay([([1, 2], [[3, 4, 5, 6], [7, 8, 9, 10]])], tokens=4, min_match=1, max_match=3)
    # only the prompt's end recurs (each sample starts after it): the second sibling is offered the first's opening
    assert row["acceptance"] == 0.0 and row["tokens_per_row_step"] == 1.0 and row["drafted_per_row_step"] > 0


def test_identical_siblings_are_drafted_from_each_other():
    sample = [3, 4, 5, 6, 7, 8, 9, 10]
    row = replay([([1, 2], [list(sample), list(sample)])], tokens=4, min_match=1, max_match=3)
    assert row["acceptance"] == 1.0  # whatever the second sibling is offered, the first already drew
    assert row["tokens_per_row_step"] > 1.5


@pytest.mark.parametrize("tokens", [1, 3])
def test_a_step_gives_at_most_the_draft_and_one(tokens):
    sample = [5, 6, 5, 6, 5, 6, 5, 6, 5, 6]
    row = replay([([5, 6], [sample])], tokens=tokens, min_match=1, max_match=2)
    assert 1.0 < row["tokens_per_row_step"] <= 1 + tokens
    assert row["drafted_per_row_step"] <= tokens
