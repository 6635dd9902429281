"""The connecting side: pooled outbound connections per peer, dialled with backoff.

A peer's connections are its *lanes*: lane 0 carries everything by default; a sender that
wants several large streams to one peer in flight at once (the KV handoffs of a prefill node,
docs/disagg.md §4) asks for lanes 1, 2, ...: each is its own connection, with its own reader
thread, AEAD keys and socket, so their copies and crypto run side by side.

A dial retries a refused connect, a close before the server sent any record (a full
pending pool closes at accept) and the at-capacity verdict
(``HandshakeError.retryable``) with exponential backoff, for ``max_reconnect_attempts``
retries and at least ``dial_budget`` seconds; every other handshake failure is
terminal.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

from .connection import Connection
from .errors import HandshakeError, PeerUnreachable, ServerAtCapacity, TransportClosed
from .handshake import ClientHandshake, Established
from .identity import PeerId
from .options import TransportOptions
from .ratelimit import RateLimitedLog, WarnClass
from .secret import ClusterSecret
from .socket_handshake import client_handshake
from .sockets import family, set_send_timeout, tune

log = logging.getLogger("mlxcel.cluster.transport")

MakeConnection = Callable[[socket.socket, PeerId, Established], Connection]


class Pool:
    """Outbound connections of one transport, keyed by peer identity and lane."""

    def __init__(
        self,
        secret: ClusterSecret,
        options: TransportOptions,
        warnings: RateLimitedLog,
        closing: threading.Event,
        make_connection: MakeConnection,
    ) -> None:
        self._secret, self.options, self.warnings = secret, options, warnings
        self._closing, self._make_connection = closing, make_connection
        self._lock = threading.Lock()
        self._conns: dict[tuple[PeerId, int], Connection] = {}
        self._dial_locks: dict[tuple[PeerId, int], threading.Lock] = {}

    def get(self, peer: PeerId, lane: int = 0) -> Connection | None:
        """The live pooled connection to ``peer`` on ``lane``, if any (no dialling)."""
        conn = self._conns.get((peer, lane))
        return conn if conn is not None and conn.alive else None

    def discard(self, conn: Connection) -> None:
        """Forget a closed connection (the next acquire of its lane dials again)."""
        with self._lock:
            for key in [k for k, c in self._conns.items() if c is conn]:
                del self._conns[key]

    def acquire(self, peer: PeerId, identity: PeerId, lane: int = 0) -> Connection:
        """The pooled connection to ``peer`` on ``lane``, dialled (as ``identity``) when needed."""
        if self._closing.is_set():
            raise TransportClosed("transport is closed")
        if lane < 0:
            raise ValueError(f"a lane is a number from 0, not {lane}")
        key = (peer, lane)
        conn = self._conns.get(key)
        if conn is not None and conn.alive:
            return conn
        with self._lock:
            dial_lock = self._dial_locks.setdefault(key, threading.Lock())
        with dial_lock:
            conn = self._conns.get(key)
            if conn is not None and conn.alive:
                return conn
            conn = self._dial_with_backoff(peer, identity)
            with self._lock:
                if self._closing.is_set():
                    conn.close()
                    raise TransportClosed("transport is closed")
                self._conns[key] = conn
            conn.start()
            return conn

    def _dial_with_backoff(self, peer: PeerId, identity: PeerId) -> Connection:
        """Retry retryable failures for ``max_reconnect_attempts`` retries and at least
        ``dial_budget`` seconds, whichever ends later."""
        opts = self.options
        start = time.monotonic()
        deadline = start + opts.dial_budget
        attempt = 0
        while True:
            try:
                return self._dial(peer, identity)
            except HandshakeError as exc:
                if not exc.retryable:
                    raise
                last: BaseException = exc
            except OSError as exc:
                last = exc
            attempt += 1
            left = deadline - time.monotonic()
            if attempt > opts.max_reconnect_attempts and left <= 0:
                break
            delay = min(opts.reconnect_base_delay * 2 ** (attempt - 1), opts.reconnect_max_delay)
            if attempt > opts.max_reconnect_attempts:
                delay = min(delay, left)  # the last retry lands on the deadline
            if isinstance(last, ServerAtCapacity):
                self.warnings.warning(WarnClass.AT_CAPACITY, "cluster peer %s is at capacity; retrying in %.2fs (attempt %d)", peer, delay, attempt)
            if self._closing.wait(delay):
                raise TransportClosed("transport is closed")
        elapsed = time.monotonic() - start
        raise PeerUnreachable(f"cannot reach cluster peer {peer} after {attempt} attempts in {elapsed:.1f}s: {last}") from last

    def _dial(self, peer: PeerId, identity: PeerId) -> Connection:
        opts = self.options
        sock = socket.socket(family(peer.host), socket.SOCK_STREAM)
        try:
            if opts.bind_outbound and not identity.ip.is_unspecified and family(identity.host) == family(peer.host):
                sock.bind((identity.host, 0))
            tune(sock, opts)
            sock.settimeout(opts.connect_timeout)
            sock.connect(peer.address)
            hs = ClientHandshake(self._secret, identity, suite=opts.suite, channel=opts.channel)
            est = client_handshake(sock, hs, opts.handshake_timeout)
            set_send_timeout(sock, opts.send_timeout)
        except BaseException:
            sock.close()
            raise
        log.debug("connected to cluster peer %s", peer)
        return self._make_connection(sock, peer, est)

    def drop(self, peer: PeerId) -> int:
        """Close every lane's connection to ``peer`` (the next acquire dials afresh); returns how many."""
        with self._lock:
            conns = [c for (p, _), c in self._conns.items() if p == peer]
        for conn in conns:
            conn.close()
        return len(conns)

    def close_all(self) -> list[threading.Thread]:
        """Close every pooled connection; returns their reader threads to join."""
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.close()
        return [c.thread for c in conns if c.thread is not None]
