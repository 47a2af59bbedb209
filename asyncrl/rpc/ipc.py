"""Same-GPU weight channels: a staging buffer on rank 0's GPU that the agent maps through CUDA IPC.

Two processes on one GPU cannot form an NCCL group, and gloo takes the weights through host memory (about
1 GB/s). Here rank 0 owns one GPU buffer the size of the largest bucket so far; the agent opens it once
(`cudaIpcOpenMemHandle`, through torch's `_share_cuda_` / `_new_shared_cuda`) and keeps it mapped. Per bucket:

    rank 0: copy the bucket into the buffer, synchronize ─ header [bytes, handle length] (+ a new handle) ─▶
    agent:  (map the new buffer), copy the bytes out into its own tensor, synchronize ─ ack ─▶ rank 0

The header and the ack travel over the channel's two-member gloo group, so a dead agent breaks the channel at
once and a hung one after the channel's timeout, exactly as when the weights themselves went over gloo. The
handle crosses as plain data (JSON: ints and hex strings, `IpcHandle.to_bytes`), never pickled.

Reference counts: torch counts every share of a buffer once, and the receiver's mapping gives the count back
when it is freed. The agent frees a mapping when rank 0 replaces the buffer by a larger one; when the channel
ends, rank 0 gives back the agent's count of the current buffer itself (`IpcSender.close`), since a dead
agent never will (agents end with `os._exit`).
"""

from __future__ import annotations

import dataclasses
import json

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["IpcHandle", "IpcSender", "IpcReceiver", "gpu_id", "exchange_bytes", "open_staging"]

PROBE_BYTES = 4096
"""The buffer offered when the channel connects: the agent checks it reads rank 0's bytes before any weights."""

_ACK_OK, _ACK_SIZE, _ACK_OPEN = 1, 2, 3
_ACK_TEXT = {_ACK_SIZE: "its buffer for this bucket has a different size (the layouts differ)",
             _ACK_OPEN: "it could not map rank 0's new staging buffer through CUDA IPC"}


@dataclasses.dataclass(frozen=True)
class IpcHandle:
    """What `UntypedStorage._share_cuda_` returns for one GPU buffer (its eight fields, in its order), plus the
    GPU's UUID, so that the receiver can tell it sits on the very same GPU (device numbers differ between
    processes that see different CUDA_VISIBLE_DEVICES)."""

    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    gpu: str

    def to_bytes(self) -> bytes:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json.dumps({k: v.hex() if isinstance(v, bytes) else v for k, v in fields.items()}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcHandle:
        """Parse `to_bytes`' output; anything else raises ValueError naming what is wrong."""
        try:
            raw = json.loads(data.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"not a CUDA IPC handle message: {err}") from None
        if not isinstance(raw, dict) or set(raw) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"not a CUDA IPC handle message: fields {sorted(raw) if isinstance(raw, dict) else raw!r}")
        values = {}
        for f in dataclasses.fields(cls):
            values[f.name] = _field(f.name, f.type, raw[f.name])
        return cls(**values)

    def storage_args(self, device: int) -> tuple:
        """The arguments of `UntypedStorage._new_shared_cuda`, the buffer mapped on `device` (the receiver's
        number for the same GPU)."""
        return (device, self.handle, self.size_bytes, self.offset_bytes, self.ref_counter_handle,
                self.ref_counter_offset, self.event_handle, self.event_sync_required)


def _field(name: str, kind: str, value):
    """One field of a handle message, checked against its declared type (bytes travel as hex strings)."""
    if kind == "bytes":
        try:
            return bytes.fromhex(value)
        except (TypeError, ValueError):
            raise ValueError(f"CUDA IPC handle: {name}={value!r} is not a hex string") from None
    if kind == "int" and (type(value) is not int or value < 0):
        raise ValueError(f"CUDA IPC handle: {name}={value!r} is not a non-negative int")
    if {"bool": bool, "str": str}.get(kind, type(value)) is not type(value):
        raise ValueError(f"CUDA IPC handle: {name}={value!r} is not a {kind}")
    return value


def gpu_id(device: torch.device) -> str:
    """The GPU's UUID: the same in every process that sees it, whatever its number there."""
    return str(torch.cuda.get_device_properties(device).uuid)


def share(buffer: Tensor) -> IpcHandle:
    """Share the GPU storage of `buffer` (a whole allocation of its own): one reference for one receiver."""
    fields = buffer.untyped_storage()._share_cuda_()
    return IpcHandle(*fields, gpu=gpu_id(buffer.device))


def open_shared(handle: IpcHandle, device: torch.device) -> Tensor:
    """Map the buffer `handle` names on `device` (which must be the same GPU) as a flat uint8 tensor."""
    if handle.gpu != gpu_id(device):
        raise RuntimeError(f"the staging buffer is on GPU {handle.gpu}, this process's {device} is {gpu_id(device)}")
    torch.cuda._lazy_init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(*handle.storage_args(index))
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def release(handle: IpcHandle) -> None:
    """Give back the receiver's reference to a shared buffer (what its mapping does when freed)."""
    torch.UntypedStorage._release_ipc_counter_cuda(handle.ref_counter_handle, handle.ref_counter_offset)


def exchange_bytes(group: dist.ProcessGroup, root: int, data: bytes | None) -> bytes:
    """Broadcast a byte string from `root` (which passes it; the other end passes None) over a CPU group."""
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    _broadcast(group, length, root)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(int(length[0]), dtype=torch.uint8)
    if len(payload):
        _broadcast(group, payload, root)
    return payload.numpy().tobytes()


