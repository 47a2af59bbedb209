"""The RPC seal (asyncrl/rpc/seal.py): sealed messages open with the run's key and only with it; altered, foreign,
replayed and too old messages are refused before any unpickling; out-of-order delivery within the window is
accepted; the unpickler builds a run's payloads and refuses os.system, eval, imports outside asyncrl/torch/numpy and
attributes other than the RPC pickler's receivers; installed, torch's own RPC serialize/deserialize round-trip a
call with tensors through it and refuse an unsealed message (this fails loudly if torch moves its pickler)."""

from __future__ import annotations

import io
import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.rpc.seal import WINDOW, RpcSeal, SealError, key_check, rpc_key
from asyncrl.types import Completion, Group

KEY = rpc_key("0123456789abcdef0123", "nonce")


def _unpickle(seal: RpcSeal, message: bytes):
    return seal.unpickler()(io.BytesIO(message)).load()


def _pickle(seal: RpcSeal, obj) -> bytes:
    out = io.BytesIO()
    seal.pickler()(out).dump(obj)
    return out.getvalue()


def test_keys_depend_on_token_and_nonce_and_the_check_reveals_neither():
    assert rpc_key("0123456789abcdef0123", "other") != KEY != rpc_key("0123456789abcdef0124", "nonce")
    assert len(KEY) == 32 and key_check(KEY) == key_check(KEY) != key_check(rpc_key("x" * 20, "nonce"))
    assert "0123456789abcdef0123" not in key_check(KEY)


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 299), st.integers(1, 255))
def test_a_sealed_message_opens_with_the_run_key_only_and_any_altered_byte_is_refused(payload, at, flip):
    sender, receiver = RpcSeal(KEY), RpcSeal(KEY)
    message = sender.seal(payload)
    assert receiver.open(message) == payload
    altered = bytearray(sender.seal(payload))
    altered[at % len(altered)] ^= flip
    with pytest.raises(SealError):
        receiver.open(bytes(altered))
    with pytest.raises(SealError, match="does not match this run's key"):
        RpcSeal(rpc_key("another-token-of-16+", "nonce")).open(sender.seal(payload))
    assert receiver.refused == 1


def test_replays_and_too_old_messages_are_refused_and_reordering_within_the_window_is_not():
    sender, receiver = RpcSeal(KEY), RpcSeal(KEY)
    messages = [sender.seal(b"m%d" % i) for i in range(WINDOW + 3)]
    assert receiver.open(messages[2]) == b"m2"
    assert receiver.open(messages[0]) == b"m0"  # late, within the window
    with pytest.raises(SealError, match="replayed"):
        receiver.open(messages[2])
    assert receiver.open(messages[WINDOW + 2]) == b"m%d" % (WINDOW + 2)
    with pytest.raises(SealError, match="replayed"):
        receiver.open(messages[1])  # now older than the window
    assert RpcSeal(KEY).open(messages[2]) == b"m2"  # another receiver has its own window
    with pytest.raises(SealError, match="too short"):
        receiver.open(b"ARL1")


def test_the_unpickler_builds_a_run_s_payloads():
    seal = RpcSeal(KEY)
    group = Group(3, [1, 2], [Completion([5, 6], [-0.5, -0.25], [1, 1], routes=np.zeros((2, 1, 2), np.int16))],
                  [1.0])
    for obj in (group, {"a": (1, 2.5, None, {3}, frozenset({4}))}, ValueError("x"), torch.float32,
                torch.device("cpu"), np.arange(3)):
        again = _unpickle(seal, _pickle(seal, obj))
        assert type(again) is type(obj)
    assert _unpickle(seal, _pickle(seal, group)).completions[0].routes.dtype == np.int16


@pytest.mark.parametrize("payload, named", [
    (b"cposix\nsystem\n(S'echo pwned'\ntR.", "posix.system"),
    (b"cbuiltins\neval\n(S'1 + 1'\ntR.", "builtins.eval"),
    (b"csubprocess\ncall\n(S'true'\ntR.", "subprocess.call"),
    (b"cbuiltins\ngetattr\n(cbuiltins\nobject\nS'__subclasses__'\ntR.", "attribute '__subclasses__'"),
])
def test_the_unpickler_refuses_what_no_message_uses(payload, named):
    seal = RpcSeal(KEY)
    with pytest.raises(SealError, match=named.replace(".", r"\.")):
        _unpickle(seal, seal.seal(payload))


def test_torch_rpc_serialize_and_deserialize_go_through_the_installed_seal(monkeypatch):
    import torch.distributed.rpc.internal as internal

    from asyncrl.rpc.seal import installed_rpc_seal, seal_rpc
    for name in ("_pickler", "_unpickler"):  # put back after the test
        monkeypatch.setattr(internal, name, getattr(internal, name))
    assert not installed_rpc_seal()
    seal = seal_rpc(KEY)
    assert installed_rpc_seal()
    data, tensors = internal.serialize(internal.PythonUDF(rpc_key, (torch.ones(2), torch.zeros(2)), {}))
    assert data[:4] == b"ARL1" and len(tensors) == 2
    again = internal.deserialize(data, tensors)
    assert again.func is rpc_key and torch.equal(again.args[0], torch.ones(2))
    with pytest.raises(SealError, match="does not match this run's key"):
        internal.deserialize(pickle.dumps(internal.PythonUDF(print, ("x",), {})), [])
    assert seal.refused == 1


