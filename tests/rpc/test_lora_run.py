"""LoRA across processes, in verl's three modes: the trainer publishes only its adapters (param_sync/bytes is the
adapters' float32 size, every version), each agent merges them into the base it loaded itself, and the
reward of the toy task rises."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.config import LoraConfig
from asyncrl.rpc.spec import AgentSpec
from asyncrl.rpc.supervise import launch
from tests.rpc.test_rpc_run import MODES, assert_books_balance, assert_reward_rose, make_spec, place
from tests.timing import limit

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(limit(300))]

LORA = LoraConfig(rank=4, alpha=8.0)
VERSIONS, LR, N = 12, 2e-2, 8  # 8 samples a prompt: the toy task's reward per version is noisy at 4
# the tiny model (tests.rpc.helpers.MODEL_CONFIG): hidden 64, 4 query heads and 2 K/V heads of 16, MLP 128, 2 layers;
# r·(in + out) per adapted layer: q 64+64, k 64+32, v 64+32, o 64+64, gate 64+128, up 64+128, down 128+64
ADAPTER_BYTES = 2 * LORA.rank * (128 + 96 + 96 + 128 + 192 + 192 + 192) * 4


@pytest.mark.parametrize("mode", list(MODES))
def test_a_lora_run_learns_and_publishes_only_its_adapters(mode):
    knobs, max_lag = MODES[mode]
    spec = make_spec([AgentSpec(), AgentSpec()], total_versions=VERSIONS, lr=LR, **knobs)
    spec = dataclasses.replace(spec, lora=LORA, rollout=dataclasses.replace(spec.rollout, n=N))
    summary = launch(place(spec, knobs))
    assert summary.versions == VERSIONS and summary.dead_agents == []
    assert_books_balance(summary, spec)
    assert_reward_rose(summary)
    assert [m["param_sync/bytes"] for m in summary.history] == [ADAPTER_BYTES] * VERSIONS
    if max_lag is not None:
        assert max(m["training/version_lag/max"] for m in summary.history) <= max_lag
