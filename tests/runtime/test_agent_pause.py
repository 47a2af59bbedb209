"""A weight sync pauses a busy agent at the next step boundary: once `pause_for_sync` asks, the generation loop
starts no further engine step (it would win the engine's lock again and again: on a GPU a sync once waited 42
decode steps), and after `resume` it steps on. The engine here always has work and holds its lock (and the GIL)
for 2 ms a step, as a decode step's launch does."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncrl.config import RolloutConfig
from asyncrl.runtime.agent import RolloutAgent
from tests.timing import limit


class BusyEngine:
    version = 0
    is_sleeping = False
    num_running = 1

    def __init__(self):
        self.lock = threading.RLock()
        self.paused = False
        self.step_starts: list[float] = []
        self.pause_modes: list[str] = []
        self.pause_calls: list[float] = []  # when each pause began waiting for the lock

    @property
    def is_paused(self) -> bool:
        return self.paused

    def has_unfinished(self) -> bool:
        return True

    def step(self):
        with self.lock:
            if self.paused:
                return []
            self.step_starts.append(time.monotonic())
            end = time.perf_counter() + 0.002
            while time.perf_counter() < end:  # busy, holding the GIL
                pass
        return []

    def pause(self, mode: str = "keep"):
        self.pause_calls.append(time.monotonic())
        with self.lock:
            self.paused = mode == "keep"
            self.pause_modes.append(mode)
        return []

    def resume(self) -> None:
        with self.lock:
            self.paused = False


class IdleRoster:
    def heartbeat(self, agent: str) -> None: ...

    def request(self, agent: str, n: int) -> list:
        return []

    def evaluating(self, agent: str) -> bool:
        return False


def wait_for_steps(engine: BusyEngine, count: int) -> None:
    deadline = time.monotonic() + limit(10)
    while len(engine.step_starts) < count:
        assert time.monotonic() < deadline, "the loop took no engine steps"
        time.sleep(0.005)


@pytest.mark.timeout(limit(60))
def test_a_sync_pauses_the_busy_loop_at_the_next_step_boundary():
    engine = BusyEngine()
    agent = RolloutAgent("agent0", engine, None, RolloutConfig(), IdleRoster(), idle_sleep_s=0.001)
    agent.start()
    try:
        for _ in range(5):
            wait_for_steps(engine, len(engine.step_starts) + 3)
            agent.pause_for_sync(True, timeout=limit(10))
            # once the pause waits for the lock, at most the step that was starting then
            asked = engine.pause_calls[-1]
            assert sum(t >= asked for t in engine.step_starts) <= 1, (asked, engine.step_starts[-5:])
            paused_at = len(engine.step_starts)
            time.sleep(0.02)
            assert len(engine.step_starts) == paused_at  # paused: no step
            agent.resume()
        wait_for_steps(engine, paused_at + 3)  # resumed: it steps on
    finally:
        agent.stop()
    assert engine.pause_modes == ["keep"] * 5 and agent.error is None


def test_the_agent_knows_its_engines_device_given_or_from_the_engines_model():
    """The generation thread makes this device current (on CUDA: a vLLM engine over an HF directory has no model of
    its own to ask, and its first step failed on cuda:1 when the thread's current device stayed cuda:0)."""
    import types
    engine = BusyEngine()
    assert RolloutAgent("a", engine, None, RolloutConfig(), IdleRoster()).device is None
    assert RolloutAgent("a", engine, None, RolloutConfig(), IdleRoster(), device="cpu").device == torch.device("cpu")
    engine.model = types.SimpleNamespace(device=torch.device("cpu"))
    assert RolloutAgent("a", engine, None, RolloutConfig(), IdleRoster()).device == torch.device("cpu")

