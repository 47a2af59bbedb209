"""The body of the processes of the collective-timeout test, in a module that imports only torch (spawned
processes import it, and stay quick to start)."""

from __future__ import annotations

import datetime
import os
import time

import torch


def gloo_member(rank: int, port: int, results) -> None:
    """Three ranks; rank 0 shares a two-member group with each other rank, as the launcher's weight groups do
    (3 s timeout). Rank 1 exits after one good collective, rank 2 hangs (alive, never joins another one).
    Rank 0 then broadcasts on each group and reports what happened and how long it took."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=30))
    timeout = datetime.timedelta(seconds=3)
    groups = {1: dist.new_group([0, 1], timeout=timeout), 2: dist.new_group([0, 2], timeout=timeout)}
    for peer, group in groups.items():  # both groups work while everyone is there
        if rank in (0, peer):
            dist.broadcast(torch.zeros(8), src=0, group=group)
    if rank == 1:
        os._exit(0)  # gone without a word
    if rank == 2:
        time.sleep(120)  # alive but silent: only the group's timeout can end the wait
        os._exit(0)
    time.sleep(0.5)
    for case, peer, src in (("gone peer, receiving", 1, 1), ("gone peer, sending", 1, 0),
                            ("hung peer, receiving", 2, 2)):
        start = time.monotonic()
        try:
            for _ in range(50):  # a sender may need a few rounds before the broken connection shows
                dist.broadcast(torch.ones(1 << 16), src=src, group=groups[peer])
            results.put((case, "returned", time.monotonic() - start, ""))
        except Exception as err:  # noqa: BLE001 - reported to the test
            results.put((case, "raised", time.monotonic() - start, repr(err)[:300]))
    results.close()
    results.join_thread()  # flush the queue's feeder thread: os._exit would drop the results
    os._exit(0)
