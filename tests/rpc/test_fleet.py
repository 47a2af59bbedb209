"""Rank 0's fleet (asyncrl/rpc/fleet.py): a discarded agent leaves nothing behind in it. Its server's reference is
dropped (a run that loses agents for days holds none of theirs), its weight channel is aborted, and the membership
is asked to evict it."""

from __future__ import annotations

import gc
import threading
import weakref

from asyncrl.rpc.fleet import AgentHandle, Fleet


class _Server:
    """Stands in for an agent server's RRef."""


class _Channel:
    def __init__(self):
        self.aborted = False

    def abort(self):
        self.aborted = True


class _Membership:
    def __init__(self):
        self.evicted = threading.Event()
        self.names: list[str] = []

    def evict(self, name: str) -> None:
        self.names.append(name)
        self.evicted.set()


def test_a_discarded_agent_s_server_reference_is_released_and_its_channel_aborted():
    membership, channel = _Membership(), _Channel()
    fleet = Fleet(store=None, membership=membership)
    servers = {name: _Server() for name in ("agent0", "agent1")}
    alive = {name: weakref.ref(server) for name, server in servers.items()}
    fleet.add(AgentHandle("agent0", servers["agent0"], channel=channel, pid=11))
    fleet.add(AgentHandle("agent1", servers["agent1"], pid=12))
    servers.clear()
    gc.collect()
    assert alive["agent0"]() is not None  # held by the fleet while the agent is in it
    fleet.discard("agent0", "dead", "killed")
    assert membership.evicted.wait(10) and membership.names == ["agent0"]
    gc.collect()
    assert alive["agent0"]() is None and fleet.get("agent0") is None
    assert channel.aborted
    assert alive["agent1"]() is not None and fleet.get("agent1").pid == 12
    fleet.discard("agent0", "dead", "again")  # a second removal of the same name changes nothing
    assert membership.names == ["agent0"]
