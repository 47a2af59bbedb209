"""The body of the processes of the weight-channel test, in a module that imports little (spawned processes
import it, and stay quick to start)."""

from __future__ import annotations

import os
import time

import torch

from tests.timing import limit


def channel_member(rank: int, port: int, results) -> None:
    """Three processes; rank 0 opens a weight channel (3 s timeout) to each of the others, as rank 0 of a run
    does to its agents. Peer 1 exits after one good broadcast, peer 2 hangs (alive, never joins another one).
    Rank 0 then broadcasts on each channel and reports what happened and how long it took."""
    from asyncrl.rpc.channels import WeightChannel
    from asyncrl.rpc.store import RunStore
    torch.set_num_threads(1)
    store = RunStore("127.0.0.1", port, serve=rank == 0, timeout_s=limit(30))
    device = torch.device("cpu")
    if rank == 0:
        channels = {peer: WeightChannel(store.raw, f"peer{peer}", 0, backend="gloo", device=device, timeout_s=3)
                    for peer in (1, 2)}
    else:
        mine = WeightChannel(store.raw, f"peer{rank}", 1, backend="gloo", device=device, timeout_s=3)
    if rank == 0:
        for peer in (1, 2):  # both channels work while everyone is there
            channels[peer].broadcast(torch.ones(8))
    else:
        mine.broadcast(torch.zeros(8))
        if rank == 1:
            os._exit(0)  # gone without a word
        time.sleep(limit(120))  # alive but silent: only the channel's timeout can end the wait
        os._exit(0)
    time.sleep(0.5)
    for case, peer in (("gone peer, sending", 1), ("hung peer, sending", 2)):
        start = time.monotonic()
        try:
            for _ in range(50):  # a sender may need a few rounds before the broken connection shows
                channels[peer].broadcast(torch.ones(1 << 16))
            results.put((case, "returned", time.monotonic() - start, ""))
        except Exception as err:  # noqa: BLE001 - reported to the test
            results.put((case, "raised", time.monotonic() - start, repr(err)[:300]))
    results.close()
    results.join_thread()  # flush the queue's feeder thread: os._exit would drop the results
    os._exit(0)
