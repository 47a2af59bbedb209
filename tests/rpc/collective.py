"""The body of the processes of the weight-channel test, in a module that imports little (spawned processes
import it, and stay quick to start)."""

from __future__ import annotations

import os
import time

import torch

from tests.run_helpers import free_ports
from tests.timing import limit


def channel_member(rank: int, port: int, results, backend: str = "gloo", device: str = "cpu") -> None:
    """Three processes; rank 0 opens a weight channel (3 s timeout) to each of the others, as rank 0 of a run
    does to its agents. Peer 1 exits after one good broadcast, peer 2 hangs (alive, never joins another one).
    Rank 0 then broadcasts on each channel and reports what happened and how long it took."""
    from asyncrl.rpc.channels import WeightChannel
    from asyncrl.rpc.store import RunStore
    torch.set_num_threads(1)
    store = RunStore("127.0.0.1", port, serve=rank == 0, timeout_s=limit(30))
    device = torch.device(device)
    if rank == 0:
        channels = {peer: WeightChannel(store.raw, f"peer{peer}", 0, backend=backend, device=device, timeout_s=3)
                    for peer in (1, 2)}
    else:
        mine = WeightChannel(store.raw, f"peer{rank}", 1, backend=backend, device=device, timeout_s=3)
    if rank == 0:
        for peer in (1, 2):  # both channels work while everyone is there
            channels[peer].broadcast(torch.ones(8, device=device))
    else:
        mine.broadcast(torch.zeros(8, device=device))
        if rank == 1:
            os._exit(0)  # gone without a word
        time.sleep(limit(120))  # alive but silent: only the channel's timeout can end the wait
        os._exit(0)
    time.sleep(0.5)
    for case, peer in (("gone peer, sending", 1), ("hung peer, sending", 2)):
        start = time.monotonic()
        try:
            for _ in range(50):  # a sender may need a few rounds before the broken connection shows
                channels[peer].broadcast(torch.ones(1 << 16, device=device))
            results.put((case, "returned", time.monotonic() - start, ""))
        except Exception as err:  # noqa: BLE001 - reported to the test
            results.put((case, "raised", time.monotonic() - start, repr(err)[:300]))
    results.close()
    results.join_thread()  # flush the queue's feeder thread: os._exit would drop the results
    os._exit(0)


PUBLICATIONS = [[(torch.bfloat16, 3000), (torch.bfloat16, 70_000), (torch.float32, 20_000)],
                [(torch.bfloat16, 3000), (torch.bfloat16, 70_000), (torch.float32, 20_000)]]
"""Two publications of three buckets (dtype, numel) each: the second bucket is the largest (140,000 bytes)."""


def bucket_values(publication: int, bucket: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The weights of one bucket of one publication: random, different in every publication."""
    gen = torch.Generator().manual_seed(1000 * publication + bucket)
    return torch.randn(numel, generator=gen).to(dtype)


def ipc_member(rank: int, port: int, device: str, results) -> None:
    """Rank 0 and one agent on `device`, a channel asked to be "cuda_ipc" between them; rank 0 sends
    PUBLICATIONS bucket by bucket, the agent receives each into a fresh tensor on its device (as
    `AgentServer.receive` does) and reports whether every bucket equals the expected bytes."""
    import logging

    from asyncrl.rpc.channels import WeightChannel
    from asyncrl.rpc.store import RunStore
    torch.set_num_threads(1)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    handler.setLevel(logging.WARNING)
    logging.getLogger("asyncrl.rpc.channels").addHandler(handler)
    store = RunStore("127.0.0.1", port, serve=rank == 0, timeout_s=limit(30))
    channel = WeightChannel(store.raw, "agent", rank, backend="cuda_ipc", device=torch.device(device),
                            timeout_s=limit(30))
    equal, staged = [], []
    for p, publication in enumerate(PUBLICATIONS):
        for b, (dtype, numel) in enumerate(publication):
            expected = bucket_values(p, b, dtype, numel).to(device)
            flat = expected.clone() if rank == 0 else torch.empty(numel, dtype=dtype, device=device)
            channel.broadcast(flat)
            equal.append(torch.equal(flat.view(torch.uint8), expected.view(torch.uint8)))
            if rank == 0 and channel.staging is not None:
                staged.append(channel.staging.buffer.numel())
    channel.group.barrier().wait()  # the agent has everything: rank 0 may end the channel (frees its buffer)
    if rank == 0:
        channel.abort()
    results.put((rank, channel.backend, equal, staged, warnings))
    results.close()
    results.join_thread()
    os._exit(0)


def run_ipc_pair(device: str) -> dict:
    """Run `ipc_member` in two spawned processes; {rank: (backend, equal per bucket, staging sizes, warnings)}."""
    port = free_ports()
    reports = _run_members(ipc_member, [(rank, port, device) for rank in (0, 1)], expected=2, join_s=limit(10),
                           silent="the channel's ends did not report in time")
    return {rank: tuple(outcome) for rank, *outcome in reports}


def run_channel_drill(backend: str = "gloo", device: str = "cpu") -> dict:
    """Run `channel_member` in three spawned processes; {case: (outcome, seconds, detail)} of rank 0's
    broadcasts to the gone peer and to the hung one."""
    port = free_ports()
    reports = _run_members(channel_member, [(r, port) for r in range(3)], expected=2, join_s=2,
                           silent="rank 0 neither raised nor returned in time (a broadcast hung)", extra=(backend, device))
    return {case: (outcome, seconds, detail) for case, outcome, seconds, detail in reports}


def _run_members(target, member_args: list[tuple], *, expected: int, join_s: float, silent: str,
                 extra: tuple = ()) -> list[tuple]:
    """Start `target(*args, results, *extra)` per member in spawned processes; the first `expected` reports they
    put on the results queue (AssertionError naming `silent` if they do not come in time); every process ends."""
    import multiprocessing
    import queue
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, results, *extra), daemon=True) for args in member_args]
    for p in procs:
        p.start()
    reports: list[tuple] = []
    try:
        deadline = time.monotonic() + limit(120)
        while len(reports) < expected:
            try:
                reports.append(tuple(results.get(timeout=max(deadline - time.monotonic(), 0.1))))
            except queue.Empty:
                raise AssertionError(f"{silent}; got {reports}") from None
    finally:
        for p in procs:
            p.join(join_s)
            if p.is_alive():
                p.kill()
                p.join(5)
    return reports
