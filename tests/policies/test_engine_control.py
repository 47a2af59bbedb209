"""`EngineControl` on its own, under a counting engine whose every step adds token 7 to each running sample:
request ids, the three pause modes, sleep, abort, the checks of a weight update and the version on each token."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.policies import RolloutEngine, SamplingParams
from asyncrl.policies.engine_control import EngineControl, Request, Sample


@dataclasses.dataclass(eq=False)
class _Request(Request):
    @property
    def cached_prompt_tokens(self) -> int:
        return 0


class _CountingEngine(EngineControl[_Request]):
    """Runs a sample as soon as it may (holding it back otherwise), one token per step, until max_new."""

    backend = "counting"

    def __init__(self, version: int = 0):
        super().__init__(version=version, vocab_size=16, max_len=32, max_slots=4, eos_token_ids=[0],
                         weight_shapes={"w": (2, 2)}, lora_rank=0)
        self.running: list[tuple[_Request, Sample]] = []
        self.held: list[tuple[_Request, Sample]] = []
        self.loaded: list[tuple[list[str], int | None, str]] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _new_request(self, request_id, prompt_ids, params, max_new, stop_ids, sessions) -> _Request:
        return _Request(request_id, prompt_ids, params, max_new, stop_ids, [Sample(i) for i in range(params.n)])

    def _enqueue(self, request: _Request) -> None:
        (self.running if self._admitting else self.held).extend((request, s) for s in request.samples)

    def _release_held(self) -> None:
        self.running += self.held
        self.held = []

    def _advance(self) -> list[_Request]:
        finished = []
        for request, sample in self.running:
            sample.append([7], [-1.0], self.version)
            if len(sample.completion.token_ids) == request.max_new:
                sample.completion.finish_reason = "length"
                if request.finished:
                    finished.append(request)
        self.running = [(r, s) for r, s in self.running if not s.completion.finished]
        return finished

    def _withdraw(self, request: _Request) -> None:
        self.running = [(r, s) for r, s in self.running if r is not request]
        self.held = [(r, s) for r, s in self.held if r is not request]

    def _load_weights(self, items, version, kv) -> None:
        self.loaded.append(([name for name, _ in items], version, kv))
        if version is not None:
            self.version = version

    def end_sessions(self, names) -> None:
        pass

    def _free_memory(self) -> None:
        self.held += self.running
        self.running = []

    def _restore_memory(self) -> None:
        pass


def _params(max_new: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_new_tokens=max_new, ignore_eos=True)


def _w() -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.zeros(2, 2))]


def test_the_base_is_abstract_and_an_engine_on_it_is_a_rollout_engine():
    with pytest.raises(TypeError):
        EngineControl(version=0, vocab_size=16, max_len=32, max_slots=4, eos_token_ids=[], weight_shapes={},
                      lora_rank=0)
    assert isinstance(_CountingEngine(), RolloutEngine)


def test_request_ids_and_bad_input_queue_nothing():
    engine = _CountingEngine()
    assert engine.add_request([1, 2], _params(2)) == "req-0"
    assert engine.add_request([1, 2], _params(2), "mine") == "mine"
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([3], _params(2), "mine")
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], _params(2))
    assert engine.add_request([1], _params(2)) == "req-1"
    engine.add_request([1] * 30, _params(8), "long")  # max_len 32 leaves it 2 tokens
    assert engine.num_running == 4
    done = {o.request_id: o for _ in range(2) for o in engine.step()}
    assert set(done) == {"req-0", "mine", "req-1", "long"} and not engine.has_unfinished()
    assert len(done["long"].completions[0].token_ids) == 2


def test_each_token_carries_the_version_of_its_step_and_a_partial_bucket_keeps_the_version():
    engine = _CountingEngine(version=3)
    engine.add_request([1], _params(4, n=2))
    engine.step()
    engine.update_weights(_w())  # a partial bucket: the version stays
    engine.step()
    engine.update_weights(_w(), version=5, kv="recompute")
    (out,) = engine.step() + engine.step()
    assert [c.versions for c in out.completions] == [[3, 3, 5, 5]] * 2
    assert engine.loaded == [(["w"], None, "keep"), (["w"], 5, "recompute")]


def test_an_update_is_checked_before_it_reaches_the_engine():
    engine = _CountingEngine()
    with pytest.raises(ValueError, match="kv="):
        engine.update_weights(_w(), 1, kv="drop")
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights([("v", torch.zeros(2, 2))], 1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("w", torch.zeros(3))], 1)
    assert engine.loaded == [] and engine.version == 0


def test_pause_keep_freezes_and_resume_starts_what_was_held_back():
    engine = _CountingEngine()
    engine.add_request([1], _params(3), "a")
    engine.step()
    assert engine.pause("keep") == [] and engine.is_paused
    engine.add_request([1], _params(1), "late")
    assert engine.step() == [] and engine.num_running == 1 and len(engine.held) == 1
    engine.resume()
    assert not engine.is_paused and engine.num_running == 2
    assert [o.request_id for o in engine.step()] == ["late"]
    (a,) = engine.step()
    assert a.completions[0].token_ids == [7, 7, 7]


def test_pause_abort_ends_every_request_and_returns_what_it_has():
    engine = _CountingEngine()
    engine.add_request([1], _params(1, n=2), "short")
    engine.add_request([1], _params(5), "long")
    engine.step()
    engine.step()
    (out,) = engine.pause("abort") + engine.abort(["unknown"])
    assert out.request_id == "long" and out.completions[0].finish_reason == "abort"
    assert out.completions[0].token_ids == [7, 7] and engine.is_paused and not engine.has_unfinished()


def test_pause_abort_keeps_the_reason_of_a_sample_that_had_finished():
    engine = _CountingEngine()
    engine.add_request([1], _params(1), "one")
    engine.step()  # request "one" finished and was returned
    engine.add_request([1], _params(3, n=2), "two")
    engine.step()
    _, sample = engine.running.pop()  # its second sample ends early, as a stop token would end it
    sample.completion.finish_reason = "stop"
    (out,) = engine.pause("abort")
    assert [c.finish_reason for c in out.completions] == ["abort", "stop"]


def test_pause_wait_drains_then_pauses_itself():
    engine = _CountingEngine()
    engine.add_request([1], _params(2), "a")
    engine.pause("wait")
    assert not engine.is_paused
    engine.add_request([1], _params(1), "b")  # held back while draining
    assert engine.step() == [] and not engine.is_paused
    assert [o.request_id for o in engine.step()] == ["a"] and engine.is_paused
    assert engine.step() == [] and len(engine.held) == 1
    engine.resume()
    engine.pause("wait")  # "b" runs: drain
    assert not engine.is_paused
    assert [o.request_id for o in engine.step()] == ["b"] and engine.is_paused
    engine.resume()
    engine.pause("wait")  # nothing runs: paused at once
    assert engine.is_paused


def test_sleep_stops_the_steps_and_wake_up_restarts_only_an_unpaused_engine():
    engine = _CountingEngine()
    engine.add_request([1], _params(2), "a")
    engine.sleep()
    assert engine.is_sleeping and engine.step() == [] and engine.num_running == 0
    engine.pause("keep")
    engine.wake_up()
    assert not engine.is_sleeping and engine.num_running == 0, "still paused: nothing starts"
    engine.resume()
    assert engine.num_running == 1
    assert [o.request_id for o in engine.step() + engine.step()] == ["a"]
