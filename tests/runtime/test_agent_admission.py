"""How many prompts an agent keeps in flight by default (`RolloutConfig.concurrent_prompts`); the rows that this fills
are measured in tests/bench/test_lag_relation.py (a real async run) and tests/bench/test_admission.py (the engine)."""

from __future__ import annotations

from asyncrl.config import RolloutConfig


def test_an_agent_keeps_twice_the_groups_its_slots_hold_in_flight_by_default():
    """A group is delivered when its longest sample ends; meanwhile waiting groups take the slots its finished
    samples free (docs/staleness.md, "Lag and response length"). One prompt slot a group with the shared-prompt
    layout; an explicit --rollout.max-concurrent-prompts wins."""
    assert RolloutConfig(max_slots=64, n=4).concurrent_prompts == 32
    assert RolloutConfig(max_slots=64, n=4, kv_layout="shared-prompt").concurrent_prompts == 16
    assert RolloutConfig(max_slots=64, n=4, max_concurrent_prompts=5).concurrent_prompts == 5
    assert RolloutConfig(max_slots=2, n=8).concurrent_prompts == 2
