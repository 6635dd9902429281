"""Blocking-socket cluster transport: a thread per connection over the sans-I/O core.

``Transport(identity, secret)`` is one node: ``serve(on_message, on_request)`` starts
its listener (authenticated-connection cap, pending-handshake pool, 5 s handshake
timeout); ``send``/``request``/``open_stream`` use pooled outbound connections
dialled with exponential backoff.  Every connection, inbound or outbound, runs the
handshake (docs/protocol.md) and then carries frames sealed under its own keys; a
reader thread per connection opens frames, reassembles messages and calls the
handler with the peer identity the handshake authenticated.

Handlers run on the connection's reader thread, in frame order: a slow handler
delays later messages of that connection only, so hand heavy work (MLX) to a worker
thread.  A handler may send (the echo and reply patterns do), but two nodes whose
handlers send large messages to each other at the same time can fill both socket
buffers; hand such sends to a worker thread (a stalled send fails after
``send_timeout``).  Blocking sockets with a thread per connection measured 2-4x
faster than asyncio streams on this machine.

The parts: ``socket_handshake`` (handshake I/O), ``reader`` (frame reading),
``connection`` (one connection, streams), ``rpc`` (waiters, typed errors), ``listener`` (accept,
pending pool, admission), ``pool`` (dialler and outbound pool).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
from dataclasses import replace
from typing import Callable, Iterable

from .attribution import check_suite
from .connection import Connection, StreamWriter
from .errors import LocalProtocolError, PeerUnreachable, RequestError, ServerAtCapacity, TransportClosed
from .frames import Buffer
from .handshake import Established
from .identity import PeerId, PeerLike, as_peer
from .listener import Listener
from .messages import Message
from .options import TransportOptions
from .aead_pipeline import CryptoPool
from .pool import Pool
from .ratelimit import RateLimitedLog, WarnClass, cluster_warnings
from .secret import ClusterSecret
from .socket_handshake import client_handshake, server_handshake
from .wire import MESSAGE_KINDS, ErrorCode, Kind, Suite

AEAD_SUITES = frozenset({Suite.AES_256_GCM, Suite.CHACHA20_POLY1305})

log = logging.getLogger("mlxcel.cluster.transport")

OnMessage = Callable[[Message], None]
OnRequest = Callable[[Message], Buffer]

__all__ = [
    "Connection",
    "OnMessage",
    "OnRequest",
    "PeerLike",
    "StreamWriter",
    "Transport",
    "TransportOptions",
    "as_peer",
    "client_handshake",
    "close_all",
    "server_handshake",
]


class Transport:
    """One cluster node's transport.

    ``identity`` is this node's advertised listener address (its IP must be the
    source IP peers see; port 0 picks one at ``serve``).  All bounds are fields of
    ``TransportOptions`` and may be passed as keyword arguments.
    """

    def __init__(
        self,
        identity: PeerLike,
        secret: ClusterSecret,
        options: TransportOptions | None = None,
        *,
        warnings: RateLimitedLog | None = None,
        **overrides: object,
    ) -> None:
        if not isinstance(secret, ClusterSecret):
            raise TypeError("secret must be a ClusterSecret")
        self.identity = as_peer(identity)
        self.options = replace(options or TransportOptions(), **overrides)  # type: ignore[arg-type]
        check_suite(self.options.suite, f"cluster transport {self.identity}")
        if self.options.crypto_pipeline_min_len is None:  # the environment is read once, here
            self.options = replace(self.options, crypto_pipeline_min_len=self.options.effective_crypto_pipeline_min_len)
        self.warnings = warnings or cluster_warnings
        self._on_message: OnMessage | None = None
        self._on_request: OnRequest | None = None
        self._closing = threading.Event()
        self._ids = itertools.count(1)
        workers = self.options.effective_crypto_workers
        self._crypto = CryptoPool(workers) if workers > 0 and self.options.suite in AEAD_SUITES else None
        self._listener = Listener(secret, self.options, self.warnings, self._closing, self._factory(inbound=True))
        self._pool = Pool(secret, self.options, self.warnings, self._closing, self._factory(inbound=False))

    def __repr__(self) -> str:
        return f"Transport(identity={self.identity}, suite={self.options.suite.name})"

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stats --

    @property
    def authenticated_connections(self) -> int:
        """Inbound authenticated connections (what counts against ``max_connections``)."""
        return self._listener.authenticated

    @property
    def pending_handshakes(self) -> int:
        return self._listener.pending

    @property
    def listen_address(self) -> PeerId | None:
        return self._listener.address

    # -- serving --

    def serve(self, on_message: OnMessage | None = None, on_request: OnRequest | None = None, *, bind: PeerLike | None = None) -> PeerId:
        """Start the listener; returns this node's identity (with the bound port)."""
        if self._closing.is_set():
            raise TransportClosed("transport is closed")
        if self._listener.started:
            raise LocalProtocolError("serve() was already called")
        self._on_message, self._on_request = on_message, on_request
        addr = as_peer(bind) if bind is not None else self.identity
        port = self._listener.start(addr, str(self.identity))
        if self.identity.port == 0:
            self.identity = PeerId(self.identity.host, port)
        return self.identity

    def _factory(self, inbound: bool) -> Callable[[socket.socket, PeerId, Established], Connection]:
        def make(sock: socket.socket, peer: PeerId, est: Established) -> Connection:
            return Connection(
                sock, peer, est, inbound,
                options=self.options, warnings=self.warnings,
                deliver=self._deliver, handle_request=self._handle_request, forget=self._forget,
                crypto=self._crypto,
            )

        return make

    def _deliver(self, msg: Message) -> None:
        handler = self._on_message
        if handler is None:
            log.debug("no message handler; dropping %r", msg)
            return
        try:
            handler(msg)
        except Exception:
            log.exception("cluster message handler failed for %r", msg)

    def _handle_request(self, msg: Message) -> Buffer:
        handler = self._on_request
        if handler is None:
            raise RequestError(ErrorCode.UNSUPPORTED, "this node serves no requests")
        return handler(msg)

    def _forget(self, conn: Connection) -> None:
        if conn.inbound:
            self._listener.discard(conn)
        else:
            self._pool.discard(conn)

    # -- outbound --

    def connect(self, peer: PeerLike) -> bool:
        """Establish the pooled connection now (fail fast at startup).

        Returns False (after a warning) when the peer stayed at capacity for the whole
        retry budget (``max_reconnect_attempts`` and ``dial_budget``); raises every
        other failure (``PeerUnreachable`` with the last cause chained).
        """
        try:
            self._acquire(peer)
            return True
        except PeerUnreachable as exc:
            if isinstance(exc.__cause__, ServerAtCapacity):
                self.warnings.warning(WarnClass.AT_CAPACITY, "cluster peer %s: %s", peer, exc)
                return False
            raise

    def send(self, peer: PeerLike, kind: Kind, payload: Buffer) -> None:
        """One-way message (TENSOR_DATA or CONTROL) to ``peer`` over its pooled connection."""
        if kind not in MESSAGE_KINDS:
            raise LocalProtocolError(f"send() takes TENSOR_DATA or CONTROL, not {kind!r}")
        self._acquire(peer).send(kind, payload)

    def request(self, peer: PeerLike, payload: Buffer, timeout: float | None = None) -> memoryview:
        """RPC: send ``payload``, return the peer handler's response (raises on error/timeout)."""
        conn = self._acquire(peer)
        return conn.request(payload, next(self._ids), self.options.request_timeout if timeout is None else timeout)

    def open_stream(self, peer: PeerLike, lane: int = 0) -> StreamWriter:
        """An ordered stream of messages to ``peer`` (delivered as STREAM_DATA ... STREAM_END), on the
        pooled connection of ``lane`` (0: the one every other message uses; see ``pool.py``)."""
        return StreamWriter(self._acquire(peer, lane), next(self._ids))

    def connection(self, peer: PeerLike) -> Connection:
        """The pooled connection to ``peer`` (dialled if needed)."""
        return self._acquire(peer)

    def drop(self, peer: PeerLike) -> int:
        """Close every connection to and from ``peer``, outbound lanes and inbound alike; returns how many.

        A caller that judged the peer down calls it, so the next message dials afresh: a TCP connection
        that held unacknowledged data through a cut link can stay stalled in retransmission backoff
        for minutes after the link is back."""
        peer = as_peer(peer)
        return self._pool.drop(peer) + self._listener.drop(peer)

    def _acquire(self, peer: PeerLike, lane: int = 0) -> Connection:
        return self._pool.acquire(as_peer(peer), self.identity, lane)

    # -- shutdown --

    def close(self) -> None:
        """Stop accepting, close every connection, join every thread; idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        threads = self._listener.stop() + self._pool.close_all()
        me = threading.current_thread()
        for t in threads:
            if t is not me and t.ident is not None:  # a connection closed before its thread started has none
                t.join(5.0)
        self._listener.close_socket()
        if self._crypto is not None:
            self._crypto.close()


def close_all(transports: Iterable[Transport]) -> None:
    """Close several transports (tests, benchmarks)."""
    for t in transports:
        t.close()
