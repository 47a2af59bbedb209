"""Transport: who runs where and how bytes move. The only package that knows processes exist; the run's logic
(queue, roster, agent loop, controller) is `asyncrl.runtime`.

`local` (in-process launcher: agents in threads); the multi-process run: `spec` (what it is made of),
`assembly` (building it, both launchers), `launch` (process bodies, torchrun), `supervise` (the one-machine
launcher and its supervision), `head` (rank 0), `commands` (the trainer group), `fleet` (agents' admission),
`agent_server` (an agent process's RPC face), `param_server` (weight publication), `channels` (weight
transport; `ipc` its same-GPU path), `store` and `membership` (the run's control plane), `exposure` (loopback
binding, the run token), `worker_pool` (processes for synchronous user code).
"""

import importlib

_HOMES = {"LocalRun": "local", "RunSpec": "spec", "AgentSpec": "spec", "ModelSpec": "spec"}

__all__ = ["LocalRun", "RunSpec", "AgentSpec", "ModelSpec"]


def __getattr__(name: str):
    """The package's names, imported when first used: a process that needs one module of the package (a
    user-code worker needs `worker_pool`) does not pay for all of them."""
    if name not in _HOMES:
        raise AttributeError(f"module 'asyncrl.rpc' has no attribute {name!r}")
    return getattr(importlib.import_module(f"asyncrl.rpc.{_HOMES[name]}"), name)
