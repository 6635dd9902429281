"""A KV handoff split over several streams (docs/disagg.md §4.9), sans-I/O.

The header stream carries HEADER and ``SPLIT`` (N, 2..16); each of N *part streams* starts with a
``PART`` record (the header stream's id, its index i, N) and carries the tensor bytes
``[floor(i*T/N), floor((i+1)*T/N))`` of the handoff's T, as CHUNK parts (indices 0, 1, ... within the
part stream) and an END of its own counts. The ranges follow from T and N alone, so no sender-written
offset is ever used: a part stream can only be a duplicate, an index out of 0..N-1, or carry more or
fewer bytes than its range, each refused by name. ``SplitAssembly`` writes each range into the tensor
buffers at its offset, from several threads at once (each copy outside the lock), under the single
stream's memory rule: a tensor's buffer is made only while the buffers' unfilled bytes stay within the
bytes received plus ``MAX_KV_CHUNK_LEN``.
"""

from __future__ import annotations

import bisect
import struct
import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from mlxcel.disagg.wire import MAX_KV_CHUNK_LEN, MAX_KV_SPLIT, KV_CHUNK_LEN, Part
from mlxcel.error_codes import ErrorCode

#: part byte, the part stream count N
SPLIT = struct.Struct(">BB")
#: part byte, the header stream's id, the part's index, N
PART = struct.Struct(">BQBB")
_CHUNK = struct.Struct(">BI")
_END = struct.Struct(">BIQ")


