"""How many prompts an agent keeps in flight by default (`RolloutConfig.concurrent_prompts`); the rows that this fills
are measured in tests/bench/test_lag_relation.py (a real async run) and tests/bench/test_admission.py (the engine)."""

from __future__ import annotations

from asyncrl.config import RolloutConfig


def test_an_agent_keeps_the_groups_its_slots_hold_in_flight_by_default():
    """max_slots // n prompts (one group a prompt), whatever the K/V layout; an explicit
    --rollout.max-concurrent-prompts wins (twice as many fill more of the slots: docs/staleness.md, "Lag and
    response length", with what they cost on an H200)."""
    assert RolloutConfig(max_slots=64, n=4).concurrent_prompts == 16
    assert RolloutConfig(max_slots=64, n=4, kv_layout="shared-prompt").concurrent_prompts == 16
    assert RolloutConfig(max_slots=64, n=4, max_concurrent_prompts=32).concurrent_prompts == 32
    assert RolloutConfig(max_slots=2, n=8).concurrent_prompts == 1
