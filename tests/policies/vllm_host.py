"""A `VLLMEngine` in a child process, called method by method from a test.

vLLM changes process-wide settings when it builds its worker (it replaces `torch.set_num_threads`, binds
OpenMP threads), so the engine lives in a process of its own, as it does in an agent, and pytest's process is
left as it was. Calls and their results (or exceptions) travel over a pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

from tests.timing import limit


def _serve(conn, model_path, config, options) -> None:
    try:
        import os

        import torch

        from tests.run_helpers import VLLM_ONE_THREAD
        os.environ.update(VLLM_ONE_THREAD)  # its docstring says why
        torch.set_num_threads(1)
        from asyncrl.policies import load_model
        from asyncrl.policies.model_directory import ModelDirectory
        from asyncrl.policies.vllm_engine import build_vllm_engine
        model = model_path if isinstance(model_path, ModelDirectory) else load_model(model_path)
        engine = build_vllm_engine(model, config, agent="test", options=options)
        del model
        conn.send(("ok", None))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{err!r}\n{traceback.format_exc()}"))
        return
    while True:
        method, args, kwargs = conn.recv()
        if method == "close":
            return
        try:
            if callable(method):  # a module-level function of the test's, run here on the engine
                result = method(engine, *args, **kwargs)
            else:
                target = getattr(engine, method)
                result = target(*args, **kwargs) if callable(target) else target
            conn.send(("ok", result))
        except Exception as err:  # noqa: BLE001 - raised again in the test
            conn.send(("raised", err))


class EngineHost:
    """`host.call("add_request", prompt, params)`, `host.call("version")` (an attribute), or
    `host.call(fn, *args)`: `fn(engine, *args)` run in the engine's process (`fn` at module level). The engine is
    built from `model_path` (loaded with `load_model`) or from a `ModelDirectory` (vLLM loads the directory)."""

    def __init__(self, model_path="smollm2", *, max_slots: int = 16, max_len: int = 256, options=None,
                 lora_rank: int = 0, lora_alpha: float = 0.0, lora_targets: tuple[str, ...] | None = None):
        from asyncrl.config import VLLMConfig
        from asyncrl.policies import EngineConfig
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        config = EngineConfig(max_slots=max_slots, max_len=max_len, lora_rank=lora_rank, lora_alpha=lora_alpha,
                              **({"lora_targets": lora_targets} if lora_targets else {}))
        args = (child, model_path, config, options or VLLMConfig())
        self.process = ctx.Process(target=_serve, args=args)  # not daemonic: vLLM may start worker processes
        self.process.start()
        status, detail = self._receive(limit(600))
        if status != "ok":
            raise RuntimeError(f"the vLLM engine did not start: {detail}")

    def _receive(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer from the vLLM engine process within {timeout:.0f} s")
        return self.conn.recv()

    def call(self, method, *args, **kwargs):
        self.conn.send((method, args, kwargs))
        status, result = self._receive(limit(600))
        if status == "raised":
            raise result
        return result

    def close(self) -> None:
        try:
            self.conn.send(("close", (), {}))
        except OSError:
            pass
        self.process.join(limit(30))
        if self.process.is_alive():
            self.process.kill()
