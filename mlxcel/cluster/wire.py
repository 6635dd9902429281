"""Wire constants of the cluster protocol: one source of truth (see docs/protocol.md)."""

from __future__ import annotations

import enum
import struct

from mlxcel.error_codes import ErrorCode  # noqa: F401 - the one error vocabulary (mlxcel/error_codes.py)


PROTOCOL_VERSION = 5
MAGIC = b"MLXC"

# --- handshake ------------------------------------------------------------------------

#: every handshake record starts with magic(4) || version(u16 BE) || record type(u8)
RECORD_PREFIX = struct.Struct(">4sHB")
NONCE_LEN = 32
MAC_LEN = 32
MAX_IDENTITY_LEN = 255
HANDSHAKE_TIMEOUT_S = 5.0

LABEL_SERVER_AUTH = b"mlxcel-cluster-v5/server-auth\x00"
LABEL_CLIENT_AUTH = b"mlxcel-cluster-v5/client-auth\x00"
LABEL_VERDICT = b"mlxcel-cluster-v5/verdict\x00"


class Record(enum.IntEnum):
    """Handshake record types (byte 6 of every record)."""

    CLIENT_HELLO = 0x01
    SERVER_HELLO = 0x02
    REJECT = 0x03
    CLIENT_AUTH = 0x04
    VERDICT = 0x05


class RejectReason(enum.IntEnum):
    """Reason byte of a rejection record (sent before any server nonce)."""

    VERSION = 1
    SUITE = 2
    IDENTITY = 3
    CHANNEL = 4


class Verdict(enum.IntEnum):
    """Verdict byte: sent only after the client's authenticator verified."""

    ACCEPT = 0
    AT_CAPACITY = 1


class Suite(enum.IntEnum):
    """Frame protection suites; AES-256-GCM is the only one a cluster runs.

    The other three exist for the frame benchmark.
    """

    UNPROTECTED = 0
    HMAC_SHA256 = 1
    AES_256_GCM = 2
    CHACHA20_POLY1305 = 3


DEFAULT_SUITE = Suite.AES_256_GCM
TAG_LEN = {Suite.UNPROTECTED: 0, Suite.HMAC_SHA256: 32, Suite.AES_256_GCM: 16, Suite.CHACHA20_POLY1305: 16}


class Channel(enum.IntEnum):
    """Key-separation channel: part of the hello and of the HKDF info string."""

    TRANSPORT = 0
    ASSIGNMENT = 1

    @property
    def label(self) -> str:
        return self.name.lower()


# --- keys -----------------------------------------------------------------------------

KEY_LEN = 32
HKDF_INFO_PREFIX = "mlxcel-cluster-frame-v1"


def hkdf_info(channel: Channel, direction: str) -> bytes:
    """``mlxcel-cluster-frame-v1/<channel>/<c2s|s2c>``."""
    if direction not in ("c2s", "s2c"):
        raise ValueError(f"direction must be c2s or s2c, not {direction!r}")
    return f"{HKDF_INFO_PREFIX}/{channel.label}/{direction}".encode()


# --- frames ---------------------------------------------------------------------------

#: frame header = kind(u8) || len(u32 BE); it is the AEAD's associated data
FRAME_HEADER = struct.Struct(">BI")
FRAME_HEADER_LEN = FRAME_HEADER.size
#: wire bytes a message of one frame adds to its payload with the cluster's suite: header + AES-GCM
#: tag = 21 (messages above the chunk length are fragmented and add this per frame)
FRAME_OVERHEAD = FRAME_HEADER_LEN + TAG_LEN[DEFAULT_SUITE]
MAX_FRAME_LEN = 256 * 1024 * 1024
NONCE_BYTES = 12
SEQ_LIMIT = 1 << 96  # a direction never uses sequence number SEQ_LIMIT (never wraps)


