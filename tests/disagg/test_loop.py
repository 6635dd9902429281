"""LoopThread.close ends what still runs on the loop: an endless task is cancelled, not destroyed pending."""

from __future__ import annotations

import asyncio
import gc
import threading

from mlxcel.disagg.loop import LoopThread


def test_close_cancels_an_endless_task_before_closing_the_loop(recwarn):
    loop, started, ended = LoopThread("test-loop"), threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            while True:
                await asyncio.sleep(3600)
        finally:
            ended.set()

    loop.submit(forever())
    assert started.wait(5)
    loop.close()
    assert ended.is_set() and loop.loop.is_closed()  # cancelled by close, not left for the collector
    gc.collect()
    assert not [w for w in recwarn if "destroyed" in str(w.message)]
    loop.close()  # a second close does nothing
