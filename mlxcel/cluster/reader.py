"""Buffered exact reads of frames off a blocking socket."""

from __future__ import annotations

import socket

from .messages import alloc
from .wire import FRAME_HEADER, FRAME_HEADER_LEN

_unpack_header = FRAME_HEADER.unpack_from


class SocketReader:
    """Buffered exact reads off a blocking socket.

    Small records (a header, a whole small frame, a tag) come from one opportunistic
    ``recv_into`` that may also pick up the next header; large bodies are read with
    MSG_WAITALL straight into their destination.  Views returned by ``take`` are valid
    until the next call.
    """

    BIG = 65536

    def __init__(self, sock: socket.socket, capacity: int) -> None:
        self.sock = sock
        self.capacity = capacity
        self._buf = bytearray(capacity)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _recv(self, view: memoryview, flags: int = 0) -> int:
        r = self.sock.recv_into(view, len(view), flags)
        if r == 0:
            raise EOFError
        return r

    def frame(self, tag_len: int, max_len: int) -> tuple[int, int, memoryview | None]:
        """Hot path: (kind, len, view of the whole frame, consumed) when the frame fits
        the buffer and its len is within ``max_len``; else (kind, len, None) with
        nothing consumed and nothing read past the header."""
        if self._end - self._start < FRAME_HEADER_LEN:
            self._fill(FRAME_HEADER_LEN)
        start = self._start
        kind, n = _unpack_header(self._buf, start)
        total = FRAME_HEADER_LEN + n + tag_len
        if n > max_len or total > self.capacity:
            return kind, n, None
        if self._end - start < total:
            self._fill(total)
            start = self._start
        end = start + total
        if end == self._end:
            self._start = self._end = 0
        else:
            self._start = end
        return kind, n, self._view[start:end]

    def peek(self, n: int) -> memoryview:
        """The next ``n`` bytes without consuming them (valid until the next call)."""
        if self._end - self._start < n:
            self._fill(n)
        return self._view[self._start : self._start + n]

    def take(self, n: int) -> memoryview:
        """The next ``n`` bytes (n <= capacity), consumed."""
        if self._end - self._start < n:
            self._fill(n)
        start = self._start
        self._start = start + n
        if self._start == self._end:
            self._start = self._end = 0
        return self._view[start : start + n]

    def _fill(self, n: int) -> None:
        if self._start + n > self.capacity:
            have = self._end - self._start
            self._buf[:have] = self._buf[self._start : self._end]
            self._start, self._end = 0, have
        while self._end - self._start < n:
            need = n - (self._end - self._start)
            if need >= self.BIG:
                self._end += self._recv(self._view[self._end : self._end + need], socket.MSG_WAITALL)
            else:
                self._end += self._recv(self._view[self._end :])

    def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` exactly: buffered bytes first, the rest straight from the socket."""
        k = min(self._end - self._start, len(dst))
        if k:
            dst[:k] = self._view[self._start : self._start + k]
            self._start += k
            if self._start == self._end:
                self._start = self._end = 0
        while k < len(dst):
            k += self._recv(dst[k:], socket.MSG_WAITALL)

    def read_large(self, n: int) -> memoryview:
        """``n`` bytes (n > capacity) in a one-off buffer (not retained)."""
        view = alloc(n)
        self.read_into(view)
        return view
