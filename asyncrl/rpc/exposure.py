"""What a run exposes to the network, and who may join it.

**Where the run listens.** Every listener of a run binds the address its `--placement.master-addr` names:
  * the run's store and the RPC group's store are served from a socket this module binds and listens on
    (torch's TCPStore binds every interface whatever host it is given; it serves a socket handed to it as is);
  * TensorPipe (RPC), gloo (trainer group, weight channels) and NCCL's bootstrap pick their interface from
    `TP_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME`, and vLLM from `VLLM_HOST_IP`:
    `pin_interface` sets them in every process before any of them starts: the loopback interface on a loopback
    run, `--placement.interface` (default auto: the interface that routes to the master address) elsewhere.
A loopback master address (the default, 127.0.0.1) therefore keeps the whole run on this host.

**The run token.** Every RPC message is sealed with a key derived from it (`asyncrl.rpc.seal`), the store's
control records are signed with it (`asyncrl.rpc.store`), and each agent proves it knows the token with an HMAC
of its name and the run's nonce, which rank 0 checks before admitting it. The token never enters the store,
metrics, config or logs; on a loopback run rank 0 leaves it in a file only this user can read (the store holds
the path) so that `asyncrl agent --join 127.0.0.1:PORT` needs nothing more. gloo and NCCL are not authenticated:
a multi-host run belongs on a network you trust.
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
    "pin_interface", "socket_interface", "route_interface", "interface_addresses", "SOCKET_VARIABLES",
    "read_token", "new_token", "new_nonce",
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
    """The address this machine reaches other hosts from: the source of its route to a public address (no packet
    is sent), else, on a network without a default route, the first IPv4 address of an interface that is neither
    loopback nor link-local; None when there is neither."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route's source address is read
            address = sock.getsockname()[0]
        except OSError:
            address = None
    if address is not None and not ipaddress.ip_address(address).is_loopback:
        return address
    return next((a for addresses in interface_addresses().values() for a in addresses
                 if ipaddress.ip_address(a).version == 4 and not ipaddress.ip_address(a).is_loopback
                 and not ipaddress.ip_address(a).is_link_local), None)


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


SOCKET_VARIABLES = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Where TensorPipe (RPC), gloo and NCCL's bootstrap pick the interface they listen on; vLLM reads VLLM_HOST_IP."""


def interface_addresses() -> dict[str, list[str]]:
    """This machine's interfaces and their addresses (IPv4 by SIOCGIFADDR, IPv6 from /proc/net/if_inet6)."""
    import fcntl
    import struct
    found: dict[str, list[str]] = {name: [] for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in found:
            try:
                raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                found[name].append(socket.inet_ntoa(raw[20:24]))
            except OSError:
                pass
    try:
        for line in pathlib.Path("/proc/net/if_inet6").read_text().splitlines():
            fields = line.split()
            if len(fields) == 6 and fields[5] in found:
                found[fields[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:
        pass
    return found


def route_interface(host: str) -> tuple[str, str] | None:
    """(interface, address) this machine reaches `host` from: the source address of a route to it (its own
    address on the head), and the interface that holds that address; None without a route."""
    try:
        family, *_, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror:
        return None
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(target)  # no packet is sent: this only picks the route
        except OSError:
            return None
        address = sock.getsockname()[0]
    return next(((name, address) for name, addresses in interface_addresses().items() if address in addresses), None)


def socket_interface(host: str, interface: str = "auto") -> tuple[str, str]:
    """(interface, address) every socket of a run with master address `host` listens on: loopback for a loopback
    run; `interface` when named (it must exist here); else the one that routes to `host`. Raises ValueError naming
    --placement.interface and this machine's interfaces."""
    addresses = interface_addresses()
    if is_loopback(host) and interface == "auto":
        name = _loopback_interface()
        return name, "::1" if host.strip("[]") == "::1" else "127.0.0.1"
    if interface != "auto":
        held = [a for a in addresses.get(interface, []) if not a.startswith("fe80")]
        if not held:
            raise ValueError(f"--placement.interface {interface}: no interface of this machine by that name holds an "
                             f"address; its interfaces: {_listing(addresses)}")
        return interface, held[0]
    routed = route_interface(host)
    if routed is None:
        raise ValueError(f"--placement.master-addr {host}: no route from this machine; give --placement.interface "
                         f"(its interfaces: {_listing(addresses)})")
    return routed


def _listing(addresses: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} ({' '.join(a) or 'no address'})" for name, a in addresses.items())


def pin_interface(host: str, interface: str = "auto") -> tuple[str, str]:
    """Make TensorPipe, gloo, NCCL and vLLM listen on the run's interface (`socket_interface`) in this process and
    those it starts: a loopback run or a named interface sets every variable; `auto` on a network run sets those
    the operator left unset. Returns (interface, address)."""
    name, address = socket_interface(host, interface)
    force = interface != "auto" or is_loopback(host)
    for variable in SOCKET_VARIABLES:
        if force or not os.environ.get(variable):
            os.environ[variable] = name
    if force or not os.environ.get("VLLM_HOST_IP"):
        os.environ["VLLM_HOST_IP"] = address
    return name, address


@dataclasses.dataclass(frozen=True)
class RunToken:
    """A run's secret (never printed by repr)."""

    value: str = dataclasses.field(repr=False)
    generated: bool = False
    """Made by this run (a loopback run's: a run other hosts can reach needs the user's), not given by the user.
    Never printed either way."""

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
