"""The rollout agent's side of the multi-process run: `AgentServer`, the root object of an agent process.

Rank 0 creates it in the agent's process with `rpc.remote` when the process has joined the run (`Admissions`),
or in a trainer process for colocated placement. It builds the engine on the agent's device and the
`RolloutAgent` around it, then answers rank 0: `connect` (the agent's end of its weight channel), `prepare`
(reach a swappable state), `receive` (load the weights of one publication), `start` / `stop` the generation
loop, `window_metrics`, and `exit_process` at the end.

The agent talks back through `RemoteRoster`, RPCs with a timeout to the roster on rank 0. When the run fences
it (declared dead, e.g. after it was stopped for longer than `agent_timeout_s`), or its loop fails, the
process ends itself: nothing it does can be counted any more, and the launcher may start a fresh one.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time

import torch
import torch.distributed.rpc as rpc

from asyncrl.tracking.console import phase
from asyncrl.learner import memory_metrics
from asyncrl.runtime.agent import RolloutAgent, heartbeat_period
from asyncrl.rpc.assembly import build_engine, local_device
from asyncrl.rpc.channels import Layout, WeightChannel, numel, unflatten
from asyncrl.rpc.membership import leave_rpc
from asyncrl.runtime.roster import FENCED_EXIT, Fenced
from asyncrl.rpc.spec import RunSpec
from asyncrl.rpc.store import RunStore
from asyncrl.rpc.worker_pool import WorkerPool

USER_CODE_MODULES = ("asyncrl.data.scoring", "asyncrl.envs.isolated")
"""What a user-code worker imports before it takes calls (start-up never counts against a call's deadline)."""

__all__ = ["AgentServer", "RemoteRoster"]

log = logging.getLogger(__name__)


class RemoteRoster:
    """The run's roster as seen from an agent process: RPCs with a timeout. A call the roster refuses (this agent
    was declared dead or left: `Fenced` on rank 0, which torch's RPC hands back as a RuntimeError naming it), or
    that rank 0 cannot even attribute, raises `Fenced` here."""

    def __init__(self, rref: rpc.RRef, timeout: float):
        self.rref, self.timeout = rref, timeout

    def _call(self, method: str, *args):
        try:
            return getattr(self.rref.rpc_sync(timeout=self.timeout), method)(*args)
        except RuntimeError as err:
            text = str(err)
            if text.startswith(f"{Fenced.__name__}:"):
                said = re.search(r"Fenced\('(.*?)'\)", text)
                raise Fenced(said.group(1) if said else text.splitlines()[0]) from None
            if "could not find destination" in text:
                raise Fenced(f"agent {args[0]} was removed from the run (declared dead while it was silent)") from None
            raise

    def request(self, agent: str, n: int):
        return self._call("request", agent, n)

    def submit(self, agent: str, group) -> None:
        self._call("submit", agent, group)

    def submit_eval(self, agent: str, task, completions, rewards) -> None:
        self._call("submit_eval", agent, task, completions, rewards)

    def heartbeat(self, agent: str) -> None:
        self._call("heartbeat", agent)

    def evaluating(self, agent: str) -> bool:
        return self._call("evaluating", agent)

    def agent_failed(self, agent: str, why: str) -> None:
        self._call("agent_failed", agent, why)


class AgentServer:
    def __init__(self, spec: RunSpec, slot: int, name: str, device: str, roster: rpc.RRef, *,
                 hosted: bool = False):
        self.spec, self.name, self.hosted = spec, name, hosted
        agent_spec = spec.agent_spec(slot, device)
        self.device = torch.device(local_device(agent_spec.device))
        phase(f"{name}: loading the model and building its engine on {self.device}")
        loading = time.monotonic()
        engine = build_engine(spec, agent_spec, slot, name)
        backend = getattr(engine, "backend", type(engine).__name__)
        phase(f"{name}: {backend} engine ready in {time.monotonic() - loading:.1f} s")
        colocated = spec.async_.colocated and spec.async_.colocated_sleep
        # your synchronous rewards and environment steps run here, where a call that hangs can be killed
        self.workers = WorkerPool(spec.placement.user_code_workers, name=f"{name}-user-code", preload=USER_CODE_MODULES) \
            if spec.placement.user_code_workers > 0 else None
        self.agent = RolloutAgent(name, engine, spec.scorer_factory(workers=self.workers), spec.rollout,
                                  RemoteRoster(roster, spec.rpc_timeout_s), colocated=colocated,
                                  heartbeat_s=heartbeat_period(spec.async_.agent_timeout_s), on_exit=self._loop_ended,
                                  env=spec.env_setup(workers=self.workers) if spec.env_setup is not None else None,
                                  device=self.device)  # a vLLM engine of an HF directory has no model here
        self.channel: WeightChannel | None = None
        self._leaving = threading.Event()

    def ready(self) -> dict:
        return {"pid": os.getpid(), "device": str(self.device)}

    def connect(self, host: str, port: int, backend: str) -> bool:
        """The agent's end of its weight channel (rank 0 makes the other end at the same time)."""
        store = RunStore(host, port, serve=False, timeout_s=self.spec.async_.sync_timeout_s)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # an RPC thread: its current device is not the engine's
        self.channel = WeightChannel(store.raw, self.name, 1, backend=backend, device=self.device,
                                     timeout_s=self.spec.async_.agent_timeout_s)
        return True

    # ---------------------------------------------------------------------------- the generation loop
    def start(self) -> None:
        self.agent.start()

    def stop(self) -> dict:
        """Stop the loop (end of the run, or leaving it); report what the agent did."""
        self._leaving.set()
        self.agent.stop()
        if self.workers is not None:
            self.workers.close()
        return {"versions_seen": self.agent.versions_seen, "submitted": self.agent.submitted,
                "error": repr(self.agent.error) if self.agent.error else None}

    def window_metrics(self) -> dict:
        return {**self.agent.window_metrics(), **memory_metrics(self.device, "rollouter")}

    def _loop_ended(self, error: BaseException | None) -> None:
        if error is not None and not self._leaving.is_set() and not self.hosted:
            log.error("agent %s: the generation loop ended (%r); this process exits", self.name, error)
            self.exit_process(delay_s=0.5, code=FENCED_EXIT if isinstance(error, Fenced) else 1)

    def exit_process(self, delay_s: float = 0.2, code: int = 0) -> None:
        """End this agent process shortly after answering (the RPC that asked gets its reply first), with status
        `code`."""
        def leave():
            time.sleep(delay_s)
            if self.channel is not None:
                self.channel.abort()
            leave_rpc()
            os._exit(code)

        threading.Thread(target=leave, name="agent-exit", daemon=True).start()

    # ------------------------------------------------------------------------------- weight updates
    @rpc.functions.async_execution
    def prepare(self, partial: bool, timeout: float) -> torch.futures.Future:
        """Reach a swappable state without parking an RPC thread: the drain waits in a helper thread."""
        future: torch.futures.Future = torch.futures.Future()

        def work():
            try:
                self.agent.pause_for_sync(partial, timeout)
                future.set_result(True)
            except BaseException as err:  # noqa: BLE001 - returned to the caller
                future.set_exception(err)

        threading.Thread(target=work, daemon=True).start()
        return future

    def receive(self, version: int, layout: Layout, on_cuda: bool) -> float:
        """Receive the weight buckets rank 0 broadcasts on this agent's channel and load them; resume."""
        if self.channel is None:
            raise RuntimeError(f"agent {self.name} has no weight channel; rank 0 connects it at admission")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        start = time.perf_counter()
        buffer_device = self.device if on_cuda else torch.device("cpu")
        try:
            for bucket in layout:
                flat = torch.empty(sum(numel(shape) for _, shape, _ in bucket), dtype=getattr(torch, bucket[0][2]),
                                   device=buffer_device)
                self.channel.broadcast(flat)
                self.agent.load_weights(unflatten(flat, bucket), None)
                del flat
            self.agent.load_weights([], version)
        except BaseException:
            self.channel.abort()  # rank 0's broadcast of the next bucket fails now, not after its timeout
            raise
        self.agent.resume()
        return time.perf_counter() - start

    def load_local(self, named_tensors, version: int | None) -> None:
        """Colocated: the trainer in this very process copies weights in (no channel)."""
        self.agent.load_weights([(n, t.to(self.device)) for n, t in named_tensors], version)
        if version is not None:
            self.agent.resume()
