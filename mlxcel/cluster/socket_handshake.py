"""The handshake state machines driven over a blocking socket, under one deadline.

Reads are exact (``bytes_needed``), so no frame byte that follows the last handshake
record is ever consumed here.
"""

from __future__ import annotations

import socket
import time
from typing import Callable

from .errors import HandshakeAborted, HandshakeError, HandshakeTimeout
from .handshake import NEED_DATA, ClientHandshake, Established, HelloReceived, Rejected, ServerHandshake, ServerVerified
from .identity import PeerId


class HandshakeRefused(HandshakeError):
    """Server side: this node answered with the at-capacity verdict (already logged)."""


def _remaining(deadline: float, timeout: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandshakeTimeout(f"the handshake did not complete within {timeout:g}s")
    return left


def _send_all(sock: socket.socket, data: bytes, deadline: float, timeout: float) -> None:
    sock.settimeout(_remaining(deadline, timeout))
    try:
        sock.sendall(data)
    except socket.timeout:
        raise HandshakeTimeout(f"the handshake did not complete within {timeout:g}s") from None


def _pump(sock: socket.socket, hs: ClientHandshake | ServerHandshake, deadline: float, timeout: float) -> object:
    """Read exactly what the state machine needs until it yields an event."""
    while True:
        event = hs.next_event()
        if event is not NEED_DATA:
            return event
        sock.settimeout(_remaining(deadline, timeout))
        try:
            data = sock.recv(hs.bytes_needed())
        except socket.timeout:
            raise HandshakeTimeout(f"the handshake did not complete within {timeout:g}s") from None
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
            data = b""
        if not data:
            raise hs.connection_closed()
        hs.receive_data(data)


def client_handshake(sock: socket.socket, hs: ClientHandshake, timeout: float) -> Established:
    """Run the connecting side over a connected socket; raises ``HandshakeError``."""
    deadline = time.monotonic() + timeout
    _send_all(sock, hs.hello(), deadline, timeout)
    try:
        event = _pump(sock, hs, deadline, timeout)
    except HandshakeAborted as exc:
        exc.retryable = True  # closed before the server said anything: like a refused connect
        raise
    assert isinstance(event, ServerVerified)
    _send_all(sock, hs.client_auth(), deadline, timeout)
    event = _pump(sock, hs, deadline, timeout)
    assert isinstance(event, Established)
    sock.settimeout(None)
    return event


def server_handshake(sock: socket.socket, hs: ServerHandshake, timeout: float, admit: Callable[[PeerId], bool]) -> Established:
    """Run the accepting side; ``admit`` reserves a connection slot or says at capacity."""
    deadline = time.monotonic() + timeout
    event = _pump(sock, hs, deadline, timeout)
    if isinstance(event, Rejected):
        try:
            _send_all(sock, event.record, deadline, timeout)
        except OSError:
            pass
        raise event.error
    assert isinstance(event, HelloReceived)
    _send_all(sock, hs.server_hello(), deadline, timeout)
    verified = _pump(sock, hs, deadline, timeout)
    accept = admit(verified.peer)  # type: ignore[attr-defined]
    _send_all(sock, hs.verdict(accept), deadline, timeout)
    if not accept:
        raise HandshakeRefused("at capacity")
    sock.settimeout(None)
    return hs.established()
