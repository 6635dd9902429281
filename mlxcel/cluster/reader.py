"""Sans-I/O frame reader (docs/protocol.md §4): bytes in, authenticated frames out.

One ``FrameReader`` per receiving direction.  The socket connection drives it the
same way the byte-by-byte tests do:

* ``read_frame()`` returns ``(kind, n)`` for the next frame once it authenticated,
  its payload opened into ``destination(kind, n)`` (the message assembler's buffer),
  or None while bytes are missing;
* then ``recv_target()`` says where the next bytes go (a writable view, and whether
  the driver should fill it exactly, e.g. with MSG_WAITALL), and ``received(n)``
  commits the ``n`` bytes written there.

``receive_data(bytes)`` / ``next_frame()`` feed the same machine from bytes already
read (tests, fuzzing, other I/O).  An oversize ``len`` is refused as soon as its
header is in, before any body byte is read or allocated.

How bytes travel (the hot path matters: a decode step sends a few KiB per token):
an AEAD frame that fits the fixed buffer (``capacity``) is read there, header and
body usually by one opportunistic receive that may also pick up the next header,
then opened straight into its destination.  A larger AEAD frame goes into a one-off
buffer of its exact size.  With a plaintext suite (unprotected, HMAC) the body is
read straight into its destination and authenticated in place.

With an ``OpenPipeline`` (``aead_pipeline.py``), in a message whose authenticated MESSAGE_BEGIN announces
at least ``pipeline_min_len`` body bytes, a MESSAGE_CONTINUE frame's ciphertext is
received into one of the pipeline's slots and opened by a helper thread while the
next frame is received: ``read_frame`` then returns the frame before it
authenticated, and the driver must call ``drain()`` before it uses a message that
such a frame completed (``next_frame`` drains by itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .frames import Buffer, FrameOpener
from .messages import alloc
from .wire import DEFAULT_CHUNK_LEN, FRAME_HEADER, FRAME_HEADER_LEN, MESSAGE_BEGIN, Kind

if TYPE_CHECKING:
    from .aead_pipeline import OpenPipeline

_unpack_header = FRAME_HEADER.unpack_from
_CONTINUE = int(Kind.MESSAGE_CONTINUE)
_BEGIN = int(Kind.MESSAGE_BEGIN)

#: a missing stretch at least this long is received exactly (one MSG_WAITALL call)
BIG = 65536
DEFAULT_CAPACITY = DEFAULT_CHUNK_LEN + 64

# states of the frame in progress
_HEADER = 0  # waiting for the 5-byte header
_BUFFERED = 1  # header checked; waiting for the whole frame in the buffer
_DIRECT = 2  # header consumed; body (plaintext) or body || tag (AEAD) goes into ``_direct``
_TAG = 3  # plaintext suites: body in place; waiting for the tag in the buffer

Destination = Callable[[int, int], memoryview]


@dataclass(frozen=True, slots=True)
class Frame:
    """One opened frame (the ``next_frame`` convenience API)."""

    kind: int
    payload: bytes


def _fresh(kind: int, n: int) -> memoryview:
    return memoryview(bytearray(n))


class FrameReader:
    """Reads the frames of one direction; see the module docstring for the protocol."""

    def __init__(
        self,
        opener: FrameOpener,
        *,
        destination: Destination | None = None,
        capacity: int = DEFAULT_CAPACITY,
        pipeline: "OpenPipeline | None" = None,
        pipeline_min_len: int = 0,
    ) -> None:
        if capacity < FRAME_HEADER_LEN + opener.tag_len:
            raise ValueError(f"capacity must hold at least a header and a tag ({FRAME_HEADER_LEN + opener.tag_len} bytes)")
        self._opener = opener
        self._destination = destination or _fresh
        self._plain = opener.plaintext_on_wire
        self._tag_len = opener.tag_len
        self._max_len = opener.max_frame_len
        self.capacity = capacity
        self._buf = bytearray(capacity)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # buffered bytes are _buf[_start:_end]
        self._state = _HEADER
        self._kind = self._n = self._total = 0
        self._dst: memoryview | None = None
        self._header = b""
        self._direct: memoryview | None = None
        self._doff = 0
        self._backlog = bytearray()  # receive_data bytes not yet moved into a target
        self._pipe = pipeline if pipeline is not None and not self._plain else None
        self._deferred = False  # the _DIRECT frame in progress goes to a pipeline slot
        self._exact_header = False  # pipeline only: after MESSAGE_BEGIN or a deferred frame, receive the next header alone
        self._pipeline_min_len = pipeline_min_len
        self._piped = False  # the last MESSAGE_BEGIN announced at least pipeline_min_len bytes: its chunks go to the pipeline

    def __repr__(self) -> str:
        return f"FrameReader(state={self._state}, buffered={self.buffered})"

    # -- the driver API --

    def read_frame(self) -> tuple[int, int] | None:
        """(kind, payload length) of the next authenticated frame, or None until it is in.

        Raises ``FrameError`` (authentication, oversize len, unknown kind) or
        ``SequenceExhausted``; the direction is then failed for good."""
        if self._pipe is not None and self._opener.failed:
            self._pipe.drain()  # raises the helper's authentication failure
        start = self._start
        if self._state == _HEADER and self._end - start >= FRAME_HEADER_LEN:
            # hot path: the whole frame is buffered (one receive brought it in)
            kind, n = _unpack_header(self._buf, start)
            end = start + FRAME_HEADER_LEN + n + self._tag_len
            if end <= self._end and n <= self._max_len and not (kind == _CONTINUE and self._deferrable(n)):
                dst = self._destination(kind, n)
                if end == self._end:
                    self._start = self._end = 0
                else:
                    self._start = end
                kind = self._opener.open_frame(self._view[start:end], kind, n, dst)
                self._opened(kind, dst)
                return kind, n
        if not self._advance():
            return None
        return self._finish()

    def _opened(self, kind: int, dst: memoryview) -> None:
        """After a buffered frame authenticated: a MESSAGE_BEGIN says (by the body length it announces) whether the
        message's chunks go to the pipeline; if they do, each of their headers is received alone."""
        if kind == _BEGIN and self._pipe is not None:
            # (the assembler refuses a MESSAGE_BEGIN of another length before it is opened; other destinations may not)
            self._piped = len(dst) >= MESSAGE_BEGIN.size and MESSAGE_BEGIN.unpack_from(dst)[1] >= self._pipeline_min_len
            self._exact_header = self._piped
        else:
            self._exact_header = False

    def _deferrable(self, n: int) -> bool:
        """A MESSAGE_CONTINUE of ``n`` bytes goes to a pipeline slot (even when buffered)."""
        return self._piped and self._pipe is not None and self._pipe.accepts(n)

    def bytes_needed(self) -> int:
        """Bytes still missing before the frame in progress can be returned (its
        header while the length is unknown)."""
        self._advance()
        have = self._end - self._start
        state = self._state
        if state == _HEADER:
            return FRAME_HEADER_LEN - have
        if state == _BUFFERED:
            return max(0, self._total - have)
        if state == _DIRECT:
            assert self._direct is not None
            return len(self._direct) - self._doff + (self._tag_len if self._plain else 0)
        return max(0, self._tag_len - have)

    def recv_target(self) -> tuple[memoryview, bool]:
        """(where the next bytes go, whether to fill it exactly); call after
        ``read_frame`` returned None, then ``received``."""
        if self._state == _DIRECT:
            assert self._direct is not None
            return self._direct[self._doff :], True
        state = self._state
        want = FRAME_HEADER_LEN if state == _HEADER else self._total if state == _BUFFERED else self._tag_len
        start, end = self._start, self._end
        if start + want > self.capacity:  # move the partial record to the front
            have = end - start
            self._buf[:have] = self._buf[start:end]
            self._start, self._end = start, end = 0, have
        need = want - (end - start)
        if need >= BIG or (self._exact_header and state == _HEADER):
            return self._view[end : end + need], True
        return self._view[end:], False

    def received(self, n: int) -> None:
        """Commit ``n`` bytes written at the start of the last ``recv_target`` view."""
        if self._state == _DIRECT:
            self._doff += n
        else:
            self._end += n

    # -- the bytes API --

    def receive_data(self, data: Buffer) -> None:
        """Buffer bytes (any split); a newly complete header is checked at once."""
        self._backlog += data
        self._pump()

    def next_frame(self) -> Frame | None:
        """The next whole frame, authenticated, or None until it is buffered."""
        self._pump()
        if not self._advance():
            return None
        payload = self._dst
        assert payload is not None
        kind, n = self._finish()
        self.drain()
        return Frame(kind, bytes(payload[:n]))

    def drain(self) -> None:
        """Wait until every frame returned so far authenticated (opens on helper
        threads); raises the first failure.  A no-op without a pipeline."""
        if self._pipe is not None:
            self._pipe.drain()

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as part of a frame."""
        n = self._end - self._start + len(self._backlog)
        if self._state in (_DIRECT, _TAG):
            n += FRAME_HEADER_LEN + self._doff
        return n

    def _pump(self) -> None:
        backlog = self._backlog
        while not self._advance() and backlog:
            target, _ = self.recv_target()
            k = min(len(target), len(backlog))
            target[:k] = backlog[:k]
            del backlog[:k]
            self.received(k)

    # -- the state machine --

    def _advance(self) -> bool:
        """Move as far as the buffered bytes allow; True when the frame is complete."""
        state = self._state
        if state == _HEADER:
            if self._end - self._start < FRAME_HEADER_LEN:
                return False
            state = self._parse_header()
        if state == _BUFFERED:
            return self._end - self._start >= self._total
        if state == _DIRECT:
            direct = self._direct
            assert direct is not None
            off = self._doff
            want = len(direct) - off
            have = self._end - self._start
            if want and have:
                k = min(have, want)
                direct[off : off + k] = self._view[self._start : self._start + k]
                self._consume(k)
                self._doff = off = off + k
            if off < len(direct):
                return False
            if not self._plain:
                return True
            self._state = _TAG
        return self._end - self._start >= self._tag_len

    def _parse_header(self) -> int:
        start = self._start
        kind, n = _unpack_header(self._buf, start)
        opener = self._opener
        if n > self._max_len or opener.failed:
            opener.parse_header(self._view[start : start + FRAME_HEADER_LEN])  # raises
        self._dst = self._destination(kind, n)
        self._kind, self._n = kind, n
        self._exact_header = False
        pipe = self._pipe
        if pipe is not None and self._piped and kind == _CONTINUE and pipe.accepts(n):
            self._header = bytes(self._view[start : start + FRAME_HEADER_LEN])
            self._consume(FRAME_HEADER_LEN)
            self._direct = pipe.slot(n + self._tag_len)
            self._doff = 0
            self._deferred = True
            self._state = _DIRECT
            return _DIRECT
        total = FRAME_HEADER_LEN + n + self._tag_len
        if not self._plain and total <= self.capacity:
            self._total = total
            self._state = _BUFFERED
            return _BUFFERED
        self._header = bytes(self._view[start : start + FRAME_HEADER_LEN])
        self._consume(FRAME_HEADER_LEN)
        self._direct = self._dst if self._plain else alloc(n + self._tag_len)
        self._doff = 0
        self._state = _DIRECT
        return _DIRECT

    def _finish(self) -> tuple[int, int]:
        state, kind, n, dst = self._state, self._kind, self._n, self._dst
        assert dst is not None
        self._state, self._dst = _HEADER, None
        if state == _BUFFERED:
            start = self._start
            frame = self._view[start : start + self._total]
            self._consume(self._total)
            kind = self._opener.open_frame(frame, kind, n, dst)
            self._opened(kind, dst)
            return kind, n
        body, self._direct, self._doff = self._direct, None, 0
        if state == _DIRECT:  # AEAD frame larger than the buffer, or deferred to a helper
            assert body is not None
            if self._deferred:
                assert self._pipe is not None
                self._deferred = False
                self._exact_header = True
                self._pipe.submit(self._opener.reserve(), self._header, body, dst)
                return kind, n
            return self._opener.open_parsed(kind, n, self._header, body, dst), n
        start = self._start
        tag = self._view[start : start + self._tag_len]
        self._consume(self._tag_len)
        return self._opener.verify_in_place(self._header, dst, tag), n

    def _consume(self, k: int) -> None:
        start = self._start + k
        if start == self._end:
            self._start = self._end = 0
        else:
            self._start = start
