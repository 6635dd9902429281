"""The listening side: accept loop, pending-handshake pool, admission, inbound connections.

A socket beyond the pending pool (``max_pending_handshakes`` in flight,
``max_pending_handshakes_per_ip`` per source) is closed at accept, before a byte is
read.  Each admitted socket gets a thread that runs the server handshake (bounded by
``handshake_timeout``), reserves one of ``max_connections`` slots when the client
proved the secret, and then becomes that connection's reader thread.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from typing import Callable

from .connection import Connection
from .errors import ClosedBeforeHandshake, HandshakeAborted, HandshakeError, HandshakeTimeout, MalformedHandshake
from .handshake import MSG_CLOSED_AFTER_AUTH, Established, ServerHandshake
from .identity import PeerId, source_key
from .options import TransportOptions
from .ratelimit import RateLimitedLog, WarnClass
from .secret import ClusterSecret
from .socket_handshake import HandshakeRefused, server_handshake
from .sockets import family, set_send_timeout, tune

log = logging.getLogger("mlxcel.cluster.transport")

MakeConnection = Callable[[socket.socket, PeerId, Established], Connection]


class Listener:
    """Accepts, bounds and authenticates inbound connections for one transport."""

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
        self._sock: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._pending_total = 0
        self._pending_by_source: dict[str, int] = {}
        self._pending: set[socket.socket] = set()
        self._reserved = 0
        self._handshake_threads: set[threading.Thread] = set()
        self._inbound: set[Connection] = set()

    # -- state --

    @property
    def started(self) -> bool:
        return self._sock is not None

    @property
    def address(self) -> PeerId | None:
        if self._sock is None:
            return None
        host, port = self._sock.getsockname()[:2]
        return PeerId.of(host, port)

    @property
    def authenticated(self) -> int:
        with self._lock:
            return len(self._inbound)

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending_total

    def discard(self, conn: Connection) -> None:
        """Forget a closed inbound connection (frees its slot)."""
        with self._lock:
            self._inbound.discard(conn)

    def drop(self, peer: PeerId) -> int:
        """Close the inbound connections authenticated as ``peer`` (it dials again); returns how many."""
        with self._lock:
            conns = [c for c in self._inbound if c.peer == peer]
        for conn in conns:
            conn.close()
        return len(conns)

    # -- starting --

    def start(self, addr: PeerId, name: str) -> int:
        """Bind, listen and start the accept thread; returns the bound port."""
        sock = socket.socket(family(addr.host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.options.socket_buffer:  # accepted sockets inherit it (and its window scale)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.options.socket_buffer)
        try:
            sock.bind(addr.address)
            sock.listen(min(socket.SOMAXCONN, 1024))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe()
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"mlxcel-cluster-accept-{name}", daemon=True)
        self._accept_thread.start()
        return sock.getsockname()[1]

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closing.is_set():
            try:
                ready, _, _ = select.select([self._sock, self._wake_r], [], [])
            except (OSError, ValueError):
                return
            if self._wake_r in ready or self._closing.is_set():
                return
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:  # EMFILE and friends: back off instead of spinning
                log.warning("accepting a cluster connection failed: %s", exc.strerror or type(exc).__name__)
                self._closing.wait(0.1)
                continue
            self._admit_pending(sock, addr[0])

    # -- the pending pool --

    def _admit_pending(self, sock: socket.socket, source_ip: str) -> None:
        key = source_key(source_ip)
        opts = self.options
        with self._lock:
            per_source = self._pending_by_source.get(key, 0)
            full = self._pending_total >= opts.max_pending_handshakes or per_source >= opts.max_pending_handshakes_per_ip
            if not full:
                self._pending_total += 1
                self._pending_by_source[key] = per_source + 1
                self._pending.add(sock)
        if full:
            sock.close()
            self.warnings.warning(
                WarnClass.NOISE,
                "pending handshake pool full (%d in flight, %d per source); closed a connection from %s at accept",
                opts.max_pending_handshakes, opts.max_pending_handshakes_per_ip, key,
            )
            return
        t = threading.Thread(target=self._serve_connection, args=(sock, source_ip, key), name=f"mlxcel-cluster-handshake-{source_ip}", daemon=True)
        with self._lock:
            self._handshake_threads.add(t)
        t.start()

    def _serve_connection(self, sock: socket.socket, source_ip: str, key: str) -> None:
        conn = None
        try:
            conn = self._accept_handshake(sock, source_ip)
        finally:
            with self._lock:
                self._pending_total -= 1
                left = self._pending_by_source.get(key, 1) - 1
                if left:
                    self._pending_by_source[key] = left
                else:
                    self._pending_by_source.pop(key, None)
                self._pending.discard(sock)
                self._handshake_threads.discard(threading.current_thread())
            if conn is None:
                sock.close()
        if conn is not None:
            conn.read_loop()  # this thread becomes the connection's reader

    # -- handshake and admission --

    def _admit(self, peer: PeerId) -> bool:
        """Reserve one of ``max_connections`` slots for an authenticated peer."""
        opts = self.options
        with self._lock:
            reserved = not self._closing.is_set() and len(self._inbound) + self._reserved < opts.max_connections
            self._reserved += reserved
        if not reserved and not self._closing.is_set():
            self.warnings.warning(WarnClass.DIAGNOSTIC, "max connections (%d) reached; refused authenticated peer %s", opts.max_connections, peer)
        return reserved

    def _accept_handshake(self, sock: socket.socket, source_ip: str) -> Connection | None:
        opts = self.options
        hs = ServerHandshake(self._secret, source_ip, suite=opts.suite, channel=opts.channel)
        reserved = False

        def admit(peer: PeerId) -> bool:
            nonlocal reserved
            reserved = self._admit(peer)
            return reserved

        try:
            tune(sock, opts)
            est = server_handshake(sock, hs, opts.handshake_timeout, admit)
            set_send_timeout(sock, opts.send_timeout)
        except HandshakeRefused:
            return None
        except HandshakeError as exc:
            self._log_handshake_failure(source_ip, exc)
            return None
        except OSError as exc:
            if not self._closing.is_set():
                log.debug("cluster handshake from %s failed: %s", source_ip, exc.strerror or type(exc).__name__)
            return None
        finally:
            if reserved:
                with self._lock:
                    self._reserved -= 1
        assert hs.peer is not None
        conn = self._make_connection(sock, hs.peer, est)
        conn.thread = threading.current_thread()
        with self._lock:
            if self._closing.is_set():
                return None
            self._inbound.add(conn)
        log.debug("accepted cluster connection from %s", hs.peer)
        return conn

    def _log_handshake_failure(self, source_ip: str, exc: HandshakeError) -> None:
        if isinstance(exc, ClosedBeforeHandshake):
            log.debug("connection from %s closed before the handshake", source_ip)
            return
        noise = isinstance(exc, (MalformedHandshake, HandshakeTimeout)) or (
            isinstance(exc, HandshakeAborted) and str(exc) != MSG_CLOSED_AFTER_AUTH
        )
        cls = WarnClass.NOISE if noise else WarnClass.DIAGNOSTIC
        self.warnings.warning(cls, "cluster handshake from %s failed: %s", source_ip, exc)

    # -- shutdown --

    def stop(self) -> list[threading.Thread]:
        """Stop accepting, abort pending handshakes, close inbound connections.

        Call with the shared ``closing`` event set; returns the threads to join."""
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._accept_thread is not None:
            self._accept_thread.join(5.0)
        with self._lock:
            conns = list(self._inbound)
            pending = list(self._pending)
            threads = list(self._handshake_threads)
        for sock in pending:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for conn in conns:
            conn.close()
        return threads + [c.thread for c in conns if c.thread is not None]

    def stop_accepting(self) -> None:
        """Stop the accept loop and close the listening socket now: the port is free, the
        connections already accepted stay open (``stop`` later closes them)."""
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._accept_thread is not None and self._accept_thread is not threading.current_thread():
            self._accept_thread.join(5.0)
        if self._sock is not None:
            self._sock.close()

    def close_socket(self) -> None:
        """Close the listening socket and the wake pipe (after the joins)."""
        if self._sock is not None:
            self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
