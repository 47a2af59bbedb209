"""The roles of a torchrun job's processes, as a table: which local rank of which node is a trainer rank or an agent,
and the layouts refused naming the flags. A job across real hosts (network namespaces) is in tests/rpc/test_hosts.py."""

from __future__ import annotations

import pytest

from asyncrl.rpc.torchrun import TorchrunRole, torchrun_role


def _env(rank: int, world: int, nodes: int = 1, node: int = 0, local: int | None = None, per_node: int | None = None):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           "GROUP_WORLD_SIZE": str(nodes), "GROUP_RANK": str(node)}
    if local is not None:
        env.update(LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(per_node))
    return env


def test_one_node_takes_trainers_first_then_agents():
    roles = [torchrun_role(_env(r, 5), num_trainers=2, num_agents=3) for r in range(5)]
    assert roles == [TorchrunRole("trainer", 0), TorchrunRole("trainer", 1), TorchrunRole("agent", 0),
                     TorchrunRole("agent", 1), TorchrunRole("agent", 2)]


def test_every_node_takes_the_same_share_of_trainers_and_agents():
    # 2 nodes x 3 processes, 2 trainers + 4 agents: each node has trainer n and agents 2n, 2n + 1
    layout = {(node, local): torchrun_role(_env(node * 3 + local, 6, 2, node, local, 3), 2, 4)
              for node in range(2) for local in range(3)}
    assert layout == {(0, 0): TorchrunRole("trainer", 0), (0, 1): TorchrunRole("agent", 0),
                      (0, 2): TorchrunRole("agent", 1), (1, 0): TorchrunRole("trainer", 1),
                      (1, 1): TorchrunRole("agent", 2), (1, 2): TorchrunRole("agent", 3)}
    # 4 trainers + 2 agents on 2 nodes: the trainer group's ranks 0-1 on node 0, 2-3 on node 1
    assert [torchrun_role(_env(3 + local, 6, 2, 1, local, 3), 4, 2) for local in range(3)] == [
        TorchrunRole("trainer", 2), TorchrunRole("trainer", 3), TorchrunRole("agent", 1)]


def test_a_layout_that_does_not_fit_names_the_flags():
    with pytest.raises(ValueError, match=r"torchrun started 4 processes but the placement needs 5 .* "
                                         r"fix --nproc-per-node / --nnodes"):
        torchrun_role(_env(0, 4), 2, 3)
    with pytest.raises(ValueError, match=r"--nnodes 2: every node takes the same share .* "
                                         r"--placement.trainer-devices lists 1 .* give multiples of 2"):
        torchrun_role(_env(0, 4, 2, 0, 0, 2), 1, 3)
    with pytest.raises(ValueError, match=r"--nproc-per-node 3: each of the 2 nodes runs 2 processes"):
        torchrun_role(_env(0, 4, 2, 0, 0, 3), 2, 2)
    with pytest.raises(ValueError, match=r"needs RANK, WORLD_SIZE in the environment"):
        torchrun_role({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, 1, 1)
