"""Where a publication's flat buckets come from, per channel backend (`source_flats`): NCCL and CUDA IPC from the
trainer's GPU, gloo from host memory; CUDA IPC from host memory when the GPU has no room for a copy of the
weights (NCCL then fails: it can only send from the GPU). The GPU is played by a flatten that records where it
was asked to copy to, and runs out of memory on demand."""

from __future__ import annotations

import logging

import pytest
import torch

import asyncrl.rpc.param_server as param_server
from asyncrl.rpc.channels import flatten, make_buckets
from asyncrl.rpc.param_server import source_flats

GPU = torch.device("cuda:0")
BUCKETS = make_buckets([("a", torch.arange(6.0)), ("b", torch.ones(4, dtype=torch.bfloat16))], 1 << 20)


@pytest.fixture
def fake_gpu(monkeypatch):
    """flatten to GPU: a host tensor tagged "gpu" (or an out-of-memory error when `full` is set)."""
    state = {"full": False}

    def fake(bucket, device):
        if device == GPU:
            if state["full"]:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
            flat = flatten(bucket, torch.device("cpu"))
            flat.placed = "gpu"
            return flat
        return flatten(bucket, device)
    monkeypatch.setattr(param_server, "flatten", fake)
    return state


def where(flats):
    return [getattr(f, "placed", "host") for f in flats]


def test_each_backend_sends_from_its_place(fake_gpu):
    flats = source_flats(BUCKETS, {"nccl", "cuda_ipc", "gloo"}, GPU)
    assert where(flats["nccl"]) == where(flats["cuda_ipc"]) == ["gpu", "gpu"]
    assert flats["nccl"] is flats["cuda_ipc"]  # one copy on the GPU for both
    assert where(flats["gloo"]) == ["host", "host"]
    assert torch.equal(flats["gloo"][0], torch.arange(6.0)) and torch.equal(flats["gloo"][1], torch.ones(4).bfloat16())


def test_cuda_ipc_stages_from_host_memory_when_the_gpu_is_full(fake_gpu, caplog):
    fake_gpu["full"] = True
    with caplog.at_level(logging.WARNING, logger="asyncrl.rpc.param_server"):
        flats = source_flats(BUCKETS, {"cuda_ipc"}, GPU)
    assert where(flats["cuda_ipc"]) == ["host", "host"]
    assert "no room" in caplog.text and "host memory" in caplog.text
    with pytest.raises(torch.cuda.OutOfMemoryError):
        source_flats(BUCKETS, {"nccl", "cuda_ipc"}, GPU)


def test_gloo_alone_makes_no_gpu_copy(fake_gpu):
    flats = source_flats(BUCKETS, {"gloo"}, GPU)
    assert list(flats) == ["gloo"] and where(flats["gloo"]) == ["host", "host"]
