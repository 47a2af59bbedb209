"""The run's store: a small key-value server (torch's TCPStore) that rank 0 serves and every process of the
run reaches at `master_addr:join_port`. It is the run's control plane for what RPC cannot carry:

  run info        the RPC port and run settings a joining process needs;
  ids             RPC ranks, agent slots and each slot's incarnation (restarts), handed out atomically;
  announcements   an agent process that joined the RPC group says so here; rank 0 admits it;
  leave requests  an agent that wants to leave (its SIGTERM) asks here;
  exits           the launcher saw an agent's process end: rank 0 declares it dead at once;
  dead reports    rank 0 names the agents it declared dead (pid included), so the launcher can end and restart
                  them;
  heartbeats      each trainer follower counts up from when it reaches the store; the launcher names one whose count
                  stops;
  shutdown        rank 0 marks the end of the run; every other process exits when it sees it;
  refusals        rank 0 names an agent it refused (no valid run token); that process exits when it sees it.

The store listens on the master address only (`asyncrl.rpc.exposure`): loopback stays on this host.

Sequences (announcements, leave requests, dead reports) are an append-only list: a counter key and one key per
entry, so each reader keeps its own cursor and nothing is lost between polls.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import pathlib
import socket
import tempfile

import torch.distributed as dist

from asyncrl.rpc.exposure import RunToken, is_loopback, listening_socket

__all__ = ["RunStore", "Records", "agent_name", "serve_store", "is_serving"]

log = logging.getLogger(__name__)

_RPC_RANK_BASE = 1_000  # trainers are RPC ranks 0 .. T-1; agents get ranks from here on


def agent_name(slot: int, incarnation: int) -> str:
    """`agent3` for the first process of slot 3, `agent3_r1` for its first restart (the RPC group's member list
    is "name-id,...": a name must hold no '-')."""
    return f"agent{slot}" if incarnation == 0 else f"agent{slot}_r{incarnation}"


def is_serving(host: str, port: int) -> bool:
    """Whether something listens at `host:port` (a store a launcher waits for: a client that connects first logs a
    C++ traceback)."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def serve_store(host: str, port: int, timeout_s: float, *, multi_tenant: bool = False) -> dist.TCPStore:
    """A TCPStore served at `host:port` from a socket bound to that address only (torch's own server would
    listen on every interface). `multi_tenant`: a later TCPStore of this process on the same port (the RPC
    group's, made inside `rpc.init_rpc`) shares this server instead of starting one of its own."""
    listener = listening_socket(host, port)
    return dist.TCPStore(host, port, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=multi_tenant, master_listen_fd=listener.detach())


class Records(list):
    """Entries of a store sequence; `consumed`: how many entries were read (signed or not)."""

    consumed: int = 0


