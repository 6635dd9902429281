"""Sans-I/O message layer over frames: kinds, prefixes, fragmentation, reassembly.

A message that fits one frame travels as one frame of its kind.  A larger message
(or a prefixed one with a large body) travels as MESSAGE_BEGIN (inner kind, body
length, the inner kind's prefix) followed by MESSAGE_CONTINUE frames carrying the
body, so sealing, sending and opening of consecutive chunks overlap and the
receiver opens every chunk straight into the final buffer.
"""

from __future__ import annotations

from typing import Iterator, Sequence, Union

import numpy as np

from .errors import LocalProtocolError, MessageError
from .frames import Buffer
from .identity import PeerId
from .wire import (
    ERROR_BODY,
    FRAGMENTABLE_KINDS,
    MAX_ERROR_TEXT,
    MAX_MESSAGE_LEN,
    MESSAGE_BEGIN,
    RPC_REQUEST,
    RPC_RESPONSE,
    STREAM_DATA,
    STREAM_END,
    ErrorCode,
    Kind,
)

#: prefix struct of each kind that has one (id, or id || status)
PREFIX = {
    Kind.RPC_REQUEST: RPC_REQUEST,
    Kind.RPC_RESPONSE: RPC_RESPONSE,
    Kind.STREAM_DATA: STREAM_DATA,
    Kind.STREAM_END: STREAM_END,
}
#: a prefixed body at most this long is copied behind its prefix into one frame
SMALL_COPY_LEN = 4096


class Message:
    """A delivered message: the authenticated sender, the kind and the payload.

    ``payload`` is a memoryview of a buffer the handler owns from then on.  ``id``
    is the RPC request id or stream id, ``status`` the RPC/stream status byte.
    (A plain slotted class: built once per message on the hot path.)
    """

    __slots__ = ("peer", "kind", "payload", "id", "status")

    def __init__(self, peer: PeerId, kind: Kind, payload: memoryview, id: int = 0, status: int = 0) -> None:
        self.peer = peer
        self.kind = kind
        self.payload = payload
        self.id = id
        self.status = status

    def __repr__(self) -> str:
        return f"Message(peer={self.peer}, kind={self.kind.name}, len={len(self.payload)}, id={self.id})"


#: int -> Kind without the enum constructor's cost
KIND_OF = {int(k): k for k in Kind}
_CONTINUE = int(Kind.MESSAGE_CONTINUE)
_BEGIN = int(Kind.MESSAGE_BEGIN)
_PREFIX_BY_INT = {int(k): v for k, v in PREFIX.items()}


def alloc(n: int) -> memoryview:
    """A writable buffer of n bytes; large ones are left uninitialised (np.empty)."""
    if n <= 65536:
        return memoryview(bytearray(n))
    return memoryview(np.empty(n, dtype=np.uint8)).cast("B")


def pack_prefix(kind: Kind, id: int, status: int) -> bytes:
    """The inner prefix of ``kind`` (empty for TENSOR_DATA and CONTROL)."""
    st = PREFIX.get(kind)
    if st is None:
        return b""
    return st.pack(id, status) if st.size == 9 else st.pack(id)


def chunk_sizes(n: int, chunk_len: int, ramp_len: int = 0) -> list[int]:
    """Payload lengths of the MESSAGE_CONTINUE frames that carry an ``n``-byte body.

    Without a ramp: ``chunk_len`` each, the last one shorter.  With ``0 < ramp_len <
    chunk_len``: the first frames grow from ``ramp_len`` (doubling) to ``chunk_len``
    and the last ones shrink back to ``ramp_len``, so the first seal and the last open,
    which no copy can hide, cost little (docs/protocol.md §9)."""
    if n <= 0:
        return []
    if not 0 < ramp_len < chunk_len:
        return [min(chunk_len, n - off) for off in range(0, n, chunk_len)]
    front: list[int] = []
    back: list[int] = []
    f = b = ramp_len
    rest = n
    while rest:
        take = min(f, rest)
        front.append(take)
        rest -= take
        f = min(2 * f, chunk_len)
        if rest and b < chunk_len:
            take = min(b, rest)
            back.append(take)
            rest -= take
            b *= 2
    return front + back[::-1]


