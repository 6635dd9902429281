"""The sender's side of the KV handoff's CHUNK and END parts (docs/disagg.md §4.2): views of the tensors'
own memory, never joined (``kv_codec`` re-exports these)."""

from __future__ import annotations

import struct
from typing import Any, Iterable, Iterator

import numpy as np

from mlxcel.disagg.wire import KV_CHUNK_LEN, MAX_KV_CHUNK_LEN, Part

_CHUNK = struct.Struct(">BI")
_END = struct.Struct(">BIQ")


def encode_chunks(tensors: Iterable[Any], chunk_len: int = KV_CHUNK_LEN) -> Iterator[bytes]:
    """CHUNK parts carrying the bytes of ``tensors`` (arrays or buffers) in order, then END, each part
    as one bytes object (``chunk_parts`` gives the same parts without joining them)."""
    for part in chunk_parts(tensors, chunk_len):
        yield part[0] if len(part) == 1 else b"".join(part)


def chunk_parts(tensors: Iterable[Any], chunk_len: int = KV_CHUNK_LEN) -> Iterator[tuple[Any, ...]]:
    """The CHUNK parts of ``tensors``, then END, each part a tuple of buffers whose concatenation is
    the part: its 5-byte head, then views of the tensors' own memory (no copy, no dtype change; a
    strided array, such as a cache buffer cut to its positions, travels as its contiguous runs)."""
    if not 0 < chunk_len <= MAX_KV_CHUNK_LEN:
        raise ValueError(f"chunk_len must be 1..{MAX_KV_CHUNK_LEN}")
    index = total = 0
    pending: list[memoryview] = []
    size = 0
    for tensor in tensors:
        for view in contiguous_runs(tensor):
            while len(view):
                take = min(len(view), chunk_len - size)
                pending.append(view[:take])
                view, size = view[take:], size + take
                if size == chunk_len:
                    yield (_CHUNK.pack(Part.CHUNK, index), *pending)
                    index, total, pending, size = index + 1, total + size, [], 0
    if size:
        yield (_CHUNK.pack(Part.CHUNK, index), *pending)
        index, total = index + 1, total + size
    yield (_END.pack(Part.END, index, total),)


def contiguous_runs(tensor: Any) -> Iterator[memoryview]:
    """Byte views of ``tensor``'s elements in C order, each over memory it already holds: one view of a
    C-contiguous array, else one per contiguous sub-array along the leading axes (a [1, H, N, D] slice of
    a [1, H, capacity, D] buffer: one per head). Only an array whose last axis is strided is copied."""
    if isinstance(tensor, (bytes, bytearray, memoryview)):
        yield memoryview(tensor).cast("B")
        return
    a = np.asarray(tensor)
    if a.flags.c_contiguous or a.size == 0:
        if a.size:
            yield memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        return
    if a.ndim <= 1:
        yield memoryview(np.ascontiguousarray(a).view(np.uint8))
        return
    for sub in a:
        yield from contiguous_runs(sub)
