"""Transport: who runs where and how bytes move. The only package that knows processes exist.

`queue` (admission, streaming, accounting), `agent` (engine loop), `controller` (the trainer's run loop),
`param_server` (weight publication), `local` (in-process launcher: threads), `launch` (multi-process
launcher: torch.distributed.rpc + collectives).
"""

from asyncrl.rpc.agent import RolloutAgent
from asyncrl.rpc.controller import Controller, RunSummary
from asyncrl.rpc.local import LocalRun
from asyncrl.rpc.queue import Ledger, QueueTimeout, SampleQueue, Task

__all__ = ["SampleQueue", "Ledger", "Task", "QueueTimeout", "RolloutAgent", "Controller", "RunSummary", "LocalRun"]
