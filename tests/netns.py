"""Hosts for multi-host tests: Linux network namespaces on one bridge, with RFC 2544 test addresses (198.18.0.0/24).

    hosts = NetHosts.create(["hosta", "hostb", "hostc"])   # 198.18.0.1, .2, .3
    proc = hosts.popen("hosta", [sys.executable, ...], stdout=log)   # its own network, hostname and hosts file
    hosts.link("hostb", up=False)                           # take hostb's cable out
    hosts.remove()

Each host is a namespace with `lo` and `eth0` (its address), whose veth peer sits on a bridge in a switch namespace
of its own: nothing touches this machine's own network. `ip netns exec` mounts /etc/netns/NAME/hosts over
/etc/hosts, so every host resolves every host's name; `unshare --uts` gives each command the host's name. Names
carry the creating process's pid (`arl<pid>-…`), so namespaces a crashed session left behind are found and removed
by the next one (`remove_stale`). Needs root and iproute2 (`unavailable` says why not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess

__all__ = ["NetHosts", "unavailable", "remove_stale", "SUBNET"]

SUBNET = "198.18.0"
"""RFC 2544's benchmarking range: routed nowhere, so a test can never reach or be reached by a real network."""
_PREFIX = "arl"


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"network-namespace hosts need `{tool}` (iproute2, util-linux)"
    try:
        _ip("netns", "add", f"{_PREFIX}{os.getpid()}-probe")
        _ip("netns", "del", f"{_PREFIX}{os.getpid()}-probe")
    except subprocess.CalledProcessError as err:
        return f"this machine refuses network namespaces ({err.stderr.strip()})"
    return None


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def _alive(pid: int) -> bool:
    return pathlib.Path(f"/proc/{pid}").exists()


def remove_stale() -> list[str]:
    """Remove the namespaces (and hosts files) of sessions whose process is gone; returns their names."""
    removed = []
    for line in _ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        found = re.fullmatch(rf"{_PREFIX}(\d+)-\w+", name)
        if found and not _alive(int(found.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
            removed.append(name)
    return removed


@dataclasses.dataclass
class NetHosts:
    switch: str
    namespaces: dict[str, str]
    """Host name -> its namespace."""
    addresses: dict[str, str]
    """Host name -> its address."""

    @classmethod
    def create(cls, names: list[str]) -> "NetHosts":
        remove_stale()
        tag = f"{_PREFIX}{os.getpid()}"
        hosts = cls(f"{tag}-sw", {}, {})
        try:
            _ip("netns", "add", hosts.switch)
            _ip("-n", hosts.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", hosts.switch, "link", "set", "br0", "up")
            table = "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i} {n}\n" for i, n in enumerate(names, 1))
            for i, name in enumerate(names, 1):
                ns = f"{tag}-{name}"
                hosts.namespaces[name], hosts.addresses[name] = ns, f"{SUBNET}.{i}"
                _ip("netns", "add", ns)
                _ip("-n", hosts.switch, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", hosts.switch, "link", "set", f"v{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                etc = pathlib.Path(f"/etc/netns/{ns}")
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(table)
        except BaseException:
            hosts.remove()
            raise
        return hosts

    def command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` as run on `host`: in its namespace (and hosts file), under its host name."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *argv]

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` on `host` in a session of its own (kill its group to end it and its children)."""
        return subprocess.Popen(self.command(host, argv), start_new_session=True, **kwargs)

    @contextlib.contextmanager
    def own_name_on_loopback(self, host: str):
        """`host`'s hosts file as Debian and Ubuntu install it, its own name on 127.0.1.1, while inside; the
        other hosts' names as before."""
        path = pathlib.Path(f"/etc/netns/{self.namespaces[host]}/hosts")
        table = path.read_text()
        kept = [line for line in table.splitlines() if line.split()[1:] != [host]]
        path.write_text("\n".join([*kept, f"127.0.1.1 {host}"]) + "\n")
        try:
            yield
        finally:
            path.write_text(table)

    def link(self, host: str, *, up: bool) -> None:
        """Plug `host`'s cable in or out (its port on the switch)."""
        index = list(self.namespaces).index(host) + 1
        _ip("-n", self.switch, "link", "set", f"v{index}", "up" if up else "down")

    def remove(self) -> None:
        for ns in [*self.namespaces.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
