"""Per-peer sending that never blocks a compute or scheduler thread on a dead peer.

``Outbox.send(peer, kind, payload, on_error)`` sends at once on the caller's thread when the peer's
pooled connection is up and nothing is queued for it (the hot path: no thread hop per token);
otherwise it queues the message for the peer's sender thread, which dials with backoff. Either
way ``on_error`` gets the exception when the message cannot be delivered, and messages to one peer
keep their order.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.transport import Transport
from mlxcel.cluster.wire import FRAME_OVERHEAD, Kind

log = logging.getLogger("mlxcel.pipeline")

OnError = Callable[[BaseException], None]
_STOP = object()


HANDOFF_SWITCH_INTERVAL_S = 0.0005


def fast_handoffs() -> None:
    """Shorten the interpreter's thread switch interval (5 ms by default) for this process.

    Every decoded token crosses threads several times (transport reader -> MLX worker -> sender);
    a thread that waits for the GIL behind a busy one would otherwise wait up to 5 ms each time.
    """
    import sys

    sys.setswitchinterval(min(sys.getswitchinterval(), HANDOFF_SWITCH_INTERVAL_S))


class Outbox:
    """Per-peer FIFO delivery over one transport: direct when connected, else a sender thread."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._queues: dict[PeerId, queue.SimpleQueue] = {}
        self._pending: dict[PeerId, int] = {}  # messages queued for the sender thread, per peer
        self._conns: dict[PeerId, Any] = {}  # established connections the hot path may use
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self.frames = 0
        self.bytes = 0

    def send(self, peer: PeerId, kind: Kind, payload: bytes, on_error: OnError | None = None,
             wanted: Callable[[], bool] | None = None) -> None:
        """Send or queue a message; ``wanted`` (checked just before sending) drops one that went stale."""
        with self._lock:
            if self._closed:
                return
            conn = self._conns.get(peer)
            direct = conn is not None and conn.alive and not self._pending.get(peer)
            if not direct:
                self._enqueue(peer, (kind, payload, on_error, wanted))
                return
        self._deliver(peer, conn, kind, payload, on_error)

    def _enqueue(self, peer: PeerId, item: tuple) -> None:
        q = self._queues.get(peer)
        if q is None:
            q = self._queues[peer] = queue.SimpleQueue()
            t = threading.Thread(target=self._run, args=(peer, q), name=f"mlxcel-outbox-{peer}", daemon=True)
            self._threads.append(t)
            t.start()
        self._pending[peer] = self._pending.get(peer, 0) + 1
        q.put(item)

    def _deliver(self, peer: PeerId, conn: Any, kind: Kind, payload: bytes, on_error: OnError | None) -> None:
        try:
            conn.send(kind, payload)
            self.frames += 1
            self.bytes += len(payload) + FRAME_OVERHEAD
        except Exception as exc:  # noqa: BLE001 - reported to the owner of the message
            log.debug("cannot send to %s: %s", peer, exc)
            if on_error is not None:
                try:
                    on_error(exc)
                except Exception:  # noqa: BLE001
                    log.exception("send-failure handler failed")

    def _run(self, peer: PeerId, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is _STOP:
                return
            kind, payload, on_error, wanted = item
            try:
                if wanted is None or wanted():
                    try:
                        conn = self.transport.connection(peer)  # dials with backoff when needed
                    except Exception as exc:  # noqa: BLE001
                        conn = _Failed(exc)
                    self._deliver(peer, conn, kind, payload, on_error)
                    if isinstance(conn, _Failed):
                        continue
                    with self._lock:
                        self._conns[peer] = conn
            finally:
                with self._lock:
                    self._pending[peer] -= 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queues = list(self._queues.values())
        for q in queues:
            q.put(_STOP)
        for t in self._threads:
            t.join(2.0)


class _Failed:
    """A connection that could not be made: sending on it raises why."""

    alive = False

    def __init__(self, exc: BaseException):
        self.exc = exc

    def send(self, kind: Kind, payload: bytes) -> None:
        raise self.exc
