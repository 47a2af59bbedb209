"""An asyncio event loop in a daemon thread: where async reward functions and environment steps run, so the
generation loop that submits them never waits.

    loop = BackgroundLoop(max_concurrency=16, name="asyncrl-rewards")
    future = loop.submit(coroutine)      # a concurrent.futures.Future; poll future.done()
    loop.stop()                          # cancels what is still running
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

__all__ = ["BackgroundLoop"]


class BackgroundLoop:
    """One asyncio event loop running forever in a daemon thread, with a limit on the calls in flight."""

    def __init__(self, max_concurrency: int, name: str = "asyncrl-loop"):
        self.loop = asyncio.new_event_loop()
        self.semaphore = asyncio.Semaphore(max_concurrency)  # binds to the loop on first use (Python >= 3.10)
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what is still running, stop the loop and close it."""

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(cancel_all()).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
            if not self.thread.is_alive():
                self.loop.close()