class RunStore:
    """The run's store. `authenticate(token)` before writing or reading control records: unsigned ones are then
    ignored (a process that has not authenticated signs nothing and checks nothing)."""

    def __init__(self, host: str, port: int, *, serve: bool, timeout_s: float):
        self.host, self.port = host, port
        self.key: bytes | None = None
        self._ignored: set[str] = set()  # entries already reported as unsigned (a reader polls: say it once)
        self.raw = serve_store(host, port, timeout_s) if serve else dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    def prefix(self, name: str) -> dist.PrefixStore:
        return dist.PrefixStore(name, self.raw)

    # ------------------------------------------------------------------------------------------- info
    def set_info(self, info: dict) -> None:
        self.raw.set("asyncrl/info", json.dumps(info))

    def info(self) -> dict:
        return json.loads(self.raw.get("asyncrl/info"))  # waits (up to the store timeout) until rank 0 set it

    def leave_token(self, token: RunToken) -> pathlib.Path:
        """Rank 0 of a loopback run: the token, for `asyncrl agent --join` on this host by the same user, in a file
        only this user can read (mode 0600, in the temporary directory); the store holds its path, never the token
        (any local user can reach a loopback store). Returns the file, which rank 0 removes at the end. Never on a
        run other hosts can reach."""
        if not is_loopback(self.host):
            raise ValueError(f"the run token is not stored on a run at {self.host}, which other hosts can reach")
        fd, path = tempfile.mkstemp(prefix=f"asyncrl-run-{self.port}-", suffix=".token")  # 0600
        with os.fdopen(fd, "w") as f:
            f.write(token.value)
        self.raw.set("asyncrl/token_file", path)
        return pathlib.Path(path)

    def left_token(self) -> RunToken | None:
        """The token rank 0 of a loopback run left for this host's user, or None (not loopback, none left, or a
        file this user cannot read)."""
        if not is_loopback(self.host) or not self.raw.check(["asyncrl/token_file"]):
            return None
        try:
            value = pathlib.Path(self.raw.get("asyncrl/token_file").decode()).read_text().strip()
        except OSError:
            return None
        return RunToken(value, generated=True) if value else None

    # -------------------------------------------------------------------------------------------- ids
    def next_rpc_rank(self) -> int:
        return _RPC_RANK_BASE + self.raw.add("asyncrl/rpc_rank", 1) - 1

    def reserve_slots(self, n: int) -> None:
        """Rank 0 at start-up: slots 0 .. n-1 belong to the configured agents; a joiner gets the next one."""
        self.raw.add("asyncrl/slot", n)

    def new_slot(self) -> int:
        return self.raw.add("asyncrl/slot", 1) - 1

    def next_incarnation(self, slot: int) -> int:
        return self.raw.add(f"asyncrl/slot/{slot}/incarnation", 1) - 1

    # ---------------------------------------------------------------------------------------- sequences
    def _append(self, sequence: str, record: dict) -> None:
        index = self.raw.add(f"asyncrl/{sequence}/count", 1) - 1
        key = f"asyncrl/{sequence}/{index}"
        self.raw.set(key, self._signed(key, record))

    def _read(self, sequence: str, start: int) -> "Records":
        """The entries from `start` on, those without the run's seal left out (`consumed` counts them all: the
        reader's next start)."""
        count = self.raw.add(f"asyncrl/{sequence}/count", 0)
        out = Records()
        for i in range(start, count):
            key = f"asyncrl/{sequence}/{i}"
            self.raw.wait([key])  # the writer counted before it wrote: wait for the entry itself
            record = self._verified(key, self.raw.get(key))
            if record is not None:
                out.append(record)
        out.consumed = max(count - start, 0)
        return out

    # ------------------------------------------------------------------------------------ authentication
    def authenticate(self, token: RunToken) -> None:
        """Sign what this process writes to the control records (announcements, leave requests, exits, dead reports,
        refusals, the shutdown) and ignore any entry not signed with the run's token: a stranger who reaches the
        store cannot stop the run, have an agent declared dead (and its process killed) or refused."""
        self.key = hmac.new(token.value.encode(), b"asyncrl/store", hashlib.sha256).digest()

    def _mac(self, key: str, body: str) -> str:
        return hmac.new(self.key, f"{key}|{body}".encode(), hashlib.sha256).hexdigest()

    def _signed(self, key: str, record: dict) -> str:
        body = json.dumps(record, sort_keys=True)
        return json.dumps({"body": body, "mac": self._mac(key, body) if self.key else ""})

    def _ignore(self, key: str, why: str) -> None:
        if key not in self._ignored:
            self._ignored.add(key)
            log.warning("ignored store entry %s: %s", key, why)

    def _verified(self, key: str, raw: bytes) -> dict | None:
        try:
            signed = json.loads(raw)
            body, mac = signed["body"], signed["mac"]
        except (ValueError, TypeError, KeyError):
            self._ignore(key, "not a signed record")
            return None
        if self.key is not None and not hmac.compare_digest(str(mac), self._mac(key, body)):
            self._ignore(key, "not signed with the run's token")
            return None
        try:
            record = json.loads(body)
        except ValueError:
            return None
        return record if isinstance(record, dict) else None

    def announce(self, record: dict) -> None:
        """An agent process joined the RPC group and waits to be admitted."""
        self._append("join", record)

    def announcements(self, start: int) -> list[dict]:
        return self._read("join", start)

    def request_leave(self, name: str, reason: str) -> None:
        self._append("leave", {"name": name, "reason": reason})

    def leave_requests(self, start: int) -> list[dict]:
        return self._read("leave", start)

    def report_exit(self, pid: int, code: int | None) -> None:
        """The launcher saw an agent process end (rank 0 declares it dead at once, not after its timeout)."""
        self._append("exit", {"pid": pid, "code": code})

    def exits(self, start: int) -> list[dict]:
        return self._read("exit", start)

    def report_dead(self, name: str, pid: int | None, why: str) -> None:
        self._append("dead", {"name": name, "pid": pid, "why": why})

    def dead_reports(self, start: int) -> list[dict]:
        return self._read("dead", start)

    def refuse(self, name: str, why: str) -> None:
        key = f"asyncrl/refused/{name}"
        self.raw.set(key, self._signed(key, {"why": why}))

    def refusal(self, name: str) -> str | None:
        """Why rank 0 refused agent `name`, or None."""
        key = f"asyncrl/refused/{name}"
        if not self.raw.check([key]):
            return None
        record = self._verified(key, self.raw.get(key))
        return None if record is None else str(record.get("why"))

    # ------------------------------------------------------------------------------------- run end
    def shut_down(self) -> None:
        self.raw.set("asyncrl/shutdown", self._signed("asyncrl/shutdown", {"shutdown": True}))

    def is_shut_down(self) -> bool:
        if not self.raw.check(["asyncrl/shutdown"]):
            return False
        return self._verified("asyncrl/shutdown", self.raw.get("asyncrl/shutdown")) is not None

    def trainer_beat(self, rank: int, generation: int = 0) -> None:
        """Trainer rank `rank` (a follower) of the trainer group's generation `generation` is alive: its count goes
        up (every half second from when its process reaches the store: `asyncrl.rpc.failover.Heartbeat`)."""
        self.raw.add(f"asyncrl/beat/gen{generation}/{rank}", 1)

    def trainer_beats(self, rank: int, generation: int = 0) -> int:
        """How many heartbeats trainer rank `rank` of generation `generation` sent (0: its process has not reached
        the store yet)."""
        return self.raw.add(f"asyncrl/beat/gen{generation}/{rank}", 0)

    def post_trainer_fault(self, generation: int, why: str, trainer_devices: list[str]) -> None:
        """The launcher ended the trainer group's followers after `why` and starts generation `generation`'s, of
        `trainer_devices` (one fewer than before after a shrink)."""
        key = "asyncrl/trainer_fault"
        self.raw.set(key, self._signed(key, {"generation": generation, "why": why,
                                             "trainer_devices": list(trainer_devices)}))

    def claim_trainer_generation(self, current: int) -> bool:
        """Claim generation `current` + 1 of the trainer group, atomically: True for the one caller that moves it on
        from `current` (under torchrun, the keepers that saw a follower's fault race for it; one posts it)."""
        return self.raw.add(f"asyncrl/trainer_generation/{current}/claims", 1) == 1

    def trainer_fault(self) -> dict | None:
        """The newest trainer-group fault the launcher posted ({"generation", "why", "trainer_devices"}), or None."""
        key = "asyncrl/trainer_fault"
        if not self.raw.check([key]):
            return None
        record = self._verified(key, self.raw.get(key))
        return record if record is not None and isinstance(record.get("generation"), int) else None

    def set_restarts_left(self, n: int) -> None:
        self.raw.set("asyncrl/restarts_left", str(n))

    def take_restart(self) -> bool:
        """Use one restart of the run's budget, atomically (keepers on several nodes share it); False when it
        is spent."""
        if self.raw.add("asyncrl/restarts_left", -1) >= 0:
            return True
        self.raw.add("asyncrl/restarts_left", 1)
        return False

    def restarts_left(self) -> int:
        return int(self.raw.get("asyncrl/restarts_left")) if self.raw.check(["asyncrl/restarts_left"]) else 0
