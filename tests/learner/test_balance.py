"""`balance_groups`: how a trainer group deals a mini-batch's groups to its ranks (token counts even)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from asyncrl.learner import balance_groups


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.integers(1, 8))
def test_every_group_goes_to_one_rank_and_no_rank_exceeds_the_even_share_by_more_than_a_group(sizes, ranks):
    groups = [10 + 3 * i for i in range(len(sizes))]  # ids need not be 0..n-1
    tokens = dict(zip(groups, sizes))
    dealt = balance_groups(groups, tokens, ranks)
    assert len(dealt) == ranks
    assert sorted(g for d in dealt for g in d) == sorted(groups)
    for d in dealt:  # each rank's groups keep the mini-batch's order
        assert d == [g for g in groups if g in d]
    loads = [sum(tokens[g] for g in d) for d in dealt]
    assert max(loads) <= sum(sizes) / ranks + max(sizes)
    assert balance_groups(groups, tokens, ranks) == dealt  # every rank computes the same deal


def test_ragged_groups_are_dealt_by_tokens_not_by_position():
    """Every other group long: dealing every world-th group gives one rank all the long ones (3,300 against
    300 tokens); the deal by tokens: 1,300 then both 1,000s (to the lighter rank: 1,000 + 1,000), then the
    three 100s to the other: 1,600 and 2,000."""
    tokens = {0: 1000, 1: 100, 2: 1000, 3: 100, 4: 1300, 5: 100}
    dealt = balance_groups(list(tokens), tokens, 2)
    assert dealt == [[1, 3, 4, 5], [0, 2]]
    assert [sum(tokens[g] for g in d) for d in dealt] == [1600, 2000]


def test_a_mini_batch_of_one_group_leaves_the_other_ranks_empty():
    assert balance_groups([7], {7: 50}, 3) == [[7], [], []]
