"""The trainer host's memory for the sample queue and one learner step (asyncrl/launch/step_checks.py): the bytes
by hand for a small config; a mini-batch too large for the host is refused before launch naming
--trainer.mini-batch-size and the largest value that fits (which fits, one more does not); `preflight` asks the
host source it is given; /proc/meminfo is read."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.config import RunConfig
from asyncrl.config.presets import PRESETS
from asyncrl.launch.preflight import preflight
from asyncrl.launch.step_checks import HOST_MARGIN, check_step_memory, host_available, step_bytes
from asyncrl.planning.memory import GIB


def _cfg(mini_batch_size: int, **async_training) -> RunConfig:
    cfg = PRESETS["cpu-demo"][1]
    return dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, mini_batch_size=mini_batch_size),
        async_training=dataclasses.replace(cfg.async_training, **async_training))


def test_step_bytes_by_hand():
    # cpu-demo: n 8, 64 prompt + 8 new tokens, staleness 0.5, trigger 1; mini-batch 4, 2 batches a step
    b = step_bytes(_cfg(4, require_batches=2))
    assert b.window_groups == int(4 * 2 * 1.5 * 1) == 12
    assert b.queued == 12 * (8 * 8 * 80 + 64 * 36)
    assert b.collated == 4 * 2 * 8 * (72 * 8 + 8 * 29)
    assert b.total == b.queued + b.collated


@pytest.mark.parametrize("require_batches", [1, 3])
def test_a_mini_batch_too_large_for_the_host_names_the_largest_that_fits(require_batches):
    available = 2 * GIB
    cfg = _cfg(10**6, require_batches=require_batches)
    problem = check_step_memory(cfg, available=available)
    assert problem.startswith("--trainer.mini-batch-size 1000000")
    assert ("--async-training.require-batches 3" in problem) == (require_batches == 3)
    fits = int(problem.rsplit("the largest --trainer.mini-batch-size that fits is ", 1)[1])
    room = available * (1 - HOST_MARGIN)
    assert step_bytes(cfg, fits).total <= room < step_bytes(cfg, fits + 1).total
    assert check_step_memory(_cfg(fits, require_batches=require_batches), available=available) is None


def test_no_mini_batch_fits_names_the_sample_flags():
    problem = check_step_memory(_cfg(4), available=1024)
    assert "no mini-batch fits: lower --rollout.max-new-tokens or --rollout.n" in problem


def test_preflight_refuses_a_step_its_host_cannot_hold(tmp_path):
    cfg = dataclasses.replace(_cfg(100_000), run_dir=str(tmp_path / "run"))
    report = preflight(cfg, host=lambda: GIB)  # it needs 1.6 GiB
    assert any(p.startswith("--trainer.mini-batch-size 100000: a learner step of 100000 groups")
               for p in report.problems), report.problems
    assert not any("mini-batch" in p for p in preflight(cfg, host=lambda: 64 * GIB).problems)


def test_the_host_s_available_memory_is_read():
    assert 0 < host_available()
