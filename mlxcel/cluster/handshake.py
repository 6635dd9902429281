"""Sans-I/O connection handshake, protocol version 5 (docs/protocol.md "Handshake").

Rules of the state machines (h11 ``_state.py`` style):

Client: START --hello()--> HELLO_SENT --[server hello verified]--> SERVER_VERIFIED
        --client_auth()--> AUTH_SENT --[verdict verified]--> DONE
Server: START --[client hello parsed]--> HELLO_RECEIVED --server_hello()--> HELLO_SENT
        --[client authenticator verified]--> CLIENT_VERIFIED --verdict()--> DONE | REFUSED
        START --[hello refused]--> REJECTED (send ``Rejected.record`` then close)

Bytes go in through ``receive_data``; ``next_event`` returns ``NEED_DATA`` or an
event, or raises a ``HandshakeError`` after which the machine is in ERROR.  Calling
a method in the wrong state raises ``LocalProtocolError``.  ``bytes_needed`` tells a
blocking reader how many bytes to read next so no frame byte is ever over-read.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Final

from .errors import (
    ChannelMismatch,
    ClosedBeforeHandshake,
    HandshakeAborted,
    HandshakeError,
    IdentityRejected,
    LocalProtocolError,
    MalformedHandshake,
    SecretMismatch,
    ServerAtCapacity,
    SuiteMismatch,
    VerdictNotVerified,
    VersionMismatch,
)
from .identity import PeerId, bind_identity
from .keys import DirectionalKeys, derive_keys
from .secret import ClusterSecret
from .wire import (
    LABEL_CLIENT_AUTH,
    LABEL_SERVER_AUTH,
    LABEL_VERDICT,
    MAC_LEN,
    MAGIC,
    MAX_IDENTITY_LEN,
    NONCE_LEN,
    PROTOCOL_VERSION,
    RECORD_PREFIX,
    Channel,
    Record,
    RejectReason,
    Suite,
    Verdict,
)

PREFIX_LEN: Final = RECORD_PREFIX.size  # 7
CLIENT_HELLO_FIXED: Final = PREFIX_LEN + 2 + NONCE_LEN + 1  # 42, then the identity
SERVER_HELLO_LEN: Final = PREFIX_LEN + 1 + NONCE_LEN + MAC_LEN  # 72
REJECT_LEN: Final = PREFIX_LEN + 2  # 9
CLIENT_AUTH_LEN: Final = PREFIX_LEN + MAC_LEN  # 39
VERDICT_LEN: Final = PREFIX_LEN + 1 + MAC_LEN  # 40

MSG_CLIENT_SECRET_MISMATCH: Final = "its authenticator does not verify under the configured cluster secret (secret mismatch)"
MSG_SERVER_SECRET_MISMATCH: Final = "the client's authenticator does not verify under the configured cluster secret (secret mismatch)"
MSG_CLOSED_AFTER_AUTH: Final = (
    "client closed the connection after receiving this server's authenticator; "
    "it most likely holds a different cluster secret"
)
MSG_IDENTITY_REFUSED: Final = (
    "server refused this node's advertised identity {identity}: "
    "the advertised IP must be the address the server sees this connection come from"
)
MSG_AT_CAPACITY: Final = (
    "server authenticated this node but refused the connection: "
    "it already holds its maximum number of authenticated connections; retry later"
)
MSG_VERDICT_FORGED: Final = "server's handshake verdict does not verify under the cluster secret"


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


@dataclass(frozen=True, slots=True)
class HelloReceived:
    """Server: a well-formed hello from ``peer`` (its bound identity); answer with ``server_hello()``."""

    peer: PeerId


@dataclass(frozen=True, slots=True)
class Rejected:
    """Server: send ``record`` (explicit rejection), then close; ``error`` says why."""

    record: bytes
    error: HandshakeError


@dataclass(frozen=True, slots=True)
class ServerVerified:
    """Client: the server proved the secret; send ``client_auth()``."""


@dataclass(frozen=True, slots=True)
class ClientVerified:
    """Server: the client proved the secret; send ``verdict(accept)``."""

    peer: PeerId


@dataclass(frozen=True, slots=True)
class Established:
    """Client: the server accepted; frame keys are ready."""

    send_key: bytes
    recv_key: bytes
    suite: Suite

    def __repr__(self) -> str:
        return f"Established(suite={self.suite.name})"


def _mac(secret: ClusterSecret, label: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret.reveal(), label, hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def _prefix(record: Record, version: int = PROTOCOL_VERSION) -> bytes:
    return RECORD_PREFIX.pack(MAGIC, version, record)


def encode_client_hello(suite: Suite, channel: Channel, nonce: bytes, identity: str) -> bytes:
    """CLIENT_HELLO record bytes."""
    ident = identity.encode("ascii")
    if not 1 <= len(ident) <= MAX_IDENTITY_LEN:
        raise LocalProtocolError(f"identity must be 1..{MAX_IDENTITY_LEN} ASCII bytes")
    return _prefix(Record.CLIENT_HELLO) + bytes([suite, channel]) + nonce + bytes([len(ident)]) + ident


def encode_reject(reason: RejectReason, detail: int = 0) -> bytes:
    """REJECT record bytes (server's version in the prefix)."""
    return _prefix(Record.REJECT) + bytes([reason, detail])


def _suite_name(value: int) -> str:
    try:
        return Suite(value).name.lower().replace("_", "-")
    except ValueError:
        return f"unknown suite {value}"


def _channel_name(value: int) -> str:
    try:
        return Channel(value).label
    except ValueError:
        return f"unknown channel {value}"


class _Machine:
    """Shared buffering, state and ordering checks."""

    def __init__(self, secret: ClusterSecret, suite: Suite, channel: Channel, nonce: bytes | None) -> None:
        if nonce is not None and len(nonce) != NONCE_LEN:
            raise ValueError(f"nonce must be {NONCE_LEN} bytes")
        self._secret = secret
        self.suite = Suite(suite)
        self.channel = Channel(channel)
        self.nonce = nonce if nonce is not None else os.urandom(NONCE_LEN)
        self.state = "START"
        self._buf = bytearray()
        self._keys: DirectionalKeys | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(state={self.state}, suite={self.suite.name})"

    def _expect(self, *states: str) -> None:
        if self.state not in states:
            raise LocalProtocolError(f"{type(self).__name__}: not allowed in state {self.state}")

    def _fail(self, error: HandshakeError) -> HandshakeError:
        self.state = "ERROR"
        return error

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the peer (bounded by the largest record)."""
        if self.state in ("ERROR", "DONE", "REFUSED", "REJECTED"):
            raise LocalProtocolError(f"{type(self).__name__}: no data expected in state {self.state}")
        self._buf += data
        if len(self._buf) > CLIENT_HELLO_FIXED + MAX_IDENTITY_LEN:
            raise self._fail(MalformedHandshake("handshake record too long"))

    def _take(self, n: int) -> bytes:
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    @property
    def trailing_data(self) -> bytes:
        """Bytes received past the last handshake record (frames, in the same order)."""
        return bytes(self._buf)

    def _check_magic(self, who: str) -> tuple[int, int]:
        magic, version, record = RECORD_PREFIX.unpack_from(self._buf)
        if magic != MAGIC:
            raise self._fail(MalformedHandshake(f"{who} did not start with the mlxcel cluster handshake (bad magic)"))
        return version, record

    @property
    def keys(self) -> DirectionalKeys:
        if self._keys is None:
            raise LocalProtocolError("keys exist only after an accepted verdict")
        return self._keys


class ClientHandshake(_Machine):
    """The connecting side: proves the secret second, learns the verdict last."""

    def __init__(
        self,
        secret: ClusterSecret,
        identity: PeerId | str,
        *,
        suite: Suite = Suite.AES_256_GCM,
        channel: Channel = Channel.TRANSPORT,
        nonce: bytes | None = None,
    ) -> None:
        super().__init__(secret, suite, channel, nonce)
        self.identity = str(identity)
        self._hello = b""
        self._server_hello = b""
        self._auth = b""

    def hello(self) -> bytes:
        """START -> HELLO_SENT: the CLIENT_HELLO to send."""
        self._expect("START")
        self._hello = encode_client_hello(self.suite, self.channel, self.nonce, self.identity)
        self.state = "HELLO_SENT"
        return self._hello

    def client_auth(self) -> bytes:
        """SERVER_VERIFIED -> AUTH_SENT: the CLIENT_AUTH record to send."""
        self._expect("SERVER_VERIFIED")
        mac = _mac(self._secret, LABEL_CLIENT_AUTH, self._hello, self._server_hello)
        self._auth = _prefix(Record.CLIENT_AUTH) + mac
        self.state = "AUTH_SENT"
        return self._auth

    def bytes_needed(self) -> int:
        """How many more bytes the next record needs (at least 1 while waiting)."""
        if self.state == "HELLO_SENT":
            if len(self._buf) < PREFIX_LEN:
                return PREFIX_LEN - len(self._buf)
            total = REJECT_LEN if self._buf[6] == Record.REJECT else SERVER_HELLO_LEN
            return max(total - len(self._buf), 0)
        if self.state == "AUTH_SENT":
            return max(VERDICT_LEN - len(self._buf), 0)
        return 0

    def next_event(self) -> object:
        """NEED_DATA, ``ServerVerified`` or ``Established``; raises on failure."""
        if self.state == "HELLO_SENT":
            return self._on_server_hello()
        if self.state == "AUTH_SENT":
            return self._on_verdict()
        raise LocalProtocolError(f"ClientHandshake: no event expected in state {self.state}")

    def connection_closed(self) -> HandshakeError:
        """The error to report when the server closed before the handshake ended."""
        return self._fail(HandshakeAborted(f"server closed the connection during the handshake (state {self.state})"))

    def _on_server_hello(self) -> object:
        if len(self._buf) < PREFIX_LEN:
            return NEED_DATA
        version, record = self._check_magic("the server's answer")
        if record == Record.REJECT:
            if len(self._buf) < REJECT_LEN:
                return NEED_DATA
            raise self._fail(self._rejection(version, self._take(REJECT_LEN)))
        if version != PROTOCOL_VERSION:
            raise self._fail(VersionMismatch(self._version_text(version)))
        if record != Record.SERVER_HELLO:
            raise self._fail(MalformedHandshake(f"expected a server hello, got record type {record}"))
        if len(self._buf) < SERVER_HELLO_LEN:
            return NEED_DATA
        rec = self._take(SERVER_HELLO_LEN)
        if rec[7] != self.suite:
            raise self._fail(MalformedHandshake(f"server hello names suite {_suite_name(rec[7])}, not the one this node offered"))
        expected = _mac(self._secret, LABEL_SERVER_AUTH, self._hello, rec[:40])
        if not hmac.compare_digest(expected, rec[40:]):
            raise self._fail(SecretMismatch(MSG_CLIENT_SECRET_MISMATCH))
        self._server_hello = rec
        self.state = "SERVER_VERIFIED"
        return ServerVerified()

    def _version_text(self, version: int) -> str:
        return (
            f"server speaks cluster protocol version {version}, this node speaks {PROTOCOL_VERSION}; "
            "every node of a cluster must run the same mlxcel version"
        )

    def _rejection(self, version: int, rec: bytes) -> HandshakeError:
        reason, detail = rec[7], rec[8]
        if reason == RejectReason.VERSION:
            return VersionMismatch(self._version_text(version))
        if reason == RejectReason.SUITE:
            return SuiteMismatch(
                f"server requires frame suite {_suite_name(detail)}, this node is configured for "
                f"{_suite_name(self.suite)} (suite mismatch)"
            )
        if reason == RejectReason.CHANNEL:
            return ChannelMismatch(
                f"server serves the {_channel_name(detail)} channel, this node dialled it for the "
                f"{self.channel.label} channel"
            )
        if reason == RejectReason.IDENTITY:
            return IdentityRejected(MSG_IDENTITY_REFUSED.format(identity=self.identity))
        return MalformedHandshake(f"server sent a rejection with unknown reason {reason}")

    def _on_verdict(self) -> object:
        if len(self._buf) < VERDICT_LEN:
            return NEED_DATA
        version, record = self._check_magic("the server's verdict")
        rec = self._take(VERDICT_LEN)
        expected = _mac(self._secret, LABEL_VERDICT, self._hello, self._server_hello, self._auth, rec[:8])
        if version != PROTOCOL_VERSION or record != Record.VERDICT or not hmac.compare_digest(expected, rec[8:]):
            raise self._fail(VerdictNotVerified(MSG_VERDICT_FORGED))
        if rec[7] == Verdict.AT_CAPACITY:
            raise self._fail(ServerAtCapacity(MSG_AT_CAPACITY))
        if rec[7] != Verdict.ACCEPT:
            raise self._fail(MalformedHandshake(f"server sent unknown verdict {rec[7]}"))
        self._keys = derive_keys(self._secret, self.nonce, self._server_hello[8:40], self.channel)
        self.state = "DONE"
        send, recv = self._keys.for_client()
        return Established(send, recv, self.suite)


class ServerHandshake(_Machine):
    """The accepting side: proves the secret first, binds the identity, sends the verdict."""

    def __init__(
        self,
        secret: ClusterSecret,
        source_ip: str,
        *,
        suite: Suite = Suite.AES_256_GCM,
        channel: Channel = Channel.TRANSPORT,
        nonce: bytes | None = None,
    ) -> None:
        super().__init__(secret, suite, channel, nonce)
        self.source_ip = source_ip
        self.peer: PeerId | None = None
        self._hello = b""
        self._server_hello = b""
        self._client_auth = b""

    def bytes_needed(self) -> int:
        """How many more bytes the next record needs."""
        if self.state == "START":
            if len(self._buf) < CLIENT_HELLO_FIXED:
                # never read past a short rejected prefix: stop at the prefix first
                return (PREFIX_LEN if len(self._buf) < PREFIX_LEN else CLIENT_HELLO_FIXED) - len(self._buf)
            return max(CLIENT_HELLO_FIXED + self._buf[CLIENT_HELLO_FIXED - 1] - len(self._buf), 0)
        if self.state == "HELLO_SENT":
            return max(CLIENT_AUTH_LEN - len(self._buf), 0)
        return 0

    def next_event(self) -> object:
        """NEED_DATA, ``HelloReceived``, ``Rejected`` or ``ClientVerified``; raises on failure."""
        if self.state == "START":
            return self._on_hello()
        if self.state == "HELLO_SENT":
            return self._on_client_auth()
        raise LocalProtocolError(f"ServerHandshake: no event expected in state {self.state}")

    def server_hello(self) -> bytes:
        """HELLO_RECEIVED -> HELLO_SENT: the SERVER_HELLO (nonce + authenticator)."""
        self._expect("HELLO_RECEIVED")
        body = _prefix(Record.SERVER_HELLO) + bytes([self.suite]) + self.nonce
        self._server_hello = body + _mac(self._secret, LABEL_SERVER_AUTH, self._hello, body)
        self.state = "HELLO_SENT"
        return self._server_hello

    def verdict(self, accept: bool) -> bytes:
        """CLIENT_VERIFIED -> DONE (accept) or REFUSED (at capacity): the VERDICT record."""
        self._expect("CLIENT_VERIFIED")
        head = _prefix(Record.VERDICT) + bytes([Verdict.ACCEPT if accept else Verdict.AT_CAPACITY])
        mac = _mac(self._secret, LABEL_VERDICT, self._hello, self._server_hello, self._client_auth, head)
        if accept:
            client_nonce = self._hello[9 : 9 + NONCE_LEN]
            self._keys = derive_keys(self._secret, client_nonce, self.nonce, self.channel)
        self.state = "DONE" if accept else "REFUSED"
        return head + mac

    def established(self) -> Established:
        """The frame keys of the accepting side (after ``verdict(True)``)."""
        send, recv = self.keys.for_server()
        return Established(send, recv, self.suite)

    def connection_closed(self) -> HandshakeError:
        """The error (and its wording) for a close at the current state."""
        if self.state == "HELLO_SENT":
            return self._fail(HandshakeAborted(MSG_CLOSED_AFTER_AUTH))
        if self.state == "START" and not self._buf:
            return self._fail(ClosedBeforeHandshake("client closed the connection before the handshake"))
        return self._fail(HandshakeAborted(f"client closed the connection before the handshake completed (state {self.state})"))

    def _on_hello(self) -> object:
        if len(self._buf) < PREFIX_LEN:
            return NEED_DATA
        version, record = self._check_magic("the client's hello")
        if version != PROTOCOL_VERSION:
            self.state = "REJECTED"
            error = VersionMismatch(
                f"client speaks cluster protocol version {version}, this node speaks {PROTOCOL_VERSION}; "
                "every node of a cluster must run the same mlxcel version"
            )
            return Rejected(encode_reject(RejectReason.VERSION), error)
        if record != Record.CLIENT_HELLO:
            raise self._fail(MalformedHandshake(f"expected a client hello, got record type {record}"))
        if len(self._buf) < CLIENT_HELLO_FIXED:
            return NEED_DATA
        n = self._buf[CLIENT_HELLO_FIXED - 1]
        if len(self._buf) < CLIENT_HELLO_FIXED + n:
            return NEED_DATA
        self._hello = self._take(CLIENT_HELLO_FIXED + n)
        return self._judge_hello(self._hello)

    def _judge_hello(self, hello: bytes) -> object:
        suite, channel = hello[7], hello[8]
        try:
            advertised = PeerId.parse(hello[CLIENT_HELLO_FIXED:].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise self._fail(MalformedHandshake("the client's advertised identity is not a socket address")) from None
        if suite != self.suite:
            self.state = "REJECTED"
            error = SuiteMismatch(
                f"refusing a client configured for frame suite {_suite_name(suite)}; this node requires "
                f"{_suite_name(self.suite)} (suite mismatch)"
            )
            return Rejected(encode_reject(RejectReason.SUITE, self.suite), error)
        if channel != self.channel:
            self.state = "REJECTED"
            error = ChannelMismatch(
                f"refusing a client that dialled the {_channel_name(channel)} channel; this listener serves "
                f"the {self.channel.label} channel"
            )
            return Rejected(encode_reject(RejectReason.CHANNEL, self.channel), error)
        try:
            self.peer = bind_identity(advertised, self.source_ip)
        except IdentityRejected as exc:
            self.state = "REJECTED"
            return Rejected(encode_reject(RejectReason.IDENTITY), exc)
        self.state = "HELLO_RECEIVED"
        return HelloReceived(self.peer)

    def _on_client_auth(self) -> object:
        if len(self._buf) < CLIENT_AUTH_LEN:
            return NEED_DATA
        version, record = self._check_magic("the client's authenticator")
        rec = self._take(CLIENT_AUTH_LEN)
        expected = _mac(self._secret, LABEL_CLIENT_AUTH, self._hello, self._server_hello)
        if version != PROTOCOL_VERSION or record != Record.CLIENT_AUTH or not hmac.compare_digest(expected, rec[PREFIX_LEN:]):
            raise self._fail(SecretMismatch(MSG_SERVER_SECRET_MISMATCH))
        self._client_auth = rec
        self.state = "CLIENT_VERIFIED"
        assert self.peer is not None
        return ClientVerified(self.peer)
