"""An asyncio event loop on its own thread, for services whose inputs arrive on transport threads.

The scheduler's ``EventStream`` belongs to an event loop; a prefill or decode node has no HTTP API to
lend one, so it runs this loop and hands work to it from the transport's reader threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Awaitable, Callable


class LoopThread:
    """``submit(coro)`` schedules a coroutine; ``call(fn)`` runs a function on the loop and returns its result."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Awaitable[Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = 10.0) -> Any:
        async def run() -> Any:
            return fn(*args)

        return self.submit(run()).result(timeout)

    def soon(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            pass

    def close(self) -> None:
        """Cancel what still runs on the loop (a service's endless keepalive, say), then stop and close it."""
        if self.loop.is_closed():
            return
        if threading.current_thread() is not self._thread:
            try:
                self.submit(_cancel_the_others()).result(2.0)
            except (concurrent.futures.TimeoutError, RuntimeError):
                pass  # stopping below still ends the loop
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self.loop.is_running():
            self.loop.close()


async def _cancel_the_others() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
