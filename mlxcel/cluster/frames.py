"""Sans-I/O frame protection (docs/protocol.md "Frames").

A frame is ``kind(u8) || len(u32 BE) || ciphertext(len) || tag``.  The clear header
is the associated data; the 96-bit nonce is the direction's sequence number (big
endian, starting at 0, never sent, never wrapped).  ``FrameSealer`` and
``FrameOpener`` each own one direction of one connection; ``reader.FrameReader``
reads frames off a byte stream.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Union

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from .errors import FrameAuthError, FrameTooLarge, LocalProtocolError, SequenceExhausted, UnknownFrameKind
from .wire import FRAME_HEADER, FRAME_HEADER_LEN, KEY_LEN, KNOWN_KINDS, MAX_FRAME_LEN, NONCE_BYTES, SEQ_LIMIT, TAG_LEN, Suite

Buffer = Union[bytes, bytearray, memoryview]
_pack_header = FRAME_HEADER.pack


def _aead(suite: Suite, key: bytes) -> AESGCM | ChaCha20Poly1305 | None:
    if suite in (Suite.AES_256_GCM, Suite.CHACHA20_POLY1305, Suite.HMAC_SHA256) and len(key) != KEY_LEN:
        raise ValueError(f"frame keys are {KEY_LEN} bytes")
    if suite == Suite.AES_256_GCM:
        return AESGCM(key)
    if suite == Suite.CHACHA20_POLY1305:
        return ChaCha20Poly1305(key)
    return None


class _Direction:
    """Key, suite and sequence number of one direction."""

    def __init__(self, suite: Suite, key: bytes, seq_limit: int) -> None:
        self.suite = Suite(suite)
        self.tag_len = TAG_LEN[self.suite]
        self._key = key
        self._aead = _aead(self.suite, key)
        self.seq = 0
        self.seq_limit = seq_limit
        self.failed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(suite={self.suite.name}, seq={self.seq})"

    def _nonce(self) -> bytes:
        if self.seq >= self.seq_limit:
            raise SequenceExhausted("this direction used its last sequence number; the connection must close")
        return self.seq.to_bytes(NONCE_BYTES, "big")

    @property
    def aead(self) -> bool:
        """True for the AEAD suites (whose chunks a ``pipeline`` may seal and open on helpers)."""
        return self._aead is not None

    def new_aead(self) -> AESGCM | ChaCha20Poly1305 | None:
        """A fresh AEAD context under this direction's key (one per pipeline slot)."""
        return _aead(self.suite, self._key)

    def _hmac(self, nonce: bytes, header: Buffer, payload: Buffer) -> bytes:
        h = hmac.new(self._key, nonce, hashlib.sha256)
        h.update(header)
        h.update(payload)
        return h.digest()


class FrameSealer(_Direction):
    """Seals outgoing frames of one direction; reuses one scratch buffer."""

    def __init__(self, suite: Suite, key: bytes, *, max_frame_len: int = MAX_FRAME_LEN, seq_limit: int = SEQ_LIMIT) -> None:
        super().__init__(suite, key, seq_limit)
        self.max_frame_len = max_frame_len
        self._scratch = bytearray()
        self._view = memoryview(self._scratch)

    def seal_parts(self, kind: int, payload: Buffer) -> tuple[tuple[Buffer, ...], int]:
        """(buffers for ``sendmsg``, their total length); valid until the next call."""
        n = len(payload)
        if n > self.max_frame_len:
            raise LocalProtocolError(f"frame of {n} bytes exceeds the cap of {self.max_frame_len}")
        seq = self.seq
        if seq >= self.seq_limit:
            raise SequenceExhausted("this direction used its last sequence number; the connection must close")
        self.seq = seq + 1
        header = _pack_header(kind, n)
        aead = self._aead
        if aead is not None:
            total = FRAME_HEADER_LEN + n + self.tag_len
            if len(self._scratch) < total:
                self._scratch = bytearray(total)
                self._view = memoryview(self._scratch)
            out = self._view[:total]
            out[:FRAME_HEADER_LEN] = header
            aead.encrypt_into(seq.to_bytes(NONCE_BYTES, "big"), payload, header, out[FRAME_HEADER_LEN:])
            return (out,), total
        if self.suite == Suite.HMAC_SHA256:
            return (header, payload, self._hmac(seq.to_bytes(NONCE_BYTES, "big"), header, payload)), n + FRAME_HEADER_LEN + self.tag_len
        return (header, payload), n + FRAME_HEADER_LEN

    def reserve(self, count: int) -> int | None:
        """Take ``count`` consecutive sequence numbers for ``prepare_at``; the first, or
        None (nothing taken) when they would reach the limit."""
        seq = self.seq
        if seq + count > self.seq_limit:
            return None
        self.seq = seq + count
        return seq

    def prepare_at(self, seq: int, kind: int, payload: Buffer, out: memoryview) -> tuple[int, tuple[bytes, Buffer, bytes, memoryview]]:
        """Write the header of a frame under a ``reserve``d ``seq`` into ``out``; returns
        the frame's length and the arguments of ``encrypt_into`` (nonce, payload, AAD,
        where the ciphertext || tag go), which any thread may then run on an AEAD
        context from ``new_aead``."""
        n = len(payload)
        if n > self.max_frame_len:
            raise LocalProtocolError(f"frame of {n} bytes exceeds the cap of {self.max_frame_len}")
        header = _pack_header(kind, n)
        total = FRAME_HEADER_LEN + n + self.tag_len
        out[:FRAME_HEADER_LEN] = header
        return total, (seq.to_bytes(NONCE_BYTES, "big"), payload, header, out[FRAME_HEADER_LEN:total])

    def seal(self, kind: int, payload: Buffer) -> bytes:
        """The whole frame as one bytes object."""
        return b"".join(bytes(p) for p in self.seal_parts(kind, payload)[0])


