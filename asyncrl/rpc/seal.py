"""No unauthenticated bytes reach `pickle`: every RPC message a run's processes exchange is sealed with a MAC keyed
by the run's token, and checked before anything of it is unpickled.

    seal_rpc(rpc_key(token, nonce))    # in every process of the run, before it joins the RPC group

`torch.distributed.rpc` pickles each Python call, its arguments and its result with the module globals
`torch.distributed.rpc.internal._pickler` and `_unpickler`, and runs the function a message names. TensorPipe hands
any message that reaches a process's port to that unpickler, from anyone: so anyone who could reach a run could
run code in it. `seal_rpc` replaces both globals (`installed_rpc_seal` says whether it is in place; a test fails
if torch moves them):

  * a sender writes MAGIC | session (16 random bytes per process) | counter (8 bytes, one per message) |
    HMAC-SHA256(key, MAGIC | session | counter | payload) | payload;
  * a receiver checks the MAC in constant time, refuses a (session, counter) it has accepted before or one older
    than the last WINDOW messages of that session (replay), and only then unpickles the payload, with an
    unpickler that builds only the classes a run's messages use (`find_class` below): asyncrl's own, the torch
    RPC internals that carry calls, results and remote references, numpy arrays, exception classes of modules
    already loaded, and plain builtins. A refused message raises `SealError` in the receiving process; torch
    returns that to the caller as an error, and the receiver goes on.

What stays open (docs/security.md): tensors travel beside the pickle in TensorPipe's own frames and are not
covered by the MAC (a forged message cannot reference them; a man in the middle could alter them, as it could
gloo's and NCCL's unencrypted weights); TensorPipe's builtin-operator calls (`aten::` ops, TorchScript) are
decoded in C++ without the unpickler; a message recorded on the wire can be delivered once to another process
of the same run (the counter window is per receiver).
"""

from __future__ import annotations

import builtins
import collections
import hashlib
import hmac
import io
import pickle
import secrets
import struct
import sys
import threading
import types

__all__ = ["SealError", "RpcSeal", "rpc_key", "key_check", "seal_rpc", "installed_rpc_seal", "WINDOW"]

MAGIC = b"ARL1"
_HEAD = struct.Struct(">4s16sQ")  # magic, session, counter
_MAC_BYTES = 32
WINDOW = 4096
"""Messages of one sender that may arrive out of order (torch serialises calls on many threads): a counter more
than WINDOW below that sender's newest is refused, as is any counter seen before."""


class SealError(pickle.UnpicklingError):
    """A message without a valid seal (no token, another run's, altered, replayed) or naming a class no message of
    a run uses."""


def rpc_key(token: str, nonce: str) -> bytes:
    """The run's RPC key: an HMAC of the run's nonce keyed by its token (the token itself is never used as a key
    nor sent)."""
    return hmac.new(token.encode(), f"asyncrl/rpc-seal|{nonce}".encode(), hashlib.sha256).digest()


def key_check(key: bytes) -> str:
    """What rank 0 publishes in the run's store so that a joining process can tell, before it joins, whether its
    token gives the run's key (an HMAC of a constant under the key: it reveals no more of the token than the agents'
    proofs do)."""
    return hmac.new(key, b"asyncrl/rpc-seal-check", hashlib.sha256).hexdigest()


class _ReplayWindow:
    """The counters of one sender accepted so far: the newest, and which of the WINDOW below it were seen."""

    def __init__(self):
        self.newest = -1
        self.seen: set[int] = set()

    def accept(self, counter: int) -> bool:
        if counter in self.seen or counter <= self.newest - WINDOW:
            return False
        self.seen.add(counter)
        if counter > self.newest:
            self.newest = counter
            if len(self.seen) > 2 * WINDOW:
                self.seen = {c for c in self.seen if c > self.newest - WINDOW}
        return True


