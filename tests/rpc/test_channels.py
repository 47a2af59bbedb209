"""Weight buckets (asyncrl.rpc.channels): about equal sizes within each dtype run, none above the cap unless a
single tensor is, and a flatten / unflatten round trip that restores every named tensor exactly. Which backend
a channel takes, the CUDA IPC handle as plain data, and a CUDA IPC channel's fallback to gloo (the CUDA path
itself: tests/rpc/test_channels_cuda.py)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from asyncrl.rpc.channels import buffers_on_gpu, channel_backend, flatten, layout_of, make_buckets, unflatten
from asyncrl.rpc.ipc import IpcHandle
from tests.rpc.collective import run_ipc_pair


def named(sizes, dtypes=None):
    dtypes = dtypes or [torch.float32] * len(sizes)
    return [(f"w{i}", torch.arange(n, dtype=torch.float64).to(d)) for i, (n, d) in enumerate(zip(sizes, dtypes))]


def nbytes(bucket):
    return sum(t.numel() * t.element_size() for _, t in bucket)


def test_a_model_just_above_two_caps_makes_three_equal_buckets_not_two_and_a_sliver():
    # 540 MB of 1 MB tensors with a 256 MB cap: 180 + 180 + 180, not 256 + 256 + 28 (a small last bucket is
    # allocated from a thread's heap on the receiver and was seen to grow its memory at every publication)
    weights = named([2**18] * 540)  # 540 tensors of 1 MiB
    buckets = make_buckets(weights, 256 * 2**20)
    assert [nbytes(b) // 2**20 for b in buckets] == [180, 180, 180]


@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=40), cap=st.integers(1_000, 40_000),
       split=st.integers(0, 40))
def test_buckets_keep_order_and_dtype_runs_and_respect_the_cap(sizes, cap, split):
    dtypes = [torch.float32 if i < split else torch.bfloat16 for i in range(len(sizes))]
    weights = named(sizes, dtypes)
    buckets = make_buckets(weights, cap)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in weights]  # every tensor once, in order
    for b in buckets:
        assert len({t.dtype for _, t in b}) == 1
        # a bucket holds at most a target (≤ the cap) plus one tensor, plus a tail of under half a target
        assert nbytes(b) <= 1.5 * cap + max(t.numel() * t.element_size() for _, t in b)
    for dtype in (torch.float32, torch.bfloat16):
        run = [b for b in buckets if b[0][1].dtype == dtype]
        total = sum(nbytes(b) for b in run)
        target = -(-total // max(1, -(-total // cap)))
        if len(run) > 1 and max(t.numel() * t.element_size() for b in run for _, t in b) <= target // 4:
            # small tensors: the buckets are balanced, none a sliver
            assert min(nbytes(b) for b in run) >= target // 2, [nbytes(b) for b in run]


def test_flatten_unflatten_round_trip():
    weights = [("a", torch.randn(3, 4)), ("b", torch.randn(5)), ("c", torch.randn(2, 2, 2))]
    (bucket,) = make_buckets(weights, 2**20)
    flat = flatten(bucket, torch.device("cpu"))
    (layout,) = layout_of([bucket])
    back = dict(unflatten(flat.clone(), layout))
    for name, t in weights:
        assert torch.equal(back[name], t)


# ------------------------------------------------------------------------------ backend selection, CUDA IPC
@pytest.mark.parametrize("sender, receiver, same_host, backend", [
    ("cuda:0", "cuda:0", True, "cuda_ipc"),   # one GPU of one host: NCCL cannot pair a device with itself
    ("cuda:0", "cuda:1", True, "nccl"),
    ("cuda:0", "cuda:0", False, "nccl"),      # the same number on two hosts: two GPUs
    ("cuda:0", "cpu", True, "gloo"),
    ("cpu", "cuda:0", True, "gloo"),
    ("cpu", "cpu", True, "gloo"),
])
def test_channel_backend_picks_cuda_ipc_for_one_gpu_of_one_host(sender, receiver, same_host, backend):
    assert channel_backend(sender, receiver, same_host=same_host) == backend
    assert buffers_on_gpu(backend) == (backend != "gloo")


def handles():
    raw = st.binary(max_size=80)
    count = st.integers(0, 2**62)
    return st.builds(IpcHandle, device=st.integers(0, 15), handle=raw, size_bytes=count, offset_bytes=count,
                     ref_counter_handle=raw, ref_counter_offset=count, event_handle=raw,
                     event_sync_required=st.booleans(), gpu=st.text(max_size=40))


@given(handle=handles())
def test_an_ipc_handle_crosses_as_plain_json_and_comes_back_equal(handle):
    data = handle.to_bytes()
    assert isinstance(json.loads(data), dict)  # ints, booleans and strings: nothing to unpickle
    assert IpcHandle.from_bytes(data) == handle
    assert handle.storage_args(3) == (3, handle.handle, handle.size_bytes, handle.offset_bytes,
                                      handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
                                      handle.event_sync_required)


def test_an_ipc_handle_built_from_share_cuda_fields_keeps_their_order():
    # the eight fields of UntypedStorage._share_cuda_(), in its order, then the GPU's UUID
    fields = (0, b"\x01" * 64, 1 << 20, 4096, b"/torch_1234_5678_0", 7, b"\x02" * 64, True)
    handle = IpcHandle(*fields, gpu="GPU-0000")
    assert handle.storage_args(0) == fields


@pytest.mark.parametrize("data, what", [
    (b"\x80\x04K\x01.", "not a CUDA IPC handle message"),                       # a pickle is refused, not loaded
    (b"[1, 2]", "not a CUDA IPC handle message"),
    (b'{"device": 0}', "not a CUDA IPC handle message"),
])
def test_anything_but_a_handle_message_is_refused(data, what):
    with pytest.raises(ValueError, match=what):
        IpcHandle.from_bytes(data)


@pytest.mark.parametrize("field, value, what", [
    ("handle", "zz", "not a hex string"), ("handle", 5, "not a hex string"),
    ("size_bytes", -1, "non-negative int"), ("size_bytes", 1.5, "non-negative int"),
    ("size_bytes", True, "non-negative int"), ("event_sync_required", 1, "is not a bool"),
    ("gpu", 3, "is not a str"),
])
def test_a_handle_message_with_a_field_of_the_wrong_type_is_refused(field, value, what):
    message = json.loads(IpcHandle(0, b"h", 8, 0, b"r", 0, b"e", False, "GPU-0").to_bytes())
    message[field] = value
    with pytest.raises(ValueError, match=what):
        IpcHandle.from_bytes(json.dumps(message).encode())


@pytest.mark.e2e
def test_a_cuda_ipc_channel_that_cannot_map_the_buffer_falls_back_to_gloo_on_both_ends():
    """On CPU no buffer can be shared: both ends settle on gloo when they connect, rank 0 logs why once, and
    two publications of mixed-dtype buckets arrive bitwise equal."""
    outcomes = run_ipc_pair("cpu")
    for rank in (0, 1):
        backend, equal, staged, warnings = outcomes[rank]
        assert backend == "gloo" and all(equal) and len(equal) == 6, outcomes[rank]
        assert staged == []
    assert len(outcomes[0][3]) == 1 and "CUDA IPC" in outcomes[0][3][0] and "gloo" in outcomes[0][3][0]
    assert outcomes[1][3] == []  # the agent does not repeat it
