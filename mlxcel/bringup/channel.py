"""The assignment channel over a blocking socket: dial + handshake, then one CONTROL frame per message.

The handshake is the cluster's (``mlxcel.cluster.handshake``, channel ``assignment``, so the frame
keys use the HKDF info ``mlxcel-cluster-frame-v1/assignment/...``); frames are the cluster's
AES-256-GCM frames with a 64 KiB cap. Every read has a deadline: a frame that does not arrive in
time raises ``AssignmentTimeout``. Each channel counts what it put on and took off the wire
(``WireCount``: handshake and frames, headers and tags included) for the bring-up's summary line.
"""

from __future__ import annotations

import socket
import time

from mlxcel.cluster.frames import FrameOpener, FrameSealer
from mlxcel.cluster.handshake import ClientHandshake, Established
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.cluster.socket_handshake import client_handshake
from mlxcel.cluster.sockets import family
from mlxcel.cluster.wire import FRAME_HEADER_LEN, Channel, Kind, Suite

from .errors import AssignmentProtocolError, AssignmentTimeout, ChannelClosed
from .wire import FRAME_TIMEOUT_S, HANDSHAKE_TIMEOUT_S, MAX_ASSIGNMENT_MESSAGE


class WireCount:
    """Bytes and frames one side of an assignment connection sent and received (handshake included)."""

    def __init__(self) -> None:
        self.sent_bytes = self.received_bytes = self.sent_frames = self.received_frames = 0

    def add(self, other: "WireCount") -> None:
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes
        self.sent_frames += other.sent_frames
        self.received_frames += other.received_frames


class _CountingSocket:
    """A socket whose ``sendall`` and ``recv`` add to a ``WireCount``; everything else is the socket's."""

    def __init__(self, sock: socket.socket, count: WireCount) -> None:
        self._sock, self._count = sock, count

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)
        self._count.sent_bytes += len(data)

    def recv(self, n: int) -> bytes:
        data = self._sock.recv(n)
        self._count.received_bytes += len(data)
        return data

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


class FrameChannel:
    """One established assignment connection: ``send(payload)`` and ``recv(timeout)``."""

    def __init__(self, sock: socket.socket, peer: PeerId, est: Established, count: WireCount | None = None) -> None:
        self.count = count or WireCount()
        self.sock = sock if isinstance(sock, _CountingSocket) else _CountingSocket(sock, self.count)
        self.peer = peer  # the other side's identity as the handshake bound it
        self._sealer = FrameSealer(est.suite, est.send_key, max_frame_len=MAX_ASSIGNMENT_MESSAGE)
        self._opener = FrameOpener(est.suite, est.recv_key, max_frame_len=MAX_ASSIGNMENT_MESSAGE)
        self.closed = False

    def __repr__(self) -> str:
        return f"FrameChannel(peer={self.peer}, closed={self.closed})"

    @property
    def local_ip(self) -> str:
        """The address this connection reached this side at."""
        return self.sock.getsockname()[0]

    def send(self, payload: bytes, timeout: float = FRAME_TIMEOUT_S) -> None:
        """Seal ``payload`` as one CONTROL frame and send it (within ``timeout``)."""
        frame = self._sealer.seal(Kind.CONTROL, payload)
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(frame)
            self.count.sent_frames += 1
        except socket.timeout:
            raise AssignmentTimeout(f"sending to {self.peer} did not complete within {timeout:g}s") from None
        except OSError as exc:
            raise ChannelClosed(f"sending to {self.peer} failed: {exc.strerror or type(exc).__name__}") from None

    def recv(self, timeout: float) -> bytes:
        """The next message's payload; raises ``AssignmentTimeout``, ``ChannelClosed``, a
        ``FrameError`` (altered, replayed, oversize) or ``AssignmentProtocolError`` (not CONTROL)."""
        deadline = time.monotonic() + timeout
        header = self._read(FRAME_HEADER_LEN, deadline, timeout)
        kind, n = self._opener.parse_header(header)
        body = self._read(n + self._opener.tag_len, deadline, timeout)
        payload = self._opener.open(header, body)
        self.count.received_frames += 1
        if kind != Kind.CONTROL:
            raise AssignmentProtocolError(f"assignment frame of kind 0x{kind:02x}, expected CONTROL")
        return payload

    def _read(self, n: int, deadline: float, timeout: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssignmentTimeout(f"no assignment frame from {self.peer} within {timeout:g}s")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(n - len(buf))
            except socket.timeout:
                raise AssignmentTimeout(f"no assignment frame from {self.peer} within {timeout:g}s") from None
            except OSError as exc:
                raise ChannelClosed(f"the connection with {self.peer} failed: {exc.strerror or type(exc).__name__}") from None
            if not chunk:
                raise ChannelClosed(f"{self.peer} closed the assignment connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        """Shut down and close the socket; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def dial(peer: PeerId, identity: PeerId, secret: ClusterSecret, *,
         handshake_timeout: float = HANDSHAKE_TIMEOUT_S) -> FrameChannel:
    """Connect to a peer's assignment listener as ``identity`` (the coordinator's control address)
    and run the handshake on the assignment channel; raises ``OSError`` or ``HandshakeError``."""
    raw = socket.socket(family(peer.host), socket.SOCK_STREAM)
    count = WireCount()
    sock = _CountingSocket(raw, count)  # the handshake's bytes count too
    try:
        if not identity.ip.is_unspecified and family(identity.host) == family(peer.host):
            sock.bind((identity.host, 0))  # the source IP peers see is the advertised one
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(handshake_timeout)
        sock.connect(peer.address)
        hs = ClientHandshake(secret, identity, suite=Suite.AES_256_GCM, channel=Channel.ASSIGNMENT)
        est = client_handshake(sock, hs, handshake_timeout)  # type: ignore[arg-type]
    except BaseException:
        raw.close()
        raise
    return FrameChannel(sock, peer, est, count)  # type: ignore[arg-type]