#: a message body: one buffer, or a sequence of buffers sent as their concatenation (gathered)
Body = Union[Buffer, Sequence[Buffer]]


def pieces_of(payload: Body) -> list[Buffer]:
    """The non-empty byte buffers of a body, in order (a single buffer: itself)."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return [payload if isinstance(payload, bytes) else memoryview(payload).cast("B")]
    out: list[Buffer] = []
    for p in payload:
        view = p if isinstance(p, bytes) else memoryview(p).cast("B")
        if len(view):
            out.append(view)
    return out


def body_len(payload: Body) -> int:
    """Bytes of a body (one buffer or a sequence of them)."""
    if isinstance(payload, (bytes, bytearray)):
        return len(payload)
    if isinstance(payload, memoryview):
        return payload.nbytes
    return sum(len(p) if isinstance(p, (bytes, bytearray)) else memoryview(p).nbytes for p in payload)


def plan(
    kind: Kind, payload: Body, *, id: int = 0, status: int = 0, chunk_len: int, ramp_len: int = 0
) -> Iterator[tuple[Kind, Buffer]]:
    """The (frame kind, frame payload) sequence that carries one message (``ramp_len``:
    see ``chunk_sizes``).

    ``payload`` may be a sequence of buffers (a gathered body): the message is their
    concatenation, and a MESSAGE_CONTINUE frame that would span two of them is cut at
    the boundary instead of copied (frames of any length are valid on the wire), so the
    buffers are sealed and sent where they lie; only a body short enough for one frame
    is joined."""
    if kind not in FRAGMENTABLE_KINDS:
        raise LocalProtocolError(f"cannot send a message of kind {kind!r}")
    pieces = pieces_of(payload)
    n = sum(len(p) for p in pieces)
    prefix = pack_prefix(kind, id, status)
    small = n <= chunk_len if not prefix else n <= SMALL_COPY_LEN
    if small:
        body: Buffer = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        yield kind, (prefix + bytes(body)) if prefix else body
        return
    yield Kind.MESSAGE_BEGIN, MESSAGE_BEGIN.pack(kind, n) + prefix
    views = [memoryview(p) for p in pieces]
    i = off = 0
    for size in chunk_sizes(n, chunk_len, ramp_len):
        while size:
            view = views[i]
            take = min(size, len(view) - off)
            yield Kind.MESSAGE_CONTINUE, view[off : off + take]
            size -= take
            off += take
            if off == len(view):
                i, off = i + 1, 0


def encode_error(code: ErrorCode, text: str) -> bytes:
    """Error body: code (u16 BE) || UTF-8 text cut to MAX_ERROR_TEXT bytes (on a character boundary)."""
    raw = text.encode("utf-8", "replace")
    if len(raw) > MAX_ERROR_TEXT:
        raw = raw[:MAX_ERROR_TEXT].decode("utf-8", "ignore").encode()
    return ERROR_BODY.pack(int(code)) + raw


_CODES = {int(c): c for c in ErrorCode}


def decode_error(body: Buffer) -> tuple[ErrorCode, str]:
    """(code, text) of an error body; a body shorter than 2 bytes or a code this node
    does not know reads as UNKNOWN (the text is kept)."""
    view = memoryview(body).cast("B")
    if len(view) < ERROR_BODY.size:
        return ErrorCode.UNKNOWN, ""
    (value,) = ERROR_BODY.unpack_from(view)
    text = bytes(view[ERROR_BODY.size : ERROR_BODY.size + MAX_ERROR_TEXT]).decode("utf-8", "replace")
    return _CODES.get(value, ErrorCode.UNKNOWN), text


def _unprefix(kind: Kind, buf: memoryview) -> tuple[memoryview, int, int]:
    st = PREFIX.get(kind)
    if st is None:
        return buf, 0, 0
    if len(buf) < st.size:
        raise MessageError(f"{kind.name} message shorter than its {st.size}-byte prefix")
    fields = st.unpack_from(buf)
    return buf[st.size :], fields[0], fields[1] if len(fields) > 1 else 0


class Assembler:
    """Reassembles messages from opened frames of one connection.

    Per frame: ``destination(kind, n)`` says where to open the payload (it changes no
    state, because the header is not authenticated yet); after the frame
    authenticated, ``frame_done(kind, n)`` returns a complete ``Message`` or None.
    """

    def __init__(self, peer: PeerId, *, max_message_len: int = MAX_MESSAGE_LEN) -> None:
        self.peer = peer
        self.max_message_len = max_message_len
        self._small = memoryview(bytearray(MESSAGE_BEGIN.size + 9))
        self._single: memoryview | None = None
        self._kind: Kind | None = None  # inner kind of the message in progress
        self._body: memoryview | None = None
        self._prefix = (0, 0)
        self._off = 0

    @property
    def in_progress(self) -> bool:
        return self._body is not None

    def destination(self, kind: int, n: int) -> memoryview:
        """Where to open the payload of a frame with this (unauthenticated) header."""
        body = self._body
        if kind == _CONTINUE:
            if body is None:
                raise MessageError("MESSAGE_CONTINUE without a message in progress")
            off = self._off
            if off + n > len(body) or n == 0:
                raise MessageError("MESSAGE_CONTINUE runs past the announced message length")
            return body[off : off + n]
        if body is not None:
            raise MessageError(f"frame of kind 0x{kind:02x} inside a fragmented message")
        if kind == _BEGIN:
            if not MESSAGE_BEGIN.size <= n <= len(self._small):
                raise MessageError("MESSAGE_BEGIN of the wrong length")
            return self._small[:n]
        self._single = buf = memoryview(bytearray(n)) if n <= 65536 else alloc(n)
        return buf

    def frame_done(self, kind: int, n: int) -> Message | None:
        """Commit an authenticated frame; a complete message or None."""
        if kind == _CONTINUE:
            self._off += n
            return self._finish() if self._off == len(self._body or b"") else None
        if kind == _BEGIN:
            return self._begin(self._small[:n])
        buf, self._single = self._single, None
        assert buf is not None
        st = _PREFIX_BY_INT.get(kind)
        if st is None:
            return Message(self.peer, KIND_OF[kind], buf)
        payload, id_, status = _unprefix(KIND_OF[kind], buf)
        return Message(self.peer, KIND_OF[kind], payload, id_, status)

    def _begin(self, rec: memoryview) -> Message | None:
        inner, total = MESSAGE_BEGIN.unpack_from(rec)
        if inner not in FRAGMENTABLE_KINDS:
            raise MessageError(f"MESSAGE_BEGIN announces kind 0x{inner:02x}")
        if total > self.max_message_len:
            raise MessageError(f"message of {total} bytes exceeds the cap of {self.max_message_len}")
        kind = Kind(inner)
        st = PREFIX.get(kind)
        if len(rec) != MESSAGE_BEGIN.size + (st.size if st else 0):
            raise MessageError("MESSAGE_BEGIN prefix has the wrong length")
        fields = st.unpack_from(rec, MESSAGE_BEGIN.size) if st else (0, 0)
        self._kind, self._prefix = kind, (fields[0], fields[1] if len(fields) > 1 else 0)
        self._body, self._off = alloc(total), 0
        return self._finish() if total == 0 else None

    def _finish(self) -> Message:
        body, kind = self._body, self._kind
        assert body is not None and kind is not None
        self._body, self._kind, self._off = None, None, 0
        return Message(self.peer, kind, body, *self._prefix)
