"""The controller's records (`asyncrl.runtime.controller`): when the checkpoint policy is due. The loop itself
runs in tests/rpc/test_local_run.py and tests/rpc/test_resume.py (in process, with real agents)."""

from __future__ import annotations

import re
import types

import pytest

from asyncrl.config import AsyncConfig
from asyncrl.runtime.controller import BatchTimeout, CheckpointPolicy, Controller, batch_timeout_message
from asyncrl.runtime.lifecycle import RunFailed, StopRequest
from tests.runtime.test_queue import group_of, make_queue


def test_a_checkpoint_is_due_every_k_versions_only_with_a_run_directory():
    assert [v for v in range(1, 8) if CheckpointPolicy("runs/x", every=3).due(v)] == [3, 6]
    assert not any(CheckpointPolicy("runs/x", every=0).due(v) for v in range(1, 8))  # 0: only at the end
    assert not any(CheckpointPolicy(None, every=1).due(v) for v in range(1, 8))  # no run directory: never
    assert CheckpointPolicy().keep == 3


def test_a_step_the_agents_do_not_fill_fails_with_the_real_wait_and_the_flags_in_one_line():
    """_take polls the queue in 0.5 s slices; past --async-training.take-timeout-s it fails with the whole wait (not
    the last slice's "waited 0 s"), as a RunFailed: the launcher prints it once, without a traceback."""
    queue = make_queue(8)
    tasks = queue.request("a0", 3)
    queue.submit("a0", group_of(tasks[0]))
    trainer = types.SimpleNamespace(
        _check=lambda: None, stop=StopRequest(), queue=queue,
        roster=types.SimpleNamespace(live=lambda: ["a0"], joining=lambda: []),
        config=AsyncConfig(take_timeout_s=1.2, require_batches=2),
        state=types.SimpleNamespace(config=types.SimpleNamespace(mini_batch_size=3),
                                    algorithm=types.SimpleNamespace(filter_groups=False)))
    with pytest.raises(BatchTimeout) as err:
        Controller._take(trainer, 6)
    assert isinstance(err.value, RunFailed)
    message = str(err.value)
    assert re.match(r"the trainer waited [12] s for a learner step's 6 groups \(--trainer.mini-batch-size 3 × "
                    r"--async-training.require-batches 2\) and got 1 \(2 prompts still in flight\), past "
                    r"--async-training.take-timeout-s 1.2;", message), message
    assert len(queue.queue) == 1  # the group taken is back in the queue


def test_the_batch_timeout_message_names_the_flags_and_the_wait():
    message = batch_timeout_message(waited_s=601.3, want=100000, have=24, in_flight=4, mini_batch_size=100000,
                                    require_batches=1, take_timeout_s=600)
    assert message == (
        "the trainer waited 601 s for a learner step's 100000 groups (--trainer.mini-batch-size 100000) and got 24 "
        "(4 prompts still in flight), past --async-training.take-timeout-s 600; the rollout agents may be dead, idle "
        "or slower than that: raise --async-training.take-timeout-s, or lower --trainer.mini-batch-size")