class FrameOpener(_Direction):
    """Checks and opens incoming frames of one direction, strictly in order."""

    def __init__(self, suite: Suite, key: bytes, *, max_frame_len: int = MAX_FRAME_LEN, seq_limit: int = SEQ_LIMIT) -> None:
        super().__init__(suite, key, seq_limit)
        self.max_frame_len = max_frame_len

    @property
    def plaintext_on_wire(self) -> bool:
        """True when the body is the payload itself (unprotected, HMAC): read it in place."""
        return self._aead is None

    def parse_header(self, header: Buffer) -> tuple[int, int]:
        """(kind, len) of a 5-byte header; refuses an oversize len before any body is read."""
        if self.failed:
            raise LocalProtocolError("this direction already failed; the connection must close")
        kind, n = FRAME_HEADER.unpack(header)
        if n > self.max_frame_len:
            self.failed = True
            raise FrameTooLarge(f"frame header announces {n} bytes, above the cap of {self.max_frame_len}")
        return kind, n

    def open_into(self, header: Buffer, body: Buffer, out: Buffer) -> int:
        """Authenticate ``body`` (ciphertext || tag) and write the payload to ``out``; returns the kind."""
        kind, n = self.parse_header(header)
        return self.open_parsed(kind, n, header, body, out)

    def open_parsed(self, kind: int, n: int, header: Buffer, body: Buffer, out: Buffer) -> int:
        """``open_into`` for a header already checked by ``parse_header`` (the hot path)."""
        if len(body) != n + self.tag_len or len(out) < n:
            raise LocalProtocolError("body or output buffer has the wrong length")
        if self._aead is not None:
            self._decrypt(header, body, out, n)
        else:
            out[:n] = body[:n]
            self._verify_plain(header, out[:n], body[n:])
        return self._accept(kind)

    def open_frame(self, frame: memoryview, kind: int, n: int, out: Buffer) -> int:
        """Hot path: ``frame`` is header || ciphertext || tag, its header already
        checked by ``parse_header`` (or the same bound); opens into ``out`` (n bytes)."""
        if self.failed:
            raise LocalProtocolError("this direction already failed; the connection must close")
        seq = self.seq
        if seq >= self.seq_limit:
            raise SequenceExhausted("this direction used its last sequence number; the connection must close")
        aead = self._aead
        if aead is None:
            return self.open_parsed(kind, n, frame[:FRAME_HEADER_LEN], frame[FRAME_HEADER_LEN:], out)
        try:
            aead.decrypt_into(seq.to_bytes(NONCE_BYTES, "big"), frame[FRAME_HEADER_LEN:], frame[:FRAME_HEADER_LEN], out)
        except InvalidTag:
            self.failed = True
            raise FrameAuthError(f"frame {seq} failed authentication (altered, replayed, reordered or from another connection)") from None
        self.seq = seq + 1
        if kind not in KNOWN_KINDS:
            self.failed = True
            raise UnknownFrameKind(f"authenticated frame of unknown kind 0x{kind:02x}")
        return kind

    def reserve(self) -> int:
        """The next frame's sequence number, for a frame opened elsewhere (a pipeline
        helper; frames are reserved in arrival order, see ``auth_failed``)."""
        if self.failed:
            raise LocalProtocolError("this direction already failed; the connection must close")
        seq = self.seq
        if seq >= self.seq_limit:
            raise SequenceExhausted("this direction used its last sequence number; the connection must close")
        self.seq = seq + 1
        return seq

    def auth_failed(self, seq: int) -> FrameAuthError:
        """Fail the direction for frame ``seq`` (opened elsewhere, e.g. by a pipeline
        helper with ``decrypt_into`` under the nonce of a ``reserve``d ``seq``); the
        error to raise."""
        self.failed = True
        return FrameAuthError(f"frame {seq} failed authentication (altered, replayed, reordered or from another connection)")

    def verify_in_place(self, header: Buffer, payload: Buffer, tag: Buffer) -> int:
        """For ``plaintext_on_wire`` suites: authenticate a payload read straight into place."""
        kind, n = self.parse_header(header)
        if not self.plaintext_on_wire or len(payload) != n or len(tag) != self.tag_len:
            raise LocalProtocolError("verify_in_place needs a plaintext suite and exact lengths")
        self._verify_plain(header, payload, tag)
        return self._accept(kind)

    def open(self, header: Buffer, body: Buffer) -> bytes:
        """Convenience: authenticate and return the payload as bytes."""
        _, n = self.parse_header(header)
        out = bytearray(n)
        self.open_into(header, body, out)
        return bytes(out)

    def _decrypt(self, header: Buffer, body: Buffer, out: Buffer, n: int) -> None:
        nonce = self._nonce()
        try:
            self._aead.decrypt_into(nonce, body, header, out if len(out) == n else memoryview(out)[:n])  # type: ignore[union-attr]
        except InvalidTag:
            self.failed = True
            raise FrameAuthError(f"frame {self.seq} failed authentication (altered, replayed, reordered or from another connection)") from None

    def _verify_plain(self, header: Buffer, payload: Buffer, tag: Buffer) -> None:
        nonce = self._nonce()
        if self.suite == Suite.HMAC_SHA256 and not hmac.compare_digest(self._hmac(nonce, header, payload), bytes(tag)):
            self.failed = True
            raise FrameAuthError(f"frame {self.seq} failed authentication (altered, replayed, reordered or from another connection)")

    def _accept(self, kind: int) -> int:
        self.seq += 1
        if kind not in KNOWN_KINDS:
            self.failed = True
            raise UnknownFrameKind(f"authenticated frame of unknown kind 0x{kind:02x}")
        return kind
