"""WorkerPool: user code in processes that can be killed. A call that holds the GIL in C code for hours is cut off
at its deadline, its worker replaced; state pinned to a lost worker is reported lost, never silently
recreated; a call that raises, crashes its worker or returns what cannot be sent back fails alone; no worker
outlives the pool or its process."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from asyncrl.rpc.worker_pool import CallFailed, CallTimedOut, WorkerLost, WorkerPool
from tests.rpc import pool_calls as calls
from tests.rpc.jobs import alive, wait_until
from tests.timing import limit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(limit(300))]

PRELOAD = ("tests.rpc.pool_calls",)


@pytest.fixture
def pool():
    workers = WorkerPool(2, name="test-pool", preload=PRELOAD)
    yield workers
    workers.close()


def test_calls_return_their_results_and_pinned_state_stays_with_its_worker(pool):
    assert pool.submit(calls.add, (2, 3), timeout_s=limit(30)).result(limit(60)) == 5
    for key, value in (("a", 1), ("b", 2), ("c", 3)):
        pool.submit(calls.remember, (key, value), timeout_s=limit(30), pin=key)
    assert [pool.submit(calls.recall, (k,), timeout_s=limit(30), pin=k).result(limit(60)) for k in "abc"] == [1, 2, 3]


def test_a_call_holding_the_gil_is_cut_off_at_its_deadline_and_the_pool_goes_on(pool):
    pool.submit(calls.add, (0, 0), timeout_s=limit(30)).result(limit(60))  # both workers started
    pool.submit(calls.remember, ("x", 7), timeout_s=limit(30), pin="x").result(limit(60))
    hung = pool.submit(calls.tower, (), timeout_s=1.0, pin="x")
    queued_on_x = pool.submit(calls.recall, ("x",), timeout_s=limit(30), pin="x")
    other = pool.submit(calls.add, (3, 4), timeout_s=limit(30))
    assert other.result(limit(60)) == 7  # the other worker serves while one hangs
    started = time.monotonic()
    with pytest.raises(CallTimedOut, match="did not return within 1 s; its worker was killed"):
        hung.result(limit(60))
    assert time.monotonic() - started < limit(30)
    with pytest.raises(WorkerLost, match="holding 'x' was lost"):
        queued_on_x.result(limit(60))  # its state died with the worker: never recreated silently
    with pytest.raises(WorkerLost, match="holding 'x' was restarted"):
        pool.submit(calls.recall, ("x",), timeout_s=limit(30), pin="x").result(limit(60))
    pool.release("x")
    pool.submit(calls.remember, ("x", 8), timeout_s=limit(30), pin="x")
    assert pool.submit(calls.recall, ("x",), timeout_s=limit(30), pin="x").result(limit(60)) == 8
    assert pool.killed == 1


def test_a_call_that_raises_crashes_or_returns_an_unsendable_value_fails_alone(pool):
    with pytest.raises(CallFailed, match="the judge is down") as raised:
        pool.submit(calls.raises, (), timeout_s=limit(30)).result(limit(60))
    assert raised.value.type_name == "ValueError"
    with pytest.raises(WorkerLost, match=r"ended \(exit code 3\)"):
        pool.submit(calls.crashes, (), timeout_s=limit(30)).result(limit(60))
    with pytest.raises(CallFailed, match="could not be sent back"):
        pool.submit(calls.unpicklable, (), timeout_s=limit(30)).result(limit(60))
    assert pool.submit(calls.add, (1, 1), timeout_s=limit(30)).result(limit(60)) == 2
    assert pool.killed == 0


def test_close_ends_every_worker_even_one_that_hangs_and_fails_what_waits():
    pool = WorkerPool(1, name="test-pool", preload=PRELOAD)
    worker = pool.submit(calls.pid, (), timeout_s=limit(30)).result(limit(60))
    pool.submit(calls.tower, (), timeout_s=limit(600))
    waiting = pool.submit(calls.add, (1, 2), timeout_s=limit(30))
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        waiting.result(limit(30))
    wait_until(lambda: not alive(worker), limit(30), "the hung worker to be ended")
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(calls.add, (1, 2), timeout_s=1.0)


def _owner(ready) -> None:
    pool = WorkerPool(1, name="orphan-test", preload=PRELOAD)
    ready.put(pool.submit(calls.pid, (), timeout_s=limit(60)).result(limit(120)))
    pool.submit(calls.tower, (), timeout_s=limit(600))
    time.sleep(limit(600))


def test_workers_die_with_the_process_that_owns_them_even_on_kill_9():
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    owner = ctx.Process(target=_owner, args=(ready,))
    owner.start()
    try:
        worker = ready.get(timeout=limit(120))
        time.sleep(0.5)  # its hung call has started
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(limit(30))
        wait_until(lambda: not alive(worker), limit(30), "the orphaned worker to die")
        assert not alive(worker) and owner.exitcode == -signal.SIGKILL
    finally:
        if owner.is_alive():
            owner.kill()