class Kind(enum.IntEnum):
    """Frame kinds (clear on the wire, covered by the tag)."""

    TENSOR_DATA = 0x01
    CONTROL = 0x02
    RPC_REQUEST = 0x03
    RPC_RESPONSE = 0x04
    STREAM_DATA = 0x05
    STREAM_END = 0x06
    MESSAGE_BEGIN = 0x10
    MESSAGE_CONTINUE = 0x11


KNOWN_KINDS = frozenset(int(k) for k in Kind)
#: kinds a caller may send as a one-way message
MESSAGE_KINDS = frozenset({Kind.TENSOR_DATA, Kind.CONTROL})
#: kinds that may be announced by MESSAGE_BEGIN (everything but the fragment kinds)
FRAGMENTABLE_KINDS = frozenset(k for k in Kind if k < Kind.MESSAGE_BEGIN)

#: MESSAGE_BEGIN payload: inner kind(u8) || total length(u64 BE)
MESSAGE_BEGIN = struct.Struct(">BQ")
#: RPC_REQUEST payload prefix: request id(u64 BE)
RPC_REQUEST = struct.Struct(">Q")
#: RPC_RESPONSE payload prefix: request id(u64 BE) || status(u8: 0 ok, 1 error with an error body)
RPC_RESPONSE = struct.Struct(">QB")
#: STREAM_DATA prefix: stream id(u64 BE); STREAM_END: stream id || status(u8)
STREAM_DATA = struct.Struct(">Q")
STREAM_END = struct.Struct(">QB")
#: status byte of RPC_RESPONSE and STREAM_END: 0 ok / stream completed, 1 error / stream aborted
RPC_OK = 0
RPC_ERROR = 1
STREAM_OK = RPC_OK
STREAM_ABORTED = RPC_ERROR
MAX_MESSAGE_LEN = MAX_FRAME_LEN


#: error body: code (u16 BE) || UTF-8 text of at most MAX_ERROR_TEXT bytes
ERROR_BODY = struct.Struct(">H")
MAX_ERROR_TEXT = 1024

# --- transport defaults ---------------------------------------------------------------

MAX_CONNECTIONS = 512
MAX_PENDING_HANDSHAKES = 64
MAX_PENDING_HANDSHAKES_PER_SOURCE = 8
#: the --pp-auto assignment listener's smaller pending pool
ASSIGNMENT_MAX_PENDING_HANDSHAKES = 8
ASSIGNMENT_MAX_PENDING_HANDSHAKES_PER_SOURCE = 4
MAX_RECONNECT_ATTEMPTS = 5
RECONNECT_BASE_DELAY_S = 0.1
RECONNECT_MAX_DELAY_S = 5.0
#: a dial keeps retrying retryable failures for at least handshake_timeout + this long,
#: so a listener whose pending pool is full (each socket held <= its handshake
#: timeout) delays a peer instead of failing it
RECONNECT_MARGIN_S = 2.0
DEFAULT_CHUNK_LEN = 256 * 1024
#: first/last MESSAGE_CONTINUE length of a message sealed by helper threads (a sender's
#: choice, not a wire rule: any length from 1 to the frame cap is valid)
DEFAULT_CHUNK_RAMP_LEN = 64 * 1024
#: the smallest message body sealed and opened by helper threads (a local choice of each end, both read the length:
#: the sender its payload, the receiver the authenticated MESSAGE_BEGIN). Below it the owner thread does the AEAD
#: alone: on the H200 host's 16 cores the helpers cost 1.6-2.1x unprotected at 1-2 MiB where the serial path costs
#: 1.2-1.4x, and they win from 16 MiB (docs/benchmarks.md, "AES-GCM at 1-2 MiB")
DEFAULT_CRYPTO_PIPELINE_MIN_LEN = 4 * 1024 * 1024
#: SO_SNDBUF/SO_RCVBUF: 1 MiB messages after an idle gap were 25-30% faster on
#: loopback than with autotuning (which restarts from 16 KiB send buffers)
DEFAULT_SOCKET_BUFFER = 4 * 1024 * 1024
