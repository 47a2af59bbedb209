"""Transport: who runs where and how bytes move. The only package that knows processes exist.

`queue` (admission, streaming, accounting), `roster` (agents' membership, liveness, fencing), `agent` (engine
loop), `controller` (the trainer's run loop), `param_server` (weight publication), `local` (in-process
launcher: threads); the multi-process run: `spec` (what it is made of), `assembly` (building it, both
launchers), `launch` (process bodies, torchrun), `supervise` (the launcher's supervision), `head` (rank 0),
`commands` (the trainer group), `fleet` (agents' admission), `agent_server`, `channels` (weight transport),
`store` and `membership` (the run's control plane), `lifecycle` (signals, parent death).
"""

from asyncrl.rpc.agent import RolloutAgent
from asyncrl.rpc.controller import Controller, RunSummary
from asyncrl.rpc.local import LocalRun
from asyncrl.rpc.queue import Ledger, QueueTimeout, SampleQueue, Task
from asyncrl.rpc.roster import Fenced, Roster

__all__ = ["SampleQueue", "Ledger", "Task", "QueueTimeout", "RolloutAgent", "Controller", "RunSummary", "LocalRun",
           "Roster", "Fenced"]
