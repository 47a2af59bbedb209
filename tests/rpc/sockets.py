"""What a process listens on, read from /proc: its descendants, the sockets they hold, each LISTEN socket's address
(in the process's own network namespace)."""

from __future__ import annotations

import ipaddress
import os
import pathlib


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid and child not in found]
        found.update(children)
        frontier += children
    return found


def _socket_inodes(pids: set[int]) -> dict[int, int]:
    inodes = {}
    for pid in pids:
        try:
            fds = list(pathlib.Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[int(target[8:-1])] = pid
    return inodes


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four host-order 32-bit words
    return str(ipaddress.IPv6Address(words))


def listening_sockets(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state that one of `pids` holds, each read from the
    tables of its own process's network namespace (/proc/PID/net/tcp*)."""
    inodes = _socket_inodes(pids)
    tables = {}
    for pid in sorted(set(inodes.values())):
        for table in ("tcp", "tcp6"):
            try:
                text = pathlib.Path(f"/proc/{pid}/net/{table}").read_text()
            except OSError:
                continue
            for line in text.splitlines()[1:]:
                fields = line.split()
                inode = int(fields[9])
                if fields[3] == "0A" and inodes.get(inode) == pid and inode not in tables:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    tables[inode] = (_address(address), int(port, 16), pid)
    return list(tables.values())


def is_loopback_address(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


