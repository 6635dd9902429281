"""The KV handoff wire format, sans-I/O: a header, raw tensor chunks, an end record (docs/disagg.md §4).

A prefill node hands a sequence to a decode node as one transport stream whose STREAM_DATA bodies
are *parts*:

* ``HEADER``: magic, version, the request document (JSON, at most ``MAX_KV_META_LEN`` bytes), the
  prompt's token ids (u32 little-endian) and one 24-byte record per layer (cache kind, dtype,
  KV heads, key and value widths, positions held, tokens seen, kind parameters); an ARRAYS layer
  (linear-attention or SSM state) is followed by one ARRAY record per array (dtype and shape), a
  LIST layer (several caches) by the records of its caches;
* ``CHUNK``: a consecutive index and raw tensor bytes (at most ``MAX_KV_CHUNK_LEN``); the bytes of
  every tensor, layer by layer, concatenated, cut anywhere;
* ``END``: the number of chunks and of tensor bytes.

A large handoff may instead carry ``SPLIT`` after its header and its bytes on part streams (``kv_split``). The receiver (``HandoffDecoder``) knows the model's ``KVLayout`` and its context length and refuses,
before it keeps a single tensor byte, a header whose layer count, kinds, dtypes, shapes or lengths
differ from them; tensor buffers grow only as their bytes arrive. No MLX here (``kv_cache`` converts).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from mlxcel.disagg.wire import DTYPE_NAMES, DTYPE_SIZES, KV_MAGIC, KV_VERSION, MAX_KV_ARRAYS, MAX_KV_CHUNK_LEN
from mlxcel.disagg.wire import MAX_KV_LIST, MAX_KV_META_LEN, MAX_KV_NDIM, MAX_KV_SPLIT, CacheKind, DType, Part
from mlxcel.disagg.kv_send import chunk_parts, contiguous_runs, encode_chunks  # noqa: F401 - the sender's side
from mlxcel.disagg.kv_ids import id_window_mismatch
from mlxcel.disagg.kv_split import SPLIT, SplitAssembly
from mlxcel.error_codes import CodedError, ErrorCode
from mlxcel.models.token_ids import TokenIdError, check_token_ids

#: part byte, magic, version, meta length
_HEAD = struct.Struct(">B4sBI")
_COUNT = struct.Struct(">I")
_LAYERS = struct.Struct(">H")
#: kind, dtype, heads, k_dim, v_dim, positions, offset, a, b
LAYER_RECORD = struct.Struct(">BBHHHIIII")
#: an ARRAYS layer's array: kind (ARRAY), dtype, ndim, 0, five dimensions (unused ones 0)
ARRAY_RECORD = struct.Struct(">BBBB5I")
RECORD_LEN = LAYER_RECORD.size  # == ARRAY_RECORD.size: every record is 24 bytes
_CHUNK = struct.Struct(">BI")
_END = struct.Struct(">BIQ")
#: the numpy dtype of each wire dtype (bfloat16 travels as its uint16 bits)
NUMPY_DTYPES = {DType.FLOAT32: np.float32, DType.FLOAT16: np.float16, DType.BFLOAT16: np.uint16,
                DType.UINT32: np.uint32, DType.INT64: np.int64}
_BY_NAME = {name: code for code, name in DTYPE_NAMES.items()}


class HandoffError(CodedError):
    """A handoff part breaks the format or the bounds; ``code`` is BAD_TENSOR or BAD_REQUEST."""

    code = ErrorCode.BAD_TENSOR


@dataclass(frozen=True)
class TensorSpec:
    """One tensor on the wire: its element type and shape ([1, heads, positions, width])."""

    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's cache holds for this model: kind, dtype, heads and widths, kind parameters.

    An ARRAYS layer (``ArraysCache``) holds ``arrays`` of fixed shapes whatever the prompt's length, or with
    ``max_size`` W > 0 the last min(P, W) token ids along their last axis; a LIST layer (``CacheList``) holds
    ``parts``, one spec per cache (none of them a LIST).
    """

    kind: CacheKind
    dtype: DType | None = None  # keys and values (a quantized layer: its scales and biases); None: ARRAYS, LIST
    heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    max_size: int = 0  # ROTATING: positions kept; CHUNKED: the chunk size; ARRAYS: token ids kept (0: fixed)
    keep: int = 0  # ROTATING: leading positions never evicted
    group_size: int = 0  # QUANTIZED
    bits: int = 0  # QUANTIZED
    arrays: tuple[TensorSpec, ...] = ()  # ARRAYS, STATE: each array's dtype and shape (STATE: after 1 token)
    parts: tuple["LayerSpec", ...] = ()  # LIST: the caches, in the CacheList's order
    state_class: int = 0  # STATE: the class's code on kv_records_generic's allow-list
    grows: int = -1  # STATE: the axis of every array that holds one position per token (-1: fixed shapes)
    ratio: int = 0  # DSV41: tokens pooled into one compressed row (0: the layer keeps none); max_size: its window

    def __post_init__(self) -> None:
        check_spec(self)

    def positions(self, length: int) -> int:
        """Positions the cache holds after ``length`` tokens (0: ARRAYS and LIST hold no positions of their own)."""
        if self.kind is CacheKind.STATE:
            return length if self.grows >= 0 else 0
        if self.kind is CacheKind.LIST or self.kind is CacheKind.ARRAYS and not self.max_size:
            return 0
        windowed = (CacheKind.ROTATING, CacheKind.CHUNKED, CacheKind.DSV41, CacheKind.ARRAYS)
        return min(length, self.max_size) if self.kind in windowed else length

    def params(self) -> tuple[int, int]:
        """The record's (a, b): (keep, max_size), (group_size, bits), (arrays, 0), (caches, 0), CHUNKED's
        (0, chunk size), DSV41's (window, ratio) or (0, 0)."""
        if self.kind is CacheKind.CHUNKED:
            return 0, self.max_size
        if self.kind is CacheKind.DSV41:
            return self.max_size, self.ratio
        if self.kind is CacheKind.ROTATING:
            return self.keep, self.max_size
        if self.kind is CacheKind.QUANTIZED:
            return self.group_size, self.bits
        if self.kind is CacheKind.ARRAYS:
            return len(self.arrays), self.max_size
        if self.kind is CacheKind.STATE:
            return len(self.arrays), self.state_class
        if self.kind is CacheKind.LIST:
            return len(self.parts), 0
        return 0, 0

    def tensors(self, length: int) -> list[TensorSpec]:
        """The tensors of this layer after ``length`` tokens, in wire order."""
        if self.kind is CacheKind.ARRAYS:
            n = self.positions(length)
            return [TensorSpec(t.dtype, (*t.shape[:-1], n)) if n else t for t in self.arrays]
        if self.kind is CacheKind.STATE:
            return [TensorSpec(t.dtype, tuple(length if i == self.grows else d for i, d in enumerate(t.shape)))
                    for t in self.arrays]
        if self.kind is CacheKind.LIST:
            return [t for part in self.parts for t in part.tensors(length)]
        if self.kind is CacheKind.DSV41:
            return [TensorSpec(dtype, (1, n, width)) for _, dtype, n, width in dsv41_rows(self, length)]
        n, h = self.positions(length), self.heads
        assert self.dtype is not None
        if self.kind is not CacheKind.QUANTIZED:
            return [TensorSpec(self.dtype, (1, h, n, self.k_dim)), TensorSpec(self.dtype, (1, h, n, self.v_dim))]
        out = []
        for dim in (self.k_dim, self.v_dim):
            out += [TensorSpec(DType.UINT32, (1, h, n, dim * self.bits // 32)),
                    TensorSpec(self.dtype, (1, h, n, dim // self.group_size)),
                    TensorSpec(self.dtype, (1, h, n, dim // self.group_size))]
        return out

    def record(self, length: int) -> bytes:
        """This layer's records: its own 24 bytes, then an ARRAYS layer's ARRAY records or a LIST's parts'."""
        a, b = self.params()
        own = LAYER_RECORD.pack(self.kind, self.dtype or 0, self.heads, self.k_dim, self.v_dim,
                                self.positions(length), length, a, b)
        if self.kind in (CacheKind.ARRAYS, CacheKind.STATE):
            return own + b"".join(array_record(t) for t in self.tensors(length))
        if self.kind is CacheKind.LIST:
            return own + b"".join(part.record(length) for part in self.parts)
        return own


def dsv41_rows(spec: LayerSpec, length: int) -> list[tuple[str, DType, int, int]]:
    """A DSV41 layer's tensors after ``length`` tokens as (LayerCache field, dtype, rows, width), in wire order
    (docs/disagg.md §4.1): the window, the compressed rows, the index keys, the open group's rows and gates
    (float32); one with no rows is not sent."""
    assert spec.dtype is not None
    rows, d = [("window", spec.dtype, spec.positions(length), spec.k_dim)], spec.ratio
    if d:
        rows += [("compress_kv", spec.dtype, length // d, spec.k_dim),
                 ("index_k", spec.dtype, length // d if spec.v_dim else 0, spec.v_dim)]
    if d > 1:
        rows += [(name, DType.FLOAT32, length % d, spec.k_dim) for name in ("pending_kv", "pending_gate")]
    return [row for row in rows if row[2]]


def array_record(spec: TensorSpec) -> bytes:
    dims = tuple(spec.shape) + (0,) * (MAX_KV_NDIM - len(spec.shape))
    return ARRAY_RECORD.pack(CacheKind.ARRAY, spec.dtype, len(spec.shape), 0, *dims)


_U16, _U32 = 0xFFFF, 0xFFFFFFFF


def check_spec(spec: LayerSpec) -> None:
    """ValueError unless ``spec`` fits its records' fields and bounds (a model this codec cannot describe)."""
    if spec.kind is CacheKind.STATE and (not 0 < spec.state_class <= _U32
                                         or any(spec.grows >= len(t.shape) for t in spec.arrays)):
        raise ValueError(f"a STATE layer of class code {spec.state_class} growing along axis {spec.grows} "
                         "cannot travel (a class code 1..2^32-1; an axis every array has)")
    if spec.kind in (CacheKind.ARRAYS, CacheKind.LIST, CacheKind.STATE):
        items = spec.parts if spec.kind is CacheKind.LIST else spec.arrays
        most = MAX_KV_LIST if spec.kind is CacheKind.LIST else MAX_KV_ARRAYS
        if not 1 <= len(items) <= most:
            raise ValueError(f"a {spec.kind.name} layer holds {len(items)} items (1..{most} can travel)")
        if spec.max_size > _U32:
            raise ValueError(f"an ARRAYS layer keeping a window of {spec.max_size} ids cannot travel (1..2^32-1)")
        for t in spec.arrays:
            if not 1 <= len(t.shape) <= MAX_KV_NDIM or not all(0 < d <= _U32 for d in t.shape):
                raise ValueError(f"an array of {len(t.shape)} dimensions {list(t.shape)} cannot travel "
                                 f"(1..{MAX_KV_NDIM} dimensions, each 1..2^32-1)")
        if any(p.kind in (CacheKind.LIST, CacheKind.ARRAY, CacheKind.STATE) for p in spec.parts):
            raise ValueError("a CacheList inside a CacheList (or holding a STATE cache) cannot travel")
        return
    if spec.kind is CacheKind.ARRAY or spec.dtype is None:
        raise ValueError(f"a {spec.kind.name} layer needs a dtype")
    if spec.dtype is DType.INT64:
        raise ValueError(f"a {spec.kind.name} layer of int64 keys cannot travel (int64 is an ARRAY's dtype only)")
    if spec.kind is CacheKind.DSV41 and (spec.heads != 1 or not spec.k_dim or not 0 < spec.max_size <= _U32
                                         or not 0 <= spec.ratio <= _U32 or (spec.v_dim and not spec.ratio)):
        raise ValueError(f"a DSV41 layer of {spec.heads} heads, width {spec.k_dim}, window {spec.max_size}, ratio "
                         f"{spec.ratio}, index width {spec.v_dim} cannot travel (one head, a window, index keys "
                         "only beside compressed rows)")
    if max(spec.heads, spec.k_dim, spec.v_dim) > _U16 or max(spec.max_size, spec.keep, spec.group_size,
                                                             spec.bits) > _U32:
        raise ValueError(f"a {spec.kind.name.lower()} layer of {spec.heads} heads, widths {spec.k_dim}/{spec.v_dim} "
                         "does not fit its record (heads and widths at most 65535)")


@dataclass(frozen=True)
class KVLayout:
    """The KV layout of one model, layer by layer; ``unsupported`` says why it cannot be handed off."""

    layers: tuple[LayerSpec, ...] = ()
    unsupported: str | None = None

    def tensors(self, length: int) -> list[TensorSpec]:
        return [t for layer in self.layers for t in layer.tensors(length)]

    def nbytes(self, length: int) -> int:
        """Tensor bytes of a handoff of a ``length``-token prompt."""
        return sum(t.nbytes for t in self.tensors(length))


def dtype_code(name: str) -> DType:
    """The wire code of a dtype name (``float32``, ``bfloat16``, ...); ValueError for others."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"dtype {name} cannot travel in a KV handoff (supported: {', '.join(_BY_NAME)})") from None


# -- encoding ------------------------------------------------------------------------------------


def encode_header(meta: dict[str, Any], prompt: Sequence[int], layout: KVLayout) -> bytes:
    """The HEADER part of a handoff of ``prompt`` with the request document ``meta``."""
    doc = json.dumps(meta, separators=(",", ":")).encode()
    if len(doc) > MAX_KV_META_LEN:
        raise HandoffError(f"the request document is {len(doc)} bytes, more than {MAX_KV_META_LEN}", ErrorCode.BAD_REQUEST)
    ids = np.asarray(prompt, dtype="<u4").tobytes()
    records = b"".join(layer.record(len(prompt)) for layer in layout.layers)
    return b"".join((_HEAD.pack(Part.HEADER, KV_MAGIC, KV_VERSION, len(doc)), doc, _COUNT.pack(len(prompt)), ids,
                     _LAYERS.pack(len(layout.layers)), records))


# -- decoding ------------------------------------------------------------------------------------


#: makes the buffer of one tensor: a writable C-contiguous array of its shape and wire dtype (bfloat16 as
#: uint16), and the object that owns that memory for the importer (an MLX array), or None
Allocator = Callable[["TensorSpec"], tuple[np.ndarray, Any]]


def numpy_allocator(spec: TensorSpec) -> tuple[np.ndarray, Any]:
    """A plain numpy buffer (uninitialised: every byte is written before the tensor closes)."""
    return np.empty(spec.shape, dtype=NUMPY_DTYPES[spec.dtype]), None


@dataclass
class Handoff:
    """A decoded handoff: the request document, the prompt, and every layer's tensors (wire order);
    ``owners[i]`` is what the allocator said owns tensor i's memory (None: the array itself)."""

    meta: dict[str, Any]
    prompt: tuple[int, ...]
    layout: KVLayout
    tensors: list[np.ndarray] = field(default_factory=list)  # bfloat16 as uint16
    owners: list[Any] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def layer_tensors(self) -> Iterator[tuple[LayerSpec, list[np.ndarray]]]:
        i = 0
        for layer in self.layout.layers:
            k = len(layer.tensors(len(self.prompt)))
            yield layer, self.tensors[i:i + k]
            i += k


class HandoffDecoder:
    """Receives the parts of one handoff stream: HEADER, CHUNK..., END; then ``result()``.

    ``feed`` raises ``HandoffError`` on the first part that breaks the format or the bounds; the
    decoder is then dead (every later call raises too) and holds no tensor bytes.

    Chunk bytes are copied once, into the buffer of the tensor they belong to, made by ``allocate``
    (default: numpy) when the tensor's first bytes arrive, at the size the validated layout gives, if
    that size is at most the stream's tensor bytes received so far (those of this chunk included) plus
    ``MAX_KV_CHUNK_LEN``; until then the tensor's bytes are kept as the received parts' views and copied
    in when its buffer is made (or joined when it closes first). So what a decoder holds never exceeds
    twice what arrived plus 4 MiB, whatever a header claims (docs/disagg.md §4.3).
    """

    def __init__(self, layout: KVLayout, context_length: int, vocab_size: int | None = None,
                 allocate: Allocator | None = None):
        if layout.unsupported:
            raise ValueError(layout.unsupported)
        self.layout = layout
        self.context_length = context_length
        self.vocab_size = vocab_size  # the prompt's ids must be below it (None: the u32 range only)
        self.state = "header"  # -> "chunks" -> "done" | "error"
        self.meta: dict[str, Any] = {}
        self.prompt: tuple[int, ...] = ()
        self.received = 0
        self.expected = 0
        self._specs: list[TensorSpec] = []
        self._done: list[np.ndarray] = []
        self._owners: list[Any] = []
        self._allocate = allocate or numpy_allocator
        self._pieces: list[memoryview] = []  # the open tensor's bytes so far, before it has a buffer
        self._arr: np.ndarray | None = None  # the open tensor's buffer, once made
        self._owner: Any = None
        self._have = 0
        self._chunks = 0
        self._allocated = 0  # bytes of tensor buffers made so far (closed and open)
        self.split: SplitAssembly | None = None  # a split handoff's tensors (docs/disagg.md §4.9)

    def feed(self, part: Any) -> None:
        """One STREAM_DATA body of the handoff stream."""
        view = memoryview(part).cast("B")
        try:
            if self.state == "error":
                raise HandoffError("the handoff was already refused")
            if not len(view):
                raise HandoffError("an empty handoff part", ErrorCode.BAD_REQUEST)
            kind = view[0]
            if kind == Part.HEADER and self.state == "header":
                self._header(view)
            elif kind == Part.CHUNK and self.state == "chunks":
                self._chunk(view)
            elif kind == Part.END and self.state == "chunks":
                self._end(view)
            elif kind == Part.SPLIT and self.state == "chunks" and self._chunks == 0:
                self._split(view)
            else:
                raise HandoffError(f"handoff part 0x{kind:02x} is not expected in state {self.state}", ErrorCode.BAD_REQUEST)
        except HandoffError:
            self._fail()
            raise

    def start_part(self, index: int, count: int) -> None:
        """Part stream ``index`` of ``count`` of a split handoff opened (its PART record, ``kv_split.parse_part``)."""
        self._on_part(index, None, count)

    def feed_part(self, index: int, part: Any) -> None:
        """A STREAM_DATA body of part stream ``index``, after its PART record: CHUNK parts, then END."""
        self._on_part(index, memoryview(part).cast("B"))

    def _on_part(self, index: int, view: memoryview | None, count: int = 0) -> None:
        try:
            if self.state == "error":
                raise HandoffError("the handoff was already refused")
            if self.split is None:
                raise HandoffError("a part stream for a handoff that is not split", ErrorCode.BAD_REQUEST)
            kind = None if view is None or not len(view) else view[0]
            if view is None:
                self.split.start(index, count)
            elif kind == Part.CHUNK:
                self.split.chunk(index, view)
                self.received = self.split.received
            elif kind == Part.END:
                self.state = "done" if self.split.end(index, view) else self.state
            else:
                raise HandoffError(f"part {index}: a part stream carries CHUNK and END parts, not "
                                   f"{'nothing' if kind is None else f'0x{kind:02x}'}", ErrorCode.BAD_REQUEST)
        except HandoffError:
            self._fail()
            raise

    def result(self) -> Handoff:
        """The complete handoff (after END); a stream that ended early raises ``HandoffError``."""
        if self.state != "done":
            got = f"{self.received} of {self.expected} tensor bytes" if self.state == "chunks" else f"state {self.state}"
            self._fail()
            raise HandoffError(f"the handoff stream ended before its END record ({got})")
        tensors, owners = self.split.tensors() if self.split is not None else (self._done, self._owners)
        why = id_window_mismatch(self.layout.layers, self.prompt, tensors)
        if why:
            self._fail()
            raise HandoffError(why)
        return Handoff(self.meta, self.prompt, self.layout, tensors, owners)

    @property
    def held(self) -> int:
        """Tensor bytes this decoder keeps now: closed tensors, the open one's buffer or received views."""
        if self.split is not None:
            return self.split.held
        open_ = self._arr.nbytes if self._arr is not None else self._have
        return sum(t.nbytes for t in self._done) + open_

    def abandon(self) -> None:
        """Drop every tensor byte now (a refused handoff); every later part raises."""
        self._fail()
    @property
    def allocated(self) -> int:
        """Bytes of tensor buffers made so far (closed and open)."""
        return self.split.allocated if self.split is not None else self._allocated

    def _fail(self) -> None:
        self.state = "error"
        if self.split is not None:
            self.split.drop()
        self._done, self._owners, self._pieces, self._have, self._specs = [], [], [], 0, []
        self._arr = self._owner = None

    # -- parts ---------------------------------------------------------------------------------

    def _header(self, view: memoryview) -> None:
        if len(view) < _HEAD.size:
            raise HandoffError("the handoff header is cut short", ErrorCode.BAD_REQUEST)
        _, magic, version, meta_len = _HEAD.unpack_from(view)
        if magic != KV_MAGIC or version != KV_VERSION:
            raise HandoffError(f"not a version-{KV_VERSION} KV handoff (magic {bytes(magic)!r}, version {version})",
                               ErrorCode.BAD_REQUEST)
        if meta_len > MAX_KV_META_LEN:
            raise HandoffError(f"the request document claims {meta_len} bytes, more than {MAX_KV_META_LEN}",
                               ErrorCode.BAD_REQUEST)
        off = _HEAD.size
        self.meta = _json_object(view[off:off + meta_len], meta_len)
        off += meta_len
        count = _read(_COUNT, view, off, "the prompt length")[0]
        if not 1 <= count <= self.context_length:
            raise HandoffError(f"a handoff of {count} prompt tokens is outside 1..{self.context_length} "
                               "(the context length)")
        off += _COUNT.size
        ids = view[off:off + 4 * count]
        if len(ids) != 4 * count:
            raise HandoffError("the handoff header is cut inside the prompt's token ids", ErrorCode.BAD_REQUEST)
        self.prompt = self._ids(np.frombuffer(ids, dtype="<u4"))
        off += 4 * count
        layers = _read(_LAYERS, view, off, "the layer count")[0]
        off += _LAYERS.size
        if layers != len(self.layout.layers):
            raise HandoffError(f"the handoff names {layers} layers; this model has {len(self.layout.layers)}")
        expected = [spec.record(count) for spec in self.layout.layers]  # this model's, never the sender's claim
        size = sum(len(r) for r in expected)
        if len(view) != off + size:
            raise HandoffError(f"the handoff header is {len(view)} bytes; {size // RECORD_LEN} layer records make "
                               f"it {off + size}", ErrorCode.BAD_REQUEST)
        for i, want in enumerate(expected):
            got = bytes(view[off:off + len(want)])
            if got != want:
                raise HandoffError(f"layer {i}: {_describe(got)} does not match this model's {_describe(want)}")
            off += len(want)
        self._specs = list(reversed(self.layout.tensors(count)))
        self.expected = sum(t.nbytes for t in self._specs)
        self.state = "chunks"
        self._advance()

    def _ids(self, ids: np.ndarray) -> tuple[int, ...]:
        """The prompt's ids, each below the vocabulary (BAD_TENSOR: a bound of the binary header)."""
        if self.vocab_size is not None:
            try:
                check_token_ids(ids, self.vocab_size, "prompt", ErrorCode.BAD_TENSOR)
            except TokenIdError as exc:
                raise HandoffError(str(exc), exc.code) from None
        return tuple(int(t) for t in ids)

    def _chunk(self, view: memoryview) -> None:
        if len(view) < _CHUNK.size:
            raise HandoffError("a chunk part is cut short", ErrorCode.BAD_REQUEST)
        index = _CHUNK.unpack_from(view)[1]
        data = view[_CHUNK.size:]
        if index != self._chunks:
            raise HandoffError(f"chunk {index} arrived where chunk {self._chunks} was due", ErrorCode.BAD_REQUEST)
        if not 0 < len(data) <= MAX_KV_CHUNK_LEN:
            raise HandoffError(f"a chunk of {len(data)} bytes is outside 1..{MAX_KV_CHUNK_LEN}")
        if self.received + len(data) > self.expected:
            raise HandoffError(f"the chunks carry more than the header's {self.expected} tensor bytes")
        self._chunks += 1
        while len(data):
            spec = self._specs[-1]
            take = min(len(data), spec.nbytes - self._have)
            self.received += take
            if self._arr is None and spec.nbytes <= self.received + MAX_KV_CHUNK_LEN:
                self._open_buffer(spec)
            if self._arr is not None:  # the one copy of these bytes (numpy: without the GIL)
                _bytes_of(self._arr)[self._have:self._have + take] = np.frombuffer(data[:take], np.uint8)
            else:
                self._pieces.append(data[:take])  # a view: the part's buffer is ours until the tensor has one
            self._have += take
            data = data[take:]
            self._advance()

    def _open_buffer(self, spec: TensorSpec) -> None:
        """Make the open tensor's buffer (the validated spec's size) and move its bytes so far into it."""
        try:
            arr, owner = self._allocate(spec)
        except (MemoryError, ValueError, RuntimeError) as exc:
            raise HandoffError(f"cannot make a {spec.nbytes}-byte tensor buffer: {exc}", ErrorCode.INTERNAL) from None
        if arr.shape != spec.shape or arr.dtype != NUMPY_DTYPES[spec.dtype] or not arr.flags.c_contiguous:
            raise HandoffError(f"the allocator made a {arr.dtype} {list(arr.shape)} buffer for a "
                               f"{spec.dtype.name.lower()} {list(spec.shape)} tensor", ErrorCode.INTERNAL)
        flat, off = _bytes_of(arr), 0
        for piece in self._pieces:
            flat[off:off + len(piece)] = np.frombuffer(piece, np.uint8)
            off += len(piece)
        self._pieces, self._arr, self._owner = [], arr, owner
        self._allocated += arr.nbytes

    def _advance(self) -> None:
        """Close every tensor whose bytes are all here (zero-size tensors at once)."""
        while self._specs and self._have == self._specs[-1].nbytes:
            spec = self._specs.pop()
            if self._arr is not None:
                self._done.append(self._arr)
                self._owners.append(self._owner)
            else:
                raw = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
                self._done.append(np.frombuffer(raw, dtype=NUMPY_DTYPES[spec.dtype]).reshape(spec.shape))
                self._owners.append(None)
            self._pieces, self._have, self._arr, self._owner = [], 0, None, None

    def _split(self, view: memoryview) -> None:
        if len(view) != SPLIT.size:
            raise HandoffError("the SPLIT record has the wrong length", ErrorCode.BAD_REQUEST)
        count = view[1]
        if not 2 <= count <= MAX_KV_SPLIT:
            raise HandoffError(f"a split over {count} part streams is outside 2..{MAX_KV_SPLIT}", ErrorCode.BAD_REQUEST)
        self.split = SplitAssembly(self.layout.tensors(len(self.prompt)), count, self._allocate, NUMPY_DTYPES, HandoffError)
        self.state = "split"

    def _end(self, view: memoryview) -> None:
        if len(view) != _END.size:
            raise HandoffError("the END record has the wrong length", ErrorCode.BAD_REQUEST)
        _, chunks, total = _END.unpack(view)
        if chunks != self._chunks or total != self.received or self.received != self.expected:
            raise HandoffError(f"the handoff ended after {self._chunks} chunks and {self.received} of "
                               f"{self.expected} tensor bytes (END says {chunks} and {total})")
        self.state = "done"


def _read(st: struct.Struct, view: memoryview, off: int, what: str) -> tuple:
    if len(view) < off + st.size:
        raise HandoffError(f"the handoff header is cut before {what}", ErrorCode.BAD_REQUEST)
    return st.unpack_from(view, off)


def _json_object(raw: memoryview, claimed: int) -> dict[str, Any]:
    if len(raw) != claimed:
        raise HandoffError("the handoff header is cut inside the request document", ErrorCode.BAD_REQUEST)
    try:
        doc = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise HandoffError("the request document is not JSON", ErrorCode.BAD_REQUEST) from None
    if not isinstance(doc, dict):
        raise HandoffError("the request document is not a JSON object", ErrorCode.BAD_REQUEST)
    return doc


def _describe(records: bytes) -> str:
    """A layer's records in words ("rotating float32 [2 heads, k 16, v 16] 4 positions of 7 tokens (0, 4)")."""
    return "; ".join(_describe_one(records[i:i + RECORD_LEN]) for i in range(0, len(records), RECORD_LEN))


def _describe_one(record: bytes) -> str:
    if record[0] == CacheKind.ARRAY:
        _, dtype, ndim, _, *dims = ARRAY_RECORD.unpack(record)
        return f"array {_dtype_name(dtype)} of {ndim} dimensions {list(dims)}"
    kind, dtype, heads, k_dim, v_dim, positions, offset, a, b = LAYER_RECORD.unpack(record)
    kind_name = CacheKind(kind).name.lower() if kind in CacheKind._value2member_map_ else f"kind {kind}"
    if kind in (CacheKind.ARRAYS, CacheKind.LIST):
        return f"{kind_name} of {a} after {offset} tokens"
    if kind == CacheKind.STATE:
        return f"state of class {b} with {a} arrays after {offset} tokens"
    if kind == CacheKind.DSV41:
        return (f"dsv41 {_dtype_name(dtype)} [{heads} heads, k {k_dim}, index {v_dim}] {positions} window rows of "
                f"{offset} tokens (window {a}, ratio {b})")
    return (f"{kind_name} {_dtype_name(dtype)} [{heads} heads, k {k_dim}, v {v_dim}] {positions} positions of "
            f"{offset} tokens ({a}, {b})")


def _dtype_name(code: int) -> str:
    return DTYPE_NAMES.get(code, f"dtype {code}")  # type: ignore[call-overload]


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous array's memory as flat bytes (a view)."""
    return arr.reshape(-1).view(np.uint8)