_STDLIB_NAMES = {
    "collections": {"OrderedDict", "Counter", "defaultdict", "deque"},
    "datetime": {"timedelta", "datetime", "date", "time", "timezone"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "PurePath"},
    "copyreg": {"_reconstructor", "__newobj__", "__newobj_ex__"},
    "functools": {"partial"},
    "decimal": {"Decimal"},
    "fractions": {"Fraction"},
    "uuid": {"UUID"},
    "enum": {"Enum", "IntEnum"},
}
"""The standard library's names a run's messages may carry (containers, times, paths, partials): nothing else of the
standard library is built, so no process, file, import or code-execution function is reachable by name."""
_TORCH_RPC = {
    "torch.distributed.rpc.internal": {"PythonUDF", "RemoteException", "_InternalRPCPickler"},
    "torch.distributed.rpc.rref_proxy": {"_local_invoke", "_local_invoke_async_execution"},
    "torch.distributed.rpc.api": {"_rref_typeof_on_owner", "_rref_typeof_on_user", "_to_worker_info"},
    "torch.distributed.rpc._utils": {"_update_group_membership"},
    "torch.distributed.rpc.backend_registry": {"_get_device_infos"},
}
"""torch's RPC functions a run's messages name (a call, a result, a remote reference, the group's joins); no other
function of `torch.distributed` is built."""
_REFUSED_PREFIXES = ("torch.distributed", "torch.hub", "torch.utils.cpp_extension", "torch.jit", "torch.package",
                     "torch.serialization", "torch._dynamo", "torch._inductor", "torch.multiprocessing",
                     "torch.utils.data", "numpy.f2py", "numpy.distutils", "numpy.testing", "numpy.lib.npyio",
                     "numpy.lib.format", "numpy.ctypeslib")
"""Modules whose functions load files, fetch or compile code, or start processes (beyond `_TORCH_RPC`'s)."""
_REFUSED_FUNCTIONS = {("numpy", "load"), ("numpy", "fromfile"), ("numpy", "memmap"), ("torch", "load"),
                      ("torch", "from_file"), ("torch", "compile")}
_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "range", "list", "dict", "tuple", "bytes", "str",
             "int", "float", "bool", "object", "type"}
_RECEIVERS = {"_tensor_receiver", "_py_rref_receiver"}
"""The only attributes a message may fetch with `getattr`: the RPC pickler's tensor and remote-reference receivers
(a tensor or an RRef travels as `getattr(_InternalRPCPickler, receiver)(index)`)."""


def _receiver(obj, name: str):
    import torch.distributed.rpc.internal as internal
    if obj is not internal._InternalRPCPickler or name not in _RECEIVERS:
        raise SealError(f"a message asked for attribute {name!r} of {obj!r}; only the RPC pickler's receivers may "
                        "be fetched")
    return getattr(obj, name)


def _is_exception_class(value) -> bool:
    return isinstance(value, type) and issubclass(value, BaseException)


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _stdlib(module: str) -> bool:
    return _top(module) in sys.stdlib_module_names


def _refused_home(module: str, name: str) -> bool:
    """Whether `module`.`name` (the module an object says it lives in) is off limits."""
    if name in _TORCH_RPC.get(module, ()) or name in _STDLIB_NAMES.get(module, ()):
        return False
    if (module, name) in _REFUSED_FUNCTIONS or _stdlib(module):
        return True
    return any(module == p or module.startswith(p + ".") for p in _REFUSED_PREFIXES)


class _Unpickler(pickle.Unpickler):
    """Builds what a run's messages use and keeps out what would run code: the standard library only for
    `_STDLIB_NAMES`, builtins' plain types and exception classes, `getattr` only for the RPC pickler's receivers,
    torch's RPC functions only as `_TORCH_RPC` lists them, no module object, nothing whose own module (`__module__`:
    `torch.os.system` is `posix.system`) is the standard library's or one that loads files, fetches or compiles
    code (`_REFUSED_PREFIXES`). asyncrl's classes and functions, numpy arrays, torch dtypes and devices, and the
    classes and functions of the run's own code (an engine factory, a prompt source given to the Python API) pass.
    Not a sandbox: a process that holds the run's token is trusted; this keeps a one-line payload out."""

    def find_class(self, module: str, name: str):
        if module == "builtins":
            if name == "getattr":
                return _receiver
            value = getattr(builtins, name, None)
            if name in _BUILTINS or _is_exception_class(value):
                return value
            raise SealError(f"a message named builtins.{name}, which no message of a run uses; refused")
        if _stdlib(module) and name not in _STDLIB_NAMES.get(module, ()):
            value = getattr(sys.modules.get(module), name, None)
            if _is_exception_class(value):  # a remote error's type, from a module already loaded
                return value
            raise SealError(f"a message named {module}.{name}, which no message of a run uses; refused")
        value = super().find_class(module, name)
        if _is_exception_class(value):  # a remote error's type
            return value
        home = getattr(value, "__module__", None)
        if isinstance(value, types.ModuleType) or not isinstance(home, str) or _refused_home(module, name) or \
                _refused_home(home, getattr(value, "__name__", "")):
            raise SealError(f"a message named {module}.{name} ({home}.{getattr(value, '__name__', '?')}), which no "
                            "message of a run uses; refused")
        return value


