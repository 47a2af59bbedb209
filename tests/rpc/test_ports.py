"""Ports of a run's servers: picked and held by the launcher until the run ends, so runs started together on one
host never share one (two such runs were both given the same port: one failed with EADDRINUSE, the other's
store crashed on the first one's clients)."""

from __future__ import annotations

import datetime
import multiprocessing

import pytest
import torch.distributed as dist

from asyncrl.rpc.roles import free_port, reserve_port
from tests.timing import limit

pytestmark = pytest.mark.e2e


def _serve(port: int, ready, done) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=limit(60)))
    store.set("served", "yes")
    ready.set()
    done.wait(limit(60))


def test_a_reserved_port_is_never_handed_out_and_a_child_can_serve_on_it():
    held = reserve_port()
    port = held.getsockname()[1]
    try:
        assert all(free_port() != port for _ in range(3000)), "another process could be given the held port"
        ctx = multiprocessing.get_context("spawn")
        ready, done = ctx.Event(), ctx.Event()
        server = ctx.Process(target=_serve, args=(port, ready, done))
        server.start()
        try:
            assert ready.wait(limit(60)), "the child could not start its store on the reserved port"
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=limit(30)))
            assert client.get("served") == b"yes"
        finally:
            done.set()
            server.join(limit(30))
        assert server.exitcode == 0
    finally:
        held.close()
