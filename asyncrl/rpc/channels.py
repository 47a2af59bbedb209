"""Weight channels: how the full weights travel from rank 0 to one agent.

Each agent incarnation gets its own two-member process group {rank 0 = 0, agent = 1} (NCCL between two GPUs,
gloo otherwise), made over a fresh prefix of the run's store. When both ends are the same GPU of one host the
channel is "cuda_ipc": its gloo group carries only the lockstep, the weights go through a staging buffer on
that GPU which the agent maps (`asyncrl.rpc.ipc`); where the mapping fails, the channel falls back to gloo.
A channel is not part of any default process group, so agents can join and leave while the run goes on, and a
dead or hung agent breaks only its own channel: a collective on it raises at once when the peer is gone, and
after the channel's timeout when it hangs.

The weights go as flat buckets (one tensor per dtype run, at most `bucket_bytes` each); a `Layout` tells the
receiver how to cut each bucket back into named tensors.
"""

from __future__ import annotations

import datetime
import logging
from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.rpc.ipc import IpcReceiver, IpcSender, open_staging

__all__ = ["WeightChannel", "Layout", "make_buckets", "flatten", "layout_of", "unflatten", "numel", "channel_backend",
           "buffers_on_gpu"]

log = logging.getLogger(__name__)

Layout = list[list[tuple[str, tuple, str]]]
"""Per bucket, (name, shape, dtype name) of each tensor in it, in order."""


def channel_backend(sender_device: str, receiver_device: str, *, same_host: bool = True) -> str:
    """NCCL between two GPUs; CUDA IPC when both ends are the same GPU of one machine (NCCL cannot join two
    ranks on one device); gloo (through host memory) when either end is a CPU."""
    both_gpus = sender_device.startswith("cuda") and receiver_device.startswith("cuda")
    if not both_gpus:
        return "gloo"
    return "cuda_ipc" if same_host and sender_device == receiver_device else "nccl"


def buffers_on_gpu(backend: str) -> bool:
    """Whether a channel of this backend sends and receives buckets held on the GPU (else in host memory)."""
    return backend in ("nccl", "cuda_ipc")


class WeightChannel:
    """One end of a two-member process group for weights: rank 0 (sender) or the agent (receiver). Both ends
    are built at the same time (they connect); `backend` then says what the channel carries the weights over
    ("cuda_ipc" asked for becomes "gloo" where the GPU buffer could not be mapped)."""

    def __init__(self, store: dist.Store, name: str, rank: int, *, backend: str, device: torch.device,
                 timeout_s: float):
        self.name, self.rank, self.backend, self.device = name, rank, backend, device
        prefix = dist.PrefixStore(f"asyncrl/channel/{name}", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            from torch.distributed.distributed_c10d import ProcessGroupNCCL
            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            torch.cuda.set_device(device)
            self.group = ProcessGroupNCCL(prefix, rank, 2, options)
        else:
            self.group = dist.ProcessGroupGloo(prefix, rank, 2, timeout)  # connects: both ends call it together
        self.staging = None
        if backend == "cuda_ipc":
            self.staging, why = open_staging(self.group, rank, device)
            if self.staging is None:
                self.backend = "gloo"
                if rank == 0:
                    log.warning("weight channel to %s: CUDA IPC on %s is not available (%s); its weights go over "
                                "gloo through host memory", name, device, why)
        self.closed = False

    def broadcast(self, flat: Tensor) -> None:
        """Rank 0 sends `flat`; the agent receives into it (same numel and dtype on both ends)."""
        if self.closed:
            raise RuntimeError(f"weight channel to {self.name} is closed")
        if flat.is_cuda:
            torch.cuda.set_device(flat.device)  # the current device is per thread
        if isinstance(self.staging, IpcSender):
            self.staging.send(flat)
            return
        if isinstance(self.staging, IpcReceiver):
            self.staging.receive(flat)
            return
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([flat], options).wait()
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()

    def abort(self) -> None:
        """End the channel: later broadcasts raise (a pending gloo one still ends on its timeout). Rank 0 frees
        its staging buffer; the agent keeps its mapping until its process ends."""
        if self.closed:
            return
        self.closed = True
        try:
            self.group.abort()
        except Exception as err:  # noqa: BLE001 - the channel is discarded either way
            log.debug("abort of the weight channel to %s: %r", self.name, err)
        if isinstance(self.staging, IpcSender):
            try:
                self.staging.close()
            except Exception as err:  # noqa: BLE001 - at worst one buffer stays allocated
                log.warning("weight channel to %s: could not free its staging buffer: %r", self.name, err)


def make_buckets(weights: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """Consecutive tensors of one dtype in buckets of about equal size, about `bucket_bytes` at most (a larger
    tensor goes alone; a bucket takes in what is left rather than leave a sliver, up to 1.5 times the size). Equal sizes matter for the receiver's memory: a small last bucket would be allocated
    from the heap of whichever RPC thread receives it, and such allocations, made by a different thread each
    version, were seen to grow an agent's resident memory by the bucket's size at every publication; buckets
    above the allocator's mmap threshold (32 MB) are returned to the system when freed."""
    runs: list[list[tuple[str, Tensor]]] = []
    for name, t in weights:
        if not runs or t.dtype != runs[-1][0][1].dtype:
            runs.append([])
        runs[-1].append((name, t))
    buckets: list[list[tuple[str, Tensor]]] = []
    for run in runs:
        sizes = [t.numel() * t.element_size() for _, t in run]
        total = sum(sizes)
        target = -(-total // max(1, -(-total // bucket_bytes)))  # about equal buckets, none above the cap
        bucket, size, left = [], 0, total
        for (name, t), nbytes in zip(run, sizes):
            # close the bucket at the target, unless what is left would make a sliver (< half a target)
            if bucket and size + nbytes > target and left >= target // 2:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append((name, t))
            size += nbytes
            left -= nbytes
        buckets.append(bucket)
    return buckets


def flatten(bucket: list[tuple[str, Tensor]], device: torch.device) -> Tensor:
    return torch.cat([t.reshape(-1).to(device) for _, t in bucket])


def layout_of(buckets: list[list[tuple[str, Tensor]]]) -> Layout:
    return [[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in b] for b in buckets]


def numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def unflatten(flat: Tensor, bucket: list[tuple[str, tuple, str]]) -> list[tuple[str, Tensor]]:
    out, offset = [], 0
    for name, shape, _ in bucket:
        n = numel(shape)
        out.append((name, flat[offset:offset + n].view(shape)))
        offset += n
    return out