def _broadcast(group: dist.ProcessGroup, tensor: Tensor, root: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()


def _as_bytes(flat: Tensor) -> Tensor:
    return flat.reshape(-1).view(torch.uint8)


def _synchronize(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


class IpcSender:
    """Rank 0's end: the staging buffer and the handle of its latest share."""

    def __init__(self, group: dist.ProcessGroup, buffer: Tensor, handle: IpcHandle):
        self.group, self.buffer, self.handle = group, buffer, handle

    def send(self, flat: Tensor) -> None:
        """Stage `flat` (on this GPU, or in host memory) for the agent; return once the agent has copied it out."""
        nbytes = flat.numel() * flat.element_size()
        offer = b""
        if nbytes > self.buffer.numel():  # a larger bucket: a larger buffer, shared anew (the agent frees the old)
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.buffer.device)
            self.handle = share(self.buffer)
            offer = self.handle.to_bytes()
        self.buffer[:nbytes].copy_(_as_bytes(flat))
        _synchronize(self.buffer.device)
        _broadcast(self.group, torch.tensor([nbytes, len(offer)], dtype=torch.int64), 0)
        if offer:
            exchange_bytes(self.group, 0, offer)
        ack = torch.zeros(1, dtype=torch.int64)
        _broadcast(self.group, ack, 1)
        if offer:
            torch.cuda.ipc_collect()  # the old buffer, once the agent has let go of it
        if int(ack[0]) != _ACK_OK:
            raise RuntimeError(f"the agent refused a bucket of {nbytes} bytes: "
                               f"{_ACK_TEXT.get(int(ack[0]), f'ack {int(ack[0])}')}")

    def close(self) -> None:
        """The channel ended: give back the agent's reference (it may be dead) and free the buffer."""
        handle, self.handle, self.buffer = self.handle, None, None
        if handle is not None:
            release(handle)
            torch.cuda.ipc_collect()


class IpcReceiver:
    """The agent's end: the mapping of rank 0's current staging buffer."""

    def __init__(self, group: dist.ProcessGroup, view: Tensor, device: torch.device):
        self.group, self.view, self.device = group, view, device

    def receive(self, flat: Tensor) -> None:
        """Copy the staged bucket into `flat` (on this GPU, the bucket's numel and dtype)."""
        header = torch.zeros(2, dtype=torch.int64)
        _broadcast(self.group, header, 0)
        nbytes, offer_len = int(header[0]), int(header[1])
        status, why = _ACK_OK, ""
        if offer_len:
            offer = exchange_bytes(self.group, 0, None)
            self.view = None  # frees the old mapping: rank 0's old buffer may go
            try:
                self.view = open_shared(IpcHandle.from_bytes(offer), self.device)
            except Exception as err:  # noqa: BLE001 - told to rank 0, then raised here
                status, why = _ACK_OPEN, repr(err)
        if status == _ACK_OK and nbytes != flat.numel() * flat.element_size():
            status, why = _ACK_SIZE, f"{nbytes} bytes staged for a bucket of {flat.numel() * flat.element_size()}"
        if status == _ACK_OK:
            _as_bytes(flat).copy_(self.view[:nbytes])
            _synchronize(self.device)
        _broadcast(self.group, torch.tensor([status], dtype=torch.int64), 1)
        if status != _ACK_OK:
            raise RuntimeError(f"CUDA IPC weight channel: {_ACK_TEXT[status]} ({why})")


def open_staging(group: dist.ProcessGroup, rank: int,
                 device: torch.device) -> tuple[IpcSender | IpcReceiver | None, str]:
    """Both ends, when the channel connects: rank 0 offers a small staging buffer, the agent maps it and checks
    it reads rank 0's bytes. Returns this end of the IPC path, or (None, why) on both ends when either end
    could not (the channel then carries the weights over gloo)."""
    pattern = (torch.arange(PROBE_BYTES) % 251).to(torch.uint8)
    return _offer(group, device, pattern) if rank == 0 else _accept(group, device, pattern)


def _offer(group: dist.ProcessGroup, device: torch.device, pattern: Tensor) -> tuple[IpcSender | None, str]:
    buffer = handle = None
    try:
        buffer = pattern.to(device)
        _synchronize(device)
        handle = share(buffer)
        offer, failure = handle.to_bytes(), ""
    except Exception as err:  # noqa: BLE001 - the channel falls back to gloo
        offer, failure = b"", f"rank 0 could not share a GPU buffer: {err!r}"
    exchange_bytes(group, 0, offer)
    answer = exchange_bytes(group, 1, None).decode()
    if failure or answer:
        # an agent that mapped the buffer gave its reference back when it dropped the mapping; one that could
        # not map it leaves this probe's few bytes in torch's limbo of shared blocks
        return None, failure or answer
    return IpcSender(group, buffer, handle), ""


def _accept(group: dist.ProcessGroup, device: torch.device, pattern: Tensor) -> tuple[IpcReceiver | None, str]:
    offer = exchange_bytes(group, 0, None)
    view, failure = None, "" if offer else "rank 0 could not share a GPU buffer"
    if offer:
        try:
            view = open_shared(IpcHandle.from_bytes(offer), device)
            if not torch.equal(view[:PROBE_BYTES].cpu(), pattern):
                failure = "the agent mapped rank 0's buffer but read other bytes"
        except Exception as err:  # noqa: BLE001 - the channel falls back to gloo
            failure = f"the agent could not map rank 0's GPU buffer: {err!r}"
    exchange_bytes(group, 1, failure.encode())
    return (IpcReceiver(group, view, device), "") if not failure else (None, failure)
