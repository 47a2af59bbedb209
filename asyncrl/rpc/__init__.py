"""Transport: who runs where and how bytes move. The only package that knows processes exist.

`queue` (admission, streaming, accounting), `roster` (agents' membership, liveness, fencing), `agent` (engine
loop), `controller` (the trainer's run loop), `param_server` (weight publication), `local` (in-process
launcher: threads); the multi-process run: `spec` (what it is made of), `assembly` (building it, both
launchers), `launch` (process bodies, torchrun), `supervise` (the one-machine launcher and its supervision),
`head` (rank 0), `commands` (the trainer group), `fleet` (agents' admission), `agent_server`, `channels` (weight
transport), `store` and `membership` (the run's control plane), `lifecycle` (signals, parent death).
"""

import importlib

_HOMES = {"RolloutAgent": "agent", "Controller": "controller", "RunSummary": "controller", "LocalRun": "local",
          "Ledger": "queue", "QueueTimeout": "queue", "SampleQueue": "queue", "Task": "queue", "Fenced": "roster",
          "Roster": "roster"}

__all__ = ["SampleQueue", "Ledger", "Task", "QueueTimeout", "RolloutAgent", "Controller", "RunSummary", "LocalRun",
           "Roster", "Fenced"]


def __getattr__(name: str):
    """The package's names, imported when first used: a process that needs one module of the package (a
    user-code worker needs `worker_pool`) does not pay for all of them."""
    if name not in _HOMES:
        raise AttributeError(f"module 'asyncrl.rpc' has no attribute {name!r}")
    return getattr(importlib.import_module(f"asyncrl.rpc.{_HOMES[name]}"), name)
