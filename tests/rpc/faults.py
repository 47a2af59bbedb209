"""Faults injected into rollout agents through their engine (`AgentSpec.engine_factory`, or wrapping the
engines of an in-process run): a slower device, a process that dies, a loop that hangs. Picklable, so they
reach the spawned agent processes; the production types carry no test switches."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

from asyncrl.policies.engine import Engine


class EngineWrapper:
    """Forwards everything to the wrapped engine; subclasses change `step`."""

    def __init__(self, engine):
        self.__dict__["inner"] = engine

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def step(self):
        return self.inner.step()


class SlowEngine(EngineWrapper):
    """Every step takes `delay_s` longer (a slower device)."""

    def __init__(self, engine, delay_s: float):
        super().__init__(engine)
        self.__dict__["delay_s"] = delay_s

    def step(self):
        out = self.inner.step()
        time.sleep(self.delay_s)
        return out


class FailingEngine(EngineWrapper):
    """After `after` finished prompts: `kill` SIGKILLs its own process; `hang` blocks the generation loop
    forever (no heartbeats either); `raise` raises from step()."""

    def __init__(self, engine, after: int, mode: str):
        super().__init__(engine)
        self.__dict__.update(after=after, mode=mode, finished=0)

    def step(self):
        out = self.inner.step()
        self.__dict__["finished"] = self.finished + len(out)
        if self.finished >= self.after:
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.mode == "hang":
                threading.Event().wait()
            else:
                raise RuntimeError("injected: engine crashed")
        return out


class FailingBucketEngine(EngineWrapper):
    """Loads weights normally until it holds version `after`; then the first bucket of the next publication
    (a call without a version: the version comes with the last call) raises halfway through the transfer."""

    def __init__(self, engine, after: int):
        super().__init__(engine)
        self.__dict__["after"] = after

    def update_weights(self, named_tensors, version=None, **kw):
        if version is None and self.inner.version >= self.after:
            raise RuntimeError("injected: a weight bucket failed to load")
        return self.inner.update_weights(named_tensors, version, **kw)


@dataclasses.dataclass
class FaultyEngines:
    """An engine factory for `AgentSpec.engine_factory`: `mode` ("slow", "kill", "hang", "raise", "bucket")
    applies to the agents named in `agents` (all when empty); the others get the plain engine, slowed by
    `delay_s`. "bucket": a weight bucket fails once the engine holds version `after`."""

    mode: str = "slow"
    after: int = 3
    delay_s: float = 0.0
    agents: tuple[str, ...] = ()

    def __call__(self, model, config, *, agent: str):
        engine = Engine(model, config)
        if self.delay_s:
            engine = SlowEngine(engine, self.delay_s)
        if self.mode == "bucket" and (not self.agents or agent in self.agents):
            engine = FailingBucketEngine(engine, self.after)
        elif self.mode != "slow" and (not self.agents or agent in self.agents):
            engine = FailingEngine(engine, self.after, self.mode)
        return engine
