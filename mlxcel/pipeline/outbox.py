"""Per-peer sender threads: a compute or scheduler thread never blocks on a slow or dead peer.

``Outbox.send(peer, kind, payload, on_error)`` queues the message; the peer's thread sends it over
the transport's pooled connection (dialling with backoff when needed) and calls ``on_error`` with
the exception when it cannot be delivered.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import Kind

log = logging.getLogger("mlxcel.pipeline")

OnError = Callable[[BaseException], None]
_STOP = object()
FRAME_OVERHEAD = 21  # kind (1) + len (4) + AES-GCM tag (16): one frame per message below the chunk size


class Outbox:
    """One FIFO sender thread per peer over one transport."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._queues: dict[PeerId, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self.frames = 0
        self.bytes = 0

    def send(self, peer: PeerId, kind: Kind, payload: bytes, on_error: OnError | None = None,
             wanted: Callable[[], bool] | None = None) -> None:
        """Queue a message; ``wanted`` (checked just before sending) drops one that went stale in the queue."""
        with self._lock:
            if self._closed:
                return
            q = self._queues.get(peer)
            if q is None:
                q = self._queues[peer] = queue.SimpleQueue()
                t = threading.Thread(target=self._run, args=(peer, q), name=f"mlxcel-outbox-{peer}", daemon=True)
                self._threads.append(t)
                t.start()
        q.put((kind, payload, on_error, wanted))

    def _run(self, peer: PeerId, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is _STOP:
                return
            kind, payload, on_error, wanted = item
            if wanted is not None and not wanted():
                continue
            try:
                self.transport.send(peer, kind, payload)
                self.frames += 1
                self.bytes += len(payload) + FRAME_OVERHEAD
            except Exception as exc:  # noqa: BLE001 - reported to the owner of the message
                log.debug("cannot send to %s: %s", peer, exc)
                if on_error is not None:
                    try:
                        on_error(exc)
                    except Exception:  # noqa: BLE001
                        log.exception("send-failure handler failed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queues = list(self._queues.values())
        for q in queues:
            q.put(_STOP)
        for t in self._threads:
            t.join(2.0)