class RpcSeal:
    """One process's sealing: its session, its counter, the receivers' replay windows, under one lock."""

    def __init__(self, key: bytes):
        if len(key) < 32:
            raise ValueError("RpcSeal: the key must be 32 bytes (rpc_key)")
        self.key = key
        self.session = secrets.token_bytes(16)
        self._counter = 0
        self._windows: dict[bytes, _ReplayWindow] = collections.defaultdict(_ReplayWindow)
        self._lock = threading.Lock()
        self.refused = 0
        """Messages this process refused."""

    def _mac(self, head: bytes, payload: bytes) -> bytes:
        mac = hmac.new(self.key, head, hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def seal(self, payload: bytes) -> bytes:
        with self._lock:
            counter = self._counter
            self._counter += 1
        head = _HEAD.pack(MAGIC, self.session, counter)
        return head + self._mac(head, payload) + payload

    def open(self, message: bytes) -> bytes:
        """The payload of a sealed message; SealError when it is not sealed with this run's key, or replayed."""
        size = _HEAD.size + _MAC_BYTES
        try:
            if len(message) < size:
                raise SealError("a message too short to carry a seal: it was not sent by a process of this run")
            head, mac, payload = message[:_HEAD.size], message[_HEAD.size:size], message[size:]
            magic, session, counter = _HEAD.unpack(head)
            if magic != MAGIC or not hmac.compare_digest(mac, self._mac(head, payload)):
                raise SealError("a message whose seal does not match this run's key: refused unread (a process "
                                "without the run's token, or another run's)")
            with self._lock:
                if not self._windows[session].accept(counter):
                    raise SealError(f"a message replayed (counter {counter} of a sender already seen): refused")
        except SealError:
            with self._lock:
                self.refused += 1
            raise
        return payload

    def pickler(self):
        """The class torch's RPC pickles with: `_pickler(file)`, `.dispatch_table`, `.dump(obj)`."""
        seal = self

        class SealedPickler:
            def __init__(self, file, protocol=None):
                self.file, self.protocol, self.dispatch_table = file, protocol, None

            def dump(self, obj) -> None:
                buffer = io.BytesIO()
                inner = pickle.Pickler(buffer, self.protocol)
                if self.dispatch_table is not None:
                    inner.dispatch_table = self.dispatch_table
                inner.dump(obj)
                self.file.write(seal.seal(buffer.getvalue()))

        return SealedPickler

    def unpickler(self):
        """The class torch's RPC unpickles with: `_unpickler(file).load()`."""
        seal = self

        class SealedUnpickler:
            def __init__(self, file):
                self.file = file

            def load(self):
                return _Unpickler(io.BytesIO(seal.open(self.file.read()))).load()

        return SealedUnpickler


def seal_rpc(key: bytes) -> RpcSeal:
    """Seal this process's RPC messages with `key` and refuse any other (before `init_rpc`, in every process of the
    run). Returns the seal (its `refused` count). Raises RuntimeError when torch no longer pickles RPC messages
    through `torch.distributed.rpc.internal._pickler` / `_unpickler` (then nothing would be sealed)."""
    import torch.distributed.rpc.internal as internal
    if not (hasattr(internal, "_pickler") and hasattr(internal, "_unpickler")
            and "_unpickler(" in _source(internal._InternalRPCPickler.deserialize)
            and "_pickler(" in _source(internal._InternalRPCPickler.serialize)):
        raise RuntimeError("torch.distributed.rpc no longer pickles through internal._pickler/_unpickler: the RPC "
                           "seal cannot be installed on this torch; refusing to run unsealed")
    seal = RpcSeal(key)
    internal._pickler = seal.pickler()
    internal._unpickler = seal.unpickler()
    return seal


def installed_rpc_seal() -> bool:
    """Whether this process's RPC messages are sealed (`seal_rpc` ran)."""
    import torch.distributed.rpc.internal as internal
    return getattr(internal._unpickler, "__qualname__", "").endswith("SealedUnpickler")


def _source(fn) -> str:
    import inspect
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
