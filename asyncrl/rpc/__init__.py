"""The launchers and the transport: where the run's parts run and how calls and weights move between them.
The run's logic (queue, roster, agent loop, controller) is `asyncrl.runtime`, which knows no process; this
package runs it in one process or in many.

Both launchers: `spec` (what a run is made of, picklable), `assembly` (building it from the spec, the same for
both), `param_server` (weight publication). In one process: `local` (the trainer in this thread, each agent in a
thread of its own, no network). In many: `supervise` (the one-machine launcher and its supervision; `forkserver`,
how it starts its processes), `roles` (the process bodies), `torchrun` (the same roles under torchrun), `head`
(rank 0), `commands` (the trainer group), `fleet` (agents' admission), `agent_server` (an agent process's RPC
face), `channels` (weight transport; `ipc` its same-GPU path), `store` and `membership` (the run's control plane),
`exposure` (loopback binding, the run token), `worker_pool` (processes for synchronous user code).
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