def test_a_loopback_run_leaves_its_token_in_a_file_only_its_user_reads_and_the_store_holds_the_path(tmp_path):
    import stat

    from asyncrl.rpc.exposure import new_token
    from asyncrl.rpc.roles import free_port
    from asyncrl.rpc.store import RunStore
    store = RunStore("127.0.0.1", free_port(), serve=True, timeout_s=10)
    token = new_token()
    left = store.leave_token(token)
    try:
        assert stat.S_IMODE(left.stat().st_mode) == 0o600
        assert store.left_token().value == token.value
        store_values = store.raw.get("asyncrl/token_file").decode()
        assert token.value not in store_values and store_values == str(left)
        left.chmod(0)  # as another user finds it (root reads anything: skip that half as root)
        if os.geteuid() != 0:
            assert store.left_token() is None
    finally:
        left.unlink()


def test_control_records_count_only_when_signed_with_the_run_token():
    """A stranger who reaches the store (no token) forges a shutdown, a dead report (the launcher would kill the
    pid), a refusal and an exit: a process of the run, authenticated, ignores all of them and reads its own."""
    from asyncrl.rpc.exposure import RunToken
    from asyncrl.rpc.roles import free_port
    from asyncrl.rpc.store import RunStore
    token = RunToken("0123456789abcdef0123")
    port = free_port()
    run = RunStore("127.0.0.1", port, serve=True, timeout_s=10)
    run.authenticate(token)
    stranger = RunStore("127.0.0.1", port, serve=False, timeout_s=10)  # never authenticated: signs nothing
    stranger.shut_down()
    stranger.report_dead("agent0", os.getpid(), "forged")
    stranger.refuse("agent0", "forged")
    stranger.report_exit(os.getpid(), -9)
    stranger.post_trainer_fault(1, "forged", ["cpu", "cpu"])
    stranger.raw.set("asyncrl/dead/1", "not json at all")
    stranger.raw.add("asyncrl/dead/count", 1)
    other_run = RunStore("127.0.0.1", port, serve=False, timeout_s=10)
    other_run.authenticate(RunToken("another-run-token-0000"))
    other_run.report_dead("agent1", 1, "another run's key")
    assert not run.is_shut_down() and run.refusal("agent0") is None
    reports = run.dead_reports(0)
    assert reports == [] and reports.consumed == 3  # the reader moves past what it ignored
    assert run.exits(0) == [] and run.trainer_fault() is None
    run.post_trainer_fault(2, "trainer rank 1 exited with code 9", ["cpu", "cpu"])
    assert run.trainer_fault() == {"generation": 2, "why": "trainer rank 1 exited with code 9",
                                   "trainer_devices": ["cpu", "cpu"]}
    run.report_dead("agent2", 7, "missed heartbeats")
    run.refuse("agent3", "no token")
    later = run.dead_reports(reports.consumed)
    assert later == [{"name": "agent2", "pid": 7, "why": "missed heartbeats"}] and later.consumed == 1
    assert run.refusal("agent3") == "no token"
    run.shut_down()
    assert run.is_shut_down()


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    import resource

    from asyncrl.rpc.membership import raise_open_files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        limit = raise_open_files()
        assert limit == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert limit == hard if hard != resource.RLIM_INFINITY else limit >= 1 << 20
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("module, name", [("torch", "os.system"), ("torch", "os"), ("torch", "load"),
                                          ("torch.hub", "load"), ("numpy", "load"), ("asyncrl.rpc.seal", "pickle"),
                                          ("torch.distributed.rpc.api", "rpc_sync")])
def test_names_reached_through_an_allowed_module_are_refused_by_where_they_live(module, name):
    seal = RpcSeal(KEY)
    with pytest.raises(SealError, match="no message of a run uses"):
        _unpickle(seal, seal.seal(_global(module, name)))


def test_a_remote_error_s_type_and_the_run_s_own_code_pass():
    seal = RpcSeal(KEY)
    for module, name in (("torch.distributed", "DistBackendError"), ("asyncrl.runtime.queue", "QueueTimeout"),
                         ("tests.rpc.test_seal", "test_keys_depend_on_token_and_nonce_and_the_check_reveals_neither")):
        assert _unpickle(seal, seal.seal(_global(module, name))).__name__ == name


def _global(module: str, name: str) -> bytes:
    """A protocol-4 pickle of the global `module`.`name` (a dotted name is looked up attribute by attribute)."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s.encode())]) + s.encode()
    return b"\x80\x04" + text(module) + text(name) + b"\x93."
