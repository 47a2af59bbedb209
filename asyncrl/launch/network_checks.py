"""What a run exposes to the network, checked before launch (`asyncrl.launch.preflight` runs it): the master address
binds an address of this machine (the master's node under torchrun), a job of several nodes has a master the other
nodes can reach, the interface exists, a run other hosts can reach has a token the user gave; and the run's
listener table for the report.

    check = check_network(cfg, backend="asyncrl")
    check.problems     # each names the flag (or MASTER_ADDR) and the fix
    check.facts        # what is exposed, and the listener table
"""

from __future__ import annotations

import dataclasses
import os

from asyncrl.config import RunConfig
from asyncrl.rpc.exposure import TOKEN_ENV, bind_address, is_loopback, read_token, socket_interface
from asyncrl.rpc.torchrun import check_master

__all__ = ["NetworkCheck", "check_network", "listener_table"]


@dataclasses.dataclass
class NetworkCheck:
    problems: list[str] = dataclasses.field(default_factory=list)
    facts: list[str] = dataclasses.field(default_factory=list)


def check_network(cfg: RunConfig, *, backend: str) -> NetworkCheck:
    """The network checks of `cfg` (`backend`: the rollout engine it resolves to, for the listener table)."""
    out = NetworkCheck()
    placement = cfg.placement
    if placement.launcher == "local":
        return out
    try:
        token = read_token(placement.token_file, flag="--placement.token-file")
    except ValueError as err:
        out.problems.append(str(err))
        return out
    torchrun = placement.launcher == "torchrun"
    host = os.environ.get("MASTER_ADDR", placement.master_addr) if torchrun else placement.master_addr
    try:
        if torchrun:
            check_master(host, int(os.environ.get("GROUP_WORLD_SIZE", "1")))
        # the stores listen on the master's node only (torchrun: node 0); another node just reaches them
        head = not torchrun or os.environ.get("GROUP_RANK", "0") == "0"
        address = bind_address(host) if head else host
    except ValueError as err:
        out.problems.append(str(err).replace("--placement.master-addr", "MASTER_ADDR=" if torchrun
                                             else "--placement.master-addr").replace("= ", "="))
        return out
    try:
        interface, local = socket_interface(host, placement.interface)
    except ValueError as err:
        out.problems.append(str(err))
        return out
    if is_loopback(host):
        out.facts.append(f"network: every listener of asyncrl on loopback ({address})"
                         + ("" if torchrun else "; nothing exposed"))
    elif token is None and torchrun:
        out.problems.append(
            f"MASTER_ADDR={host} is not loopback: a torchrun job across hosts needs the same run "
            f"token on every node; export {TOKEN_ENV}=<16+ random characters> or give --placement.token-file")
        return out
    elif token is None:
        out.problems.append(
            f"--placement.master-addr {host} is not loopback: a run other hosts can reach needs a token you give "
            f"(the run never prints one); export {TOKEN_ENV}=$(python -c 'import secrets; "
            "print(secrets.token_hex(16))') here and on every agent's host, or give --placement.token-file FILE")
        return out
    else:
        out.facts.append(
            f"network: listening on {address} ({host}); every RPC message sealed with the run's token, the "
            "store's control records signed with it, agents admitted on its proof; gloo and NCCL are not "
            "authenticated, so only on a network you trust")
    out.facts += listener_table(cfg, address, interface, local, vllm=backend == "vllm")
    return out


def listener_table(cfg: RunConfig, address: str, interface: str, local: str, *, vllm: bool = False
                   ) -> list[str]:
    """What a run of `cfg` will listen on (`address`: its stores'; `interface` and `local`: every process's
    sockets), one line per kind of listener, for the checks' report."""
    p, torchrun = cfg.placement, cfg.placement.launcher == "torchrun"
    port = os.environ.get("MASTER_PORT", "MASTER_PORT")
    store = f"{address}:{int(port) + 1}" if torchrun and port.isdigit() else \
        f"{address}:{p.join_port or 'a free port'}"
    rpc = f"{address}:{int(port) + 2}" if torchrun and port.isdigit() else f"{address}:a free port"
    processes = len(p.trainer_devices) + (0 if cfg.async_training.colocated else len(p.agent_devices))
    cuda = any(d.startswith("cuda") for d in (*p.trainer_devices, *p.agent_devices))
    lines = [f"listen: the run's store {store} and the RPC group's store {rpc} (trainer rank 0)",
             f"listen: each of the {processes} processes, one TensorPipe (RPC) port and gloo's pairs (trainer group, "
             f"commands, CPU weight channels){' and NCCL' if cuda else ''} on {interface} ({local}), ports the "
             "kernel picks"]
    if vllm:
        lines.append(f"listen: each vLLM agent, vLLM's own store and workers (VLLM_HOST_IP {local})")
    if torchrun:
        lines.append(f"listen: torchrun's own store on every interface, port {port} (its static rendezvous binds no "
                     "address): on one host, the rpc launcher exposes nothing")
    return lines
