"""What a run exposes to the network, and who may join it.

**Where the run listens.** Every listener of a run binds the address its `--placement.master-addr` names:
  * the run's store and the RPC group's store are served from a socket this module binds and listens on
    (torch's TCPStore binds every interface whatever host it is given; it serves a socket handed to it as is);
  * TensorPipe (RPC), gloo (trainer group, weight channels) and NCCL's bootstrap pick their interface from
    `TP_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME`, and vLLM from `VLLM_HOST_IP`: on a
    loopback run `confine_to_loopback` sets them in every process before any of them starts.
A loopback master address (the default, 127.0.0.1) therefore keeps the whole run on this host.

**The run token.** RPC unpickles what it receives: anyone who reaches a run's ports can run code in it. A
multi-host run belongs on a network you trust, and its agents must also present the run's token before they
get anything (weights, prompts): each agent proves it knows the token with an HMAC of its name and the run's
nonce, which rank 0 checks before admitting it. The token never enters the store of a run that other hosts
can reach, nor its metrics, config or logs; on a loopback run rank 0 leaves it in the (loopback-only) store so
that `asyncrl agent --join 127.0.0.1:PORT` needs nothing more.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import os
import pathlib
import secrets
import socket

__all__ = [
    "TOKEN_ENV", "RunToken", "is_loopback", "bind_address", "outward_address", "listening_socket",
    "confine_to_loopback", "read_token", "new_token", "new_nonce",
]

TOKEN_ENV = "ASYNCRL_RUN_TOKEN"
"""The environment variable that carries a run's token (or give a file: --placement.token-file / --token-file)."""

_MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) means this machine only: 127.0.0.0/8, ::1, or a name that
    resolves to nothing else (localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _is_local(address: str) -> bool:
    """Whether `address` belongs to an interface of this machine (a socket can bind it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def outward_address() -> str | None:
    """The address this machine reaches other hosts from (the source of a route to a public address; no packet
    is sent), or None without a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route's source address is read
        except OSError:
            return None
        address = sock.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def bind_address(host: str) -> str:
    """The address the run's stores listen on for master address `host`: loopback stays loopback, an address of
    this machine is used as is, and a host name binds the address of this machine it resolves to (never every
    interface: other hosts resolve the name in their own way, and a wildcard would reach any network the machine
    is on). Raises ValueError, naming --placement.master-addr and this machine's address, when `host` is not
    (or does not resolve to) an address of this machine."""
    if is_loopback(host):
        return "::1" if host.strip("[]") == "::1" else "127.0.0.1"
    try:
        candidates = [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            raise ValueError(f"--placement.master-addr {host}: the name does not resolve ({err.strerror}); give "
                             f"this machine's address{_example()}") from None
        candidates = list(dict.fromkeys(info[4][0] for info in sorted(infos, key=lambda i: i[0] != socket.AF_INET)))
    if any(ipaddress.ip_address(a).is_unspecified for a in candidates):
        raise ValueError(f"--placement.master-addr {host}: listens on every interface of this machine, and other "
                         f"hosts cannot connect to it; give this machine's address on the run's network"
                         f"{_example()}")
    local = [a for a in candidates if not ipaddress.ip_address(a).is_loopback and _is_local(a)]
    if not local:
        raise ValueError(f"--placement.master-addr {host}: {', '.join(candidates)} is not an address of this "
                         f"machine, so the run's stores cannot listen there; give this machine's address"
                         f"{_example()}")
    return local[0]


def _example() -> str:
    address = outward_address()
    return f" (e.g. {address})" if address else ""


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `bind_address(host)`:`port` and listening, for a TCPStore to serve
    (`master_listen_fd`). SO_REUSEADDR, as TCPStore itself sets: a port the launcher holds (bound, never
    listening) can be served."""
    address = bind_address(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def _loopback_interface() -> str:
    """This machine's loopback interface ('lo' on Linux, 'lo0' on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), "lo"))


def confine_to_loopback(host: str) -> None:
    """On a loopback run, make TensorPipe, gloo, NCCL and vLLM listen on the loopback interface only (this
    process and those it starts). Nothing changes for a run on another address: there the interfaces are the
    operator's to choose (the same variables)."""
    if not is_loopback(host):
        return
    interface = _loopback_interface()
    for name in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ[name] = interface
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class RunToken:
    """A run's secret (never printed by repr)."""

    value: str = dataclasses.field(repr=False)
    generated: bool = False
    """Made by this run (its join line shows it), not given by the user (whose own secret is not echoed)."""

    def proof(self, name: str, nonce: str) -> str:
        """What agent `name` shows rank 0: an HMAC of its name and the run's nonce, keyed by the token (the
        token itself never travels)."""
        return hmac.new(self.value.encode(), f"{name}|{nonce}".encode(), hashlib.sha256).hexdigest()

    def admits(self, name: str, nonce: str, proof: object) -> bool:
        return isinstance(proof, str) and hmac.compare_digest(proof, self.proof(name, nonce))


def new_token() -> RunToken:
    return RunToken(secrets.token_hex(16), generated=True)


def new_nonce() -> str:
    return secrets.token_hex(8)


def read_token(token_file: str | None, *, flag: str) -> RunToken | None:
    """The run token the user gave: the file `token_file` (its first line), else $ASYNCRL_RUN_TOKEN, else None.

    Raises:
      ValueError: the file is missing or unreadable, or the token is shorter than 16 characters (named by
        `flag` or the variable).
    """
    if token_file:
        path = pathlib.Path(token_file).expanduser()
        try:
            lines = path.read_text().strip().splitlines()
        except OSError as err:
            raise ValueError(f"{flag} {token_file}: cannot read the run token ({err.strerror}); give a file whose "
                             "first line is the token") from None
        token, where = (lines[0].strip() if lines else ""), f"{flag} {token_file}"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            return None
        where = f"${TOKEN_ENV}"
    if len(token) < _MIN_TOKEN_CHARS:
        raise ValueError(f"{where}: the run token has {len(token)} characters; use at least {_MIN_TOKEN_CHARS} "
                         "random ones (e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)")
    return RunToken(token)