def ranges(total: int, count: int) -> list[tuple[int, int]]:
    """The tensor-byte range of each of ``count`` part streams of a ``total``-byte handoff."""
    bounds = [i * total // count for i in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def encode_split(count: int) -> bytes:
    """The SPLIT part that follows the HEADER of a handoff split over ``count`` part streams."""
    if not 2 <= count <= MAX_KV_SPLIT:
        raise ValueError(f"a split handoff has 2..{MAX_KV_SPLIT} part streams, not {count}")
    return SPLIT.pack(Part.SPLIT, count)


def encode_part(header_stream: int, index: int, count: int) -> bytes:
    """The PART record that opens part stream ``index`` of ``count`` of the handoff on ``header_stream``."""
    return PART.pack(Part.PART, header_stream, index, count)


def parse_part(view: memoryview, error: Callable[..., Exception]) -> tuple[int, int, int]:
    """(header stream id, index, N) of a PART record; ``error(message, code)`` when it is not one."""
    if len(view) != PART.size or view[0] != Part.PART:
        raise error(f"a part stream must open with a {PART.size}-byte PART record", ErrorCode.BAD_REQUEST)
    _, stream, index, count = PART.unpack(view)
    if not 2 <= count <= MAX_KV_SPLIT or index >= count:
        raise error(f"part {index} of {count} is outside a split of 2..{MAX_KV_SPLIT} part streams",
                    ErrorCode.BAD_REQUEST)
    return stream, index, count


def total_bytes(tensors: Iterable[Any]) -> int:
    """Tensor bytes of ``tensors`` (arrays or buffers)."""
    return sum(memoryview(t).nbytes if isinstance(t, (bytes, bytearray, memoryview)) else np.asarray(t).nbytes
               for t in tensors)


def range_parts(runs: Iterable[memoryview], lo: int, hi: int, chunk_len: int = KV_CHUNK_LEN
                ) -> Iterator[tuple[Any, ...]]:
    """The CHUNK parts of bytes ``[lo, hi)`` of the concatenated byte views ``runs`` (``kv_codec``'s
    ``contiguous_runs`` of each tensor; the parts are views of them, as ``chunk_parts``), then END."""
    index = size = pos = 0
    pending: list[memoryview] = []
    for view in runs:
        if pos + len(view) <= lo:
            pos += len(view)
            continue
        if pos >= hi:
            break
        view, pos = view[max(0, lo - pos):min(len(view), hi - pos)], max(pos, lo)
        while len(view):
            take = min(len(view), chunk_len - size)
            pending.append(view[:take])
            view, size, pos = view[take:], size + take, pos + take
            if size == chunk_len:
                yield (_CHUNK.pack(Part.CHUNK, index), *pending)
                index, pending, size = index + 1, [], 0
    if size:
        yield (_CHUNK.pack(Part.CHUNK, index), *pending)
        index += 1
    yield (_END.pack(Part.END, index, hi - lo),)


class SplitAssembly:
    """The tensors of a split handoff, filled from N part streams (each fed in order, any thread)."""

    def __init__(self, specs: list[Any], count: int, allocate: Callable[[Any], tuple[np.ndarray, Any]],
                 dtypes: dict, error: Callable[..., Exception]):
        self.specs, self.count, self._allocate, self._dtypes, self._error = specs, count, allocate, dtypes, error
        self.starts = [0]
        for s in specs:
            self.starts.append(self.starts[-1] + s.nbytes)
        self.total = self.starts[-1]
        self.ranges = ranges(self.total, count)
        self.cursor: dict[int, int] = {}  # part index -> next tensor-byte offset
        self.chunks: dict[int, int] = {}  # part index -> chunks received
        self.ended: set[int] = set()
        self.arrs: list[np.ndarray | None] = [None] * len(specs)
        self.owners: list[Any] = [None] * len(specs)
        self.pieces: list[list[tuple[int, memoryview]]] = [[] for _ in specs]
        self.have = [0] * len(specs)
        self.received = self.unfilled = self.allocated = 0
        self.lock = threading.Lock()

    @property
    def done(self) -> bool:
        return len(self.ended) == self.count

    @property
    def held(self) -> int:
        with self.lock:
            return (sum(a.nbytes for a in self.arrs if a is not None)
                    + sum(len(v) for p in self.pieces for _, v in p))

    def start(self, index: int, count: int) -> None:
        """Part stream ``index`` of ``count`` opened (its PART record)."""
        with self.lock:
            if count != self.count:
                raise self._error(f"part {index} names a split of {count}; the header stream's SPLIT says {self.count}",
                                  ErrorCode.BAD_REQUEST)
            if index in self.cursor:
                raise self._error(f"part {index} of this handoff arrived twice", ErrorCode.BAD_REQUEST)
            self.cursor[index], self.chunks[index] = self.ranges[index][0], 0

    def chunk(self, index: int, view: memoryview) -> None:
        """A CHUNK part of part stream ``index``: its bytes go to their tensors at the range's cursor."""
        if len(view) < _CHUNK.size:
            raise self._error("a chunk part is cut short", ErrorCode.BAD_REQUEST)
        seq, data = _CHUNK.unpack_from(view)[1], view[_CHUNK.size:]
        copies: list[tuple[np.ndarray, int, memoryview]] = []
        with self.lock:
            self._check(index, seq, len(data))
            off = self.cursor[index]
            self.cursor[index] += len(data)
            self.chunks[index] += 1
            self.received += len(data)
            t = bisect.bisect_right(self.starts, off) - 1
            while len(data):
                while self.specs[t].nbytes == 0:
                    t += 1
                inner = off - self.starts[t]
                take = min(len(data), self.specs[t].nbytes - inner)
                self._place(t, inner, data[:take], copies)
                data, off, t = data[take:], off + take, t + 1
        for flat, at, piece in copies:  # the one copy of these bytes, beside other part streams' (no lock)
            flat[at:at + len(piece)] = np.frombuffer(piece, np.uint8)

    def _check(self, index: int, seq: int, length: int) -> None:
        if index in self.ended:
            raise self._error(f"part {index} sent a chunk after its END", ErrorCode.BAD_REQUEST)
        if seq != self.chunks[index]:
            raise self._error(f"part {index}: chunk {seq} arrived where chunk {self.chunks[index]} was due",
                              ErrorCode.BAD_REQUEST)
        if not 0 < length <= MAX_KV_CHUNK_LEN:
            raise self._error(f"a chunk of {length} bytes is outside 1..{MAX_KV_CHUNK_LEN}")
        lo, hi = self.ranges[index]
        if self.cursor[index] + length > hi:
            raise self._error(f"part {index} carries more than its {hi - lo} tensor bytes ({lo}..{hi})")

    def _place(self, t: int, inner: int, piece: memoryview, copies: list) -> None:
        """Bytes ``inner..`` of tensor ``t``: into its buffer (made now if the rule allows) or kept as a view."""
        spec = self.specs[t]
        if self.arrs[t] is None and self.unfilled + spec.nbytes - self.have[t] <= self.received + MAX_KV_CHUNK_LEN:
            self._open(t)
        if self.arrs[t] is not None:
            copies.append((_flat(self.arrs[t]), inner, piece))
            self.unfilled -= len(piece)
        else:
            self.pieces[t].append((inner, piece))
        self.have[t] += len(piece)

    def _open(self, t: int) -> None:
        spec = self.specs[t]
        try:
            arr, owner = self._allocate(spec)
        except (MemoryError, ValueError, RuntimeError) as exc:
            raise self._error(f"cannot make a {spec.nbytes}-byte tensor buffer: {exc}", ErrorCode.INTERNAL) from None
        if arr.shape != spec.shape or arr.dtype != self._dtypes[spec.dtype] or not arr.flags.c_contiguous:
            raise self._error(f"the allocator made a {arr.dtype} {list(arr.shape)} buffer for a "
                              f"{spec.dtype.name.lower()} {list(spec.shape)} tensor", ErrorCode.INTERNAL)
        flat = _flat(arr)
        for at, piece in self.pieces[t]:
            flat[at:at + len(piece)] = np.frombuffer(piece, np.uint8)
        self.arrs[t], self.owners[t], self.pieces[t] = arr, owner, []
        self.unfilled += spec.nbytes - self.have[t]
        self.allocated += arr.nbytes

    def end(self, index: int, view: memoryview) -> bool:
        """Part stream ``index``'s END (its counts must be its chunks and its range's length); True when
        it was the last part stream's."""
        if len(view) != _END.size:
            raise self._error("the END record has the wrong length", ErrorCode.BAD_REQUEST)
        _, chunks, total = _END.unpack(view)
        with self.lock:
            lo, hi = self.ranges[index]
            if index in self.ended or chunks != self.chunks[index] or total != hi - lo or self.cursor[index] != hi:
                raise self._error(f"part {index} ended after {self.chunks[index]} chunks and "
                                  f"{self.cursor[index] - lo} of its {hi - lo} tensor bytes (END says {chunks} "
                                  f"and {total})")
            self.ended.add(index)
            return self.done

    def tensors(self) -> tuple[list[np.ndarray], list[Any]]:
        """Every tensor, in wire order (after the last END), and its owner."""
        out = []
        for t, spec in enumerate(self.specs):
            if self.arrs[t] is not None:
                out.append(self.arrs[t])
                continue
            raw = b"".join(bytes(v) for _, v in sorted(self.pieces[t], key=lambda p: p[0]))
            out.append(np.frombuffer(raw, dtype=self._dtypes[spec.dtype]).reshape(spec.shape))
        return out, list(self.owners)

    def drop(self) -> None:
        with self.lock:
            self.arrs, self.owners = [None] * len(self.specs), [None] * len(self.specs)
            self.pieces = [[] for _ in self.specs]


def _flat(arr: np.ndarray) -> np.ndarray:
    return arr.reshape(-1).view(np.uint8)
