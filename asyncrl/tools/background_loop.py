"""An asyncio event loop in a daemon thread: where async reward functions and environment steps run, so the
generation loop that submits them never waits.

    loop = BackgroundLoop(max_concurrency=16, name="asyncrl-rewards")
    future = loop.submit(coroutine)      # a concurrent.futures.Future; poll future.done()
    loop.stop()                          # cancels what is still running

A coroutine that runs blocking code (`time.sleep`, a long computation) stalls every other call on the loop
and cannot be cut off by its timeout (a timeout is itself an event of the loop). A watchdog thread notices
when the loop has not turned for `blocked_warn_s` and names the code that holds it (function, file:line), once
per stall; `stalls` counts them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time

__all__ = ["BackgroundLoop"]

log = logging.getLogger(__name__)


class BackgroundLoop:
    """One asyncio event loop running forever in a daemon thread, with a limit on the calls in flight."""

    def __init__(self, max_concurrency: int, name: str = "asyncrl-loop", *, blocked_warn_s: float = 5.0):
        self.name, self.blocked_warn_s = name, blocked_warn_s
        self.loop = asyncio.new_event_loop()
        self.semaphore = asyncio.Semaphore(max_concurrency)  # binds to the loop on first use (Python >= 3.10)
        self.stalls = 0
        """Times the loop was held longer than `blocked_warn_s` by one piece of code."""
        self._turned = time.monotonic()
        self._stopped = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()
        self.loop.call_soon_threadsafe(self._turn)
        threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True).start()

    def submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is still running, stop the loop and close it."""

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._stopped.set()
        try:
            self.submit(cancel_all()).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
            if not self.thread.is_alive():
                self.loop.close()

    # ------------------------------------------------------------------------------------------ watchdog
    def _turn(self) -> None:
        """Runs on the loop a few times a second: the loop is turning."""
        self._turned = time.monotonic()
        if not self._stopped.is_set():
            self.loop.call_later(self.blocked_warn_s / 10, self._turn)

    def _watch(self) -> None:
        named = False  # this stall was named already
        while not self._stopped.wait(self.blocked_warn_s / 5):
            held = time.monotonic() - self._turned
            if held <= self.blocked_warn_s:
                named = False
            elif not named:
                named = True
                self.stalls += 1
                log.warning("%s: the event loop has been blocked for %.1f s by %s; a coroutine is running blocking "
                            "code, which stalls every other call and cannot be cut off by its timeout: make it "
                            "await (asyncio.to_thread for sync work) or make the function sync (it then runs in a "
                            "worker process that can be stopped)", self.name, held, self.holder())

    def holder(self) -> str:
        """The code the loop's thread is running now: 'function (file:line)'."""
        frame = sys._current_frames().get(self.thread.ident)
        if frame is None:
            return "unknown code"
        return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
