"""The weight channel between two processes on one GPU (CUDA IPC through rank 0's staging buffer): every bucket
arrives bitwise equal, a second publication with other weights arrives too, the buffer grows only for a larger
bucket, and a gone or hung agent breaks its channel as over gloo. Needs a CUDA device (skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.rpc.ipc import PROBE_BYTES
from tests.rpc.collective import PUBLICATIONS, run_channel_drill, run_ipc_pair
from tests.timing import limit

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(limit(300)), pytest.mark.e2e]  # each test spawns the channel's two members


def test_two_publications_through_cuda_ipc_on_one_gpu_arrive_bitwise_equal():
    outcomes = run_ipc_pair("cuda:0")
    sizes = [numel * torch.empty(0, dtype=dtype).element_size() for publication in PUBLICATIONS
             for dtype, numel in publication]
    for rank in (0, 1):
        backend, equal, _, warnings = outcomes[rank]
        assert backend == "cuda_ipc" and warnings == [], outcomes[rank]
        assert equal == [True] * len(sizes), outcomes[rank]
    # rank 0's staging buffer after each bucket: it grows only when a larger bucket comes, to that bucket's size
    expected, largest = [], PROBE_BYTES
    for nbytes in sizes:
        largest = max(largest, nbytes)
        expected.append(largest)
    assert outcomes[0][2] == expected


def test_a_cuda_ipc_channel_with_a_gone_or_hung_peer_raises_instead_of_hanging():
    outcomes = run_channel_drill("cuda_ipc", "cuda:0")
    for case, (outcome, seconds, detail) in outcomes.items():
        assert outcome == "raised" and seconds < limit(10), (case, outcome, seconds, detail)
    assert 2.0 <= outcomes["hung peer, sending"][1], outcomes  # on the channel's own timeout (3 s)
