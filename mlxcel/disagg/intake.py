"""Handoff parts off the transport's reader thread: ordered per stream, a few streams at once.

A transport delivers a connection's messages on its reader thread, which also receives the next
frames (and, with crypto helpers, waits for their opens). When the decode node copied a handoff's
chunk into its tensors on that thread, the copy and the next receive ran one after the other.
``Intake`` runs the handler on a worker instead: the parts of one stream on one worker, in arrival
order (so a stream's decoder sees them as sent); streams spread over the workers by their key.
Each worker's queue is bounded (``DEPTH`` parts), so a reader that gets ahead blocks, as it did
inside the handler: a fast sender cannot make the node buffer more than ``DEPTH`` parts per worker.
With 0 workers (the default below 4 usable cores, where a second busy thread only competes) the
handler runs on the caller's thread, as before.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Hashable

from mlxcel.cluster.aead_pipeline import usable_cores
from mlxcel import envs

log = logging.getLogger("mlxcel.disagg.intake")

#: parts one worker holds queued before the reader that feeds it blocks
DEPTH = 8


def default_workers(cores: int | None = None) -> int:
    """0 below 4 usable cores, else a quarter of them, at most 4 (MLXCEL_HANDOFF_INTAKE_WORKERS overrides, 0..64;
    anything else is refused by mlxcel/envs.py, naming it)."""
    value = envs.settings().handoff_intake_workers
    if value is not None:
        return int(value)
    cores = usable_cores() if cores is None else cores
    return 0 if cores < 4 else min(4, cores // 4)


class Intake:
    """``put(key, fn, *args)`` runs ``fn(*args)`` after every earlier ``put`` of the same ``key``."""

    def __init__(self, workers: int, name: str = "mlxcel-handoff-intake"):
        self.workers = workers
        self._queues: list[queue.Queue] = [queue.Queue(DEPTH) for _ in range(workers)]
        self._threads = [threading.Thread(target=self._work, args=(q,), name=f"{name}-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        self._closed = False
        for t in self._threads:
            t.start()

    def put(self, key: Hashable, fn: Callable[..., Any], *args: Any) -> None:
        if not self._queues or self._closed:
            fn(*args)
            return
        self._queues[hash(key) % len(self._queues)].put((fn, args))

    @staticmethod
    def _work(q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one part's handler failing must not stop the worker
                log.exception("handoff intake: a handler failed")

    def close(self) -> None:
        """Stop the workers once their queued parts ran; idempotent."""
        if self._closed:
            return
        self._closed = True
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5.0)
