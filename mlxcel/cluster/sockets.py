"""Socket options every cluster connection gets (TCP_NODELAY, buffers, send timeout)."""

from __future__ import annotations

import socket
import struct

from .options import TransportOptions


def family(host: str) -> int:
    """AF_INET6 for an IPv6 literal, else AF_INET."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def tune(sock: socket.socket, opts: TransportOptions) -> None:
    """TCP_NODELAY, and SO_SNDBUF/SO_RCVBUF when ``opts.socket_buffer`` is set."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if opts.socket_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, opts.socket_buffer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, opts.socket_buffer)


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_SNDTIMEO keeps the socket in blocking mode (no poll per send) yet bounds a stalled peer."""
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))
