"""Open exchanges: nonce -> waiter, with an absolute deadline and the sender expected to answer.

An *exchange* is one request whose answer arrives later as a separate message, possibly from
another peer than the one asked (a pipeline step enters at the first stage and its result comes
back from the last). The cluster's RPC (``Transport.request``) covers the one-connection case;
this table covers the rest, for the pipeline coordinator and the disaggregated router alike:

* ``open`` registers a fresh nonce with its absolute deadline, the peer(s) allowed to answer,
  a caller ``context`` and an optional continuation ``then`` (run once, on resolution);
* ``resolve`` ends an exchange exactly once, with a reply or an error; later answers for the
  same nonce find nothing (a nonce is used once);
* a ticker thread fails exchanges whose deadline passed with the error ``on_expired`` makes;
* ``wait`` blocks a caller until resolution or its own timeout.

No MLX, no sockets: the caller sends and receives; the table only keeps time and state.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

from .identity import PeerId

TICK_S = 0.05  # how often deadlines are checked


def new_nonce() -> str:
    """A fresh, unpredictable 64-bit exchange nonce as 16 hex digits."""
    return os.urandom(8).hex()


@dataclass(eq=False)
class Exchange:
    """One open exchange. ``senders`` is who may answer (empty: decided by the caller)."""

    nonce: str
    deadline: float
    senders: Collection[PeerId] = ()
    context: Any = None
    then: Callable[["Exchange"], None] | None = None
    event: threading.Event = field(default_factory=threading.Event)
    reply: Any = None
    error: BaseException | None = None

    def accepts(self, peer: PeerId) -> bool:
        return not self.senders or peer in self.senders


class ExchangeTable:
    """The open exchanges of one node; thread-safe."""

    def __init__(self, on_expired: Callable[[Exchange], BaseException], *, tick_s: float = TICK_S,
                 on_tick: Callable[[float], None] | None = None, name: str = "mlxcel-exchanges"):
        self._open: dict[str, Exchange] = {}
        self._lock = threading.Lock()
        self._on_expired = on_expired
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._closing = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name=name, daemon=True)

    def start(self) -> None:
        """Start checking deadlines (and calling ``on_tick``) every ``tick_s``."""
        self._ticker.start()

    def open(self, timeout: float, *, senders: Collection[PeerId] = (), context: Any = None,
             then: Callable[[Exchange], None] | None = None) -> Exchange:
        ex = Exchange(new_nonce(), time.monotonic() + timeout, senders, context, then)
        with self._lock:
            self._open[ex.nonce] = ex
        return ex

    def get(self, nonce: str) -> Exchange | None:
        with self._lock:
            return self._open.get(nonce)

    def is_open(self, nonce: str) -> bool:
        with self._lock:
            return nonce in self._open

    def where(self, predicate: Callable[[Exchange], bool]) -> list[Exchange]:
        with self._lock:
            return [ex for ex in self._open.values() if predicate(ex)]

    def resolve(self, ex: Exchange, *, reply: Any = None, error: BaseException | None = None) -> bool:
        """End ``ex`` once: wake its waiter and run its continuation. False if already ended."""
        with self._lock:
            if self._open.pop(ex.nonce, None) is None:
                return False
        ex.reply, ex.error = reply, error
        ex.event.set()
        if ex.then is not None:
            ex.then(ex)
        return True

    def fail(self, nonce: str, error: BaseException) -> None:
        ex = self.get(nonce)
        if ex is not None:
            self.resolve(ex, error=error)

    def wait(self, ex: Exchange, timeout: float) -> bool:
        """Wait for ``ex``; on timeout it is forgotten (a late answer finds nothing) and False returned."""
        if ex.event.wait(timeout):
            return True
        with self._lock:
            gone = self._open.pop(ex.nonce, None) is None
        if gone:  # resolved just now, on another thread: its event is about to be set
            ex.event.wait()
        return gone

    def close(self, error: Callable[[Exchange], BaseException]) -> None:
        """Stop the ticker and fail every open exchange."""
        self._closing.set()
        for ex in self.where(lambda _: True):
            self.resolve(ex, error=error(ex))

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def _tick(self) -> None:
        while not self._closing.wait(self._tick_s):
            now = time.monotonic()
            for ex in self.where(lambda e: e.deadline <= now):
                self.resolve(ex, error=self._on_expired(ex))
            if self._on_tick is not None:
                self._on_tick(now)
