"""The parameter server side of a weight publication: gather the trainer's full weights once, bring every
agent to a swappable state, hand them the weights, resume them.

Two transports behind one `publish(state, version) -> metrics`:
* `LocalPublisher` — agents in this process (threads, the in-process launcher): weights are copied
  tensor by tensor into each engine (`copy_`, across devices if needed);
* `CollectivePublisher` (`asyncrl.rpc.launch`) — agents in other processes: weights travel in flat
  buckets over a torch.distributed group per agent (NCCL on GPU, gloo on CPU), the agent side driven by RPC.
A sync that fails is retried once; if it fails again the agent is reported (named) and left out.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from asyncrl.learner import LearnerState, full_weights

__all__ = ["WeightPublisher", "AgentSet", "LocalPublisher", "SyncFailed"]

log = logging.getLogger("asyncrl.param_server")


class SyncFailed(RuntimeError):
    """A weight sync to an agent failed twice."""

    def __init__(self, agent: str, cause: BaseException):
        super().__init__(f"weight sync to agent {agent!r} failed twice: {cause!r}")
        self.agent = agent


class WeightPublisher(Protocol):
    def publish(self, state: LearnerState, version: int) -> dict: ...

    def remove(self, agent: str) -> None: ...

    @property
    def agents(self) -> list[str]: ...


class AgentSet:
    """The agents a publisher still serves, by name (a failed one is removed and never synced again)."""

    def __init__(self, agents: dict):
        self._agents = dict(agents)

    @property
    def agents(self) -> list[str]:
        return list(self._agents)

    def remove(self, agent: str) -> None:
        self._agents.pop(agent, None)


class LocalPublisher(AgentSet):
    """Publishes to `RolloutAgent`s living in this process."""

    def __init__(self, agents: list, *, partial_rollout: bool, timeout: float, dtype: torch.dtype | None = None):
        super().__init__({a.name: a for a in agents})
        self.partial, self.timeout, self.dtype = partial_rollout, timeout, dtype

    def publish(self, state: LearnerState, version: int) -> dict:
        start = time.perf_counter()
        weights = [(n, t) for n, t in full_weights(state.policy, dtype=self.dtype)]
        gathered = time.perf_counter()
        for agent in list(self._agents.values()):
            if self.partial:
                agent.engine.pause("keep")
            else:
                agent.accepting = False
                agent.engine.pause("wait")  # all agents drain at once
        failed: list[SyncFailed] = []
        for name, agent in list(self._agents.items()):
            for attempt in (1, 2):
                try:
                    agent.pause_for_sync(self.partial, self.timeout)
                    agent.load_weights(weights, version)
                    agent.resume()
                    break
                except Exception as err:  # noqa: BLE001 - reported below, named
                    log.error("weight sync to agent %s failed (attempt %d): %r", name, attempt, err)
                    if attempt == 2:
                        failed.append(SyncFailed(name, err))
                        self.remove(name)
        if failed and not self._agents:
            raise failed[0]
        done = time.perf_counter()
        return {"timing_s/param_sync": done - start, "timing_s/param_gather": gathered - start,
                "fully_async/sync_failures": len(failed)}
