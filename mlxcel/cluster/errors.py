"""Cluster exceptions: one base, local and remote branches (h11 style).

``LocalError``: this node is misconfigured or misused the API (bad secret source,
call out of order, a message over the cap).  ``RemoteError``: the peer (or something
on the path) broke the protocol or failed authentication.  Messages never contain
secret material or payload bytes.

Each class carries its ``ErrorCode``: what a request handler failing with it answers (docs/protocol.md
§5.1): a ``RequestError``'s own code, a forwarded ``RequestFailed``'s downstream code, TIMEOUT for the
timeouts, INTERNAL for the rest.
"""

from __future__ import annotations

from mlxcel.error_codes import CodedError

from .wire import ErrorCode


class ClusterError(CodedError):
    """Base of every error raised by ``mlxcel.cluster``."""

    code = ErrorCode.INTERNAL


class LocalError(ClusterError):
    """This node's configuration or its caller is at fault."""


class RemoteError(ClusterError):
    """The peer, or a party on the path, is at fault."""


# --- local --------------------------------------------------------------------------


class SecretError(LocalError):
    """The cluster secret is missing, unreadable, too short or ambiguous."""


class LocalProtocolError(LocalError):
    """A protocol object was used out of order or asked to send something invalid."""


class TransportClosed(LocalError):
    """The transport (or connection) was closed by this node."""


class SequenceExhausted(LocalError):
    """A direction reached its last sequence number; the connection must close."""


# --- remote: handshake ----------------------------------------------------------------


class HandshakeError(RemoteError):
    """The connection handshake failed; no frame was or will be exchanged."""

    #: whether a connection pool may retry it with backoff
    retryable = False


class MalformedHandshake(HandshakeError):
    """Bad magic, an unknown record type, a bad identity or an overlong record."""


class VersionMismatch(HandshakeError):
    """The two nodes speak different handshake protocol versions."""


class SuiteMismatch(HandshakeError):
    """The two nodes are configured for different frame protection suites."""


class ChannelMismatch(HandshakeError):
    """The client dialled a listener of another channel (transport vs assignment)."""


class IdentityRejected(HandshakeError):
    """The server refused the client's advertised identity (IP is not the source IP)."""


class SecretMismatch(HandshakeError):
    """An authenticator did not verify: the peer most likely holds another secret."""


class VerdictNotVerified(HandshakeError):
    """The server's verdict was altered on the path (its authenticator failed)."""


class ServerAtCapacity(HandshakeError):
    """The server authenticated us but already holds its maximum of connections."""

    retryable = True


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The handshake did not complete within its deadline."""

    code = ErrorCode.TIMEOUT


class HandshakeAborted(HandshakeError):
    """The peer closed or reset the connection during the handshake."""


# --- remote: frames -----------------------------------------------------------------


class FrameError(RemoteError):
    """A frame violated the framing or failed authentication; the connection closes."""


class FrameAuthError(FrameError):
    """A frame failed authentication: altered, replayed, reordered or foreign."""


class FrameTooLarge(FrameError):
    """A frame header announced a length above the cap (refused before reading it)."""


class UnknownFrameKind(FrameError):
    """An authenticated frame carried a kind this node does not know."""


class MessageError(FrameError):
    """Frames were valid but did not form a valid message (bad fragment sequence)."""


# --- remote: transport ----------------------------------------------------------------


class ConnectionLost(RemoteError):
    """The connection to the peer closed or failed."""


class PeerUnreachable(RemoteError):
    """No connection to the peer could be established within the retry budget."""


class RequestFailed(RemoteError):
    """The peer answered a request with an error: ``code`` (an ``ErrorCode``) and its
    one-line ``detail`` text."""

    code = ErrorCode.UNKNOWN

    def __init__(self, message: str, code: ErrorCode = ErrorCode.UNKNOWN, detail: str = "") -> None:
        super().__init__(message, code)
        self.detail = detail


class RequestTimeout(RemoteError, TimeoutError):
    """No response arrived before the request's deadline."""

    code = ErrorCode.TIMEOUT


class RequestError(ClusterError):
    """Raised by a request handler to answer with a typed error.

    The caller's ``request`` raises ``RequestFailed`` with the same ``code`` and
    ``message``; any other exception from a handler answers ``INTERNAL``."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{ErrorCode(code).name}: {message}", code)
        self.message = message


class ClosedBeforeHandshake(HandshakeAborted):
    """The client closed before sending a byte (a connect-and-close liveness probe)."""
