"""Rows in and out of mlx-lm's ``BatchKVCache`` without waiting for the device.

mlx-lm's ``BatchKVCache.filter`` and ``.extract`` read the cache's left padding back from the device
(``tolist``). On a GPU that read waits for everything queued on the stream before it, so with
asynchronous scheduling every row that left a micro-batch drained the device once per layer: the
H200 profile of the server at 32 streams put about 11% of the scheduler thread in
``cudaEventSynchronize`` under these two calls, the GPU idle meanwhile (docs/benchmarks.md).

The runner knows every row's padding on the host: a merged row is padded to the longest row
(``merged_pads``), an extension pads both sides to the larger write index (``extended_pads``).
``filter_rows`` and ``extract_row`` do what mlx-lm's methods do, from those host values, lazily.
A layer whose cache is anything else (rotating windows, linear attention) has no host padding
(``None``) and goes through mlx-lm's own methods.

**Joins in shapes that repeat** (``append_rows``). MLX builds kernels per shape for the copies of a
merge and an extension, and a joining row's length is new almost every time: on the H200 the step
after a row of a new length joined 32 rows queued in 78-138 ms, against 13-15 ms steady and 28-30
ms when the lengths repeated (docs/benchmarks.md). So a plain row joins by a gather instead: its own
buffer (whose width mlx-lm's ``KVCache`` grows in blocks of 256) plus one zero column, indexed by
the batch's width of column numbers (its tokens right-aligned at the batch's write index, zeros
before them), then stacked under the batch. The varying length lives in the index values, not in
any shape. A first row becomes a batch of one over its own buffers, with no copy. Rows leave the
left padding in place and it is cut only in whole blocks of 256 columns, so widths stay few too.

That join is OFF by default (``MLXCEL_STABLE_JOIN=1`` turns it on): it was built after the H200 time of
its session ran out, so it has no GPU measurement yet, and on the CPU it measured 0.96x at 4 streams
(the gather writes the batch's whole width, and up to 255 padding columns stay in attention).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxcel.config import env_switch

Pads = list[int] | None  # each row's left padding in one layer's batched cache, or None: not tracked
TRIM_BLOCK = 256  # with the stable join, shared left padding is cut in whole blocks of this many columns
STABLE_JOIN_ENV = "MLXCEL_STABLE_JOIN"


def stable_join_enabled() -> bool:
    """``MLXCEL_STABLE_JOIN`` (1/0; default off: not yet measured on a GPU, 0.96x on the CPU)."""
    return env_switch(STABLE_JOIN_ENV) is True


def merged_pads(caches: Sequence[Any]) -> Pads:
    """The left padding ``BatchKVCache.merge`` gives these one-row caches (None unless all are plain ``KVCache``)."""
    if not caches or not all(type(c) is KVCache for c in caches):
        return None
    lengths = [c.size() for c in caches]
    longest = max(lengths)
    return [longest - n for n in lengths]


def extended_pads(cache: Any, pads: Pads, other: Any, other_pads: Pads) -> Pads:
    """The left padding after ``cache.extend(other)``; call it before the extension."""
    if pads is None or other_pads is None or type(cache) is not BatchKVCache or type(other) is not BatchKVCache:
        return None
    if cache.keys is None and other.keys is None:
        return pads + other_pads
    top = max(cache._idx, other._idx)  # noqa: SLF001 - the write index, a host int in mlx-lm's cache
    return [p + top - cache._idx for p in pads] + [p + top - other._idx for p in other_pads]  # noqa: SLF001


def filter_rows(cache: Any, indices: list[int], pads: Pads, block: int = 1) -> Pads:
    """Keep rows ``indices`` of ``cache`` in place, as ``cache.filter`` does (which cuts all the left padding
    the rows share; ``block``: only whole blocks of that many columns); returns their padding after it."""
    if pads is None or type(cache) is not BatchKVCache:
        cache.filter(indices)
        return None
    rows = mx.array(indices, dtype=mx.int32)
    if cache.keys is not None:
        cache.keys = cache.keys[rows]
        cache.values = cache.values[rows]
    cache.offset = cache.offset[rows]
    cache.left_padding = cache.left_padding[rows]
    kept = [pads[i] for i in indices]
    shift = min(kept) // block * block
    if shift > 0:  # drop the columns every remaining row pads
        if cache.keys is not None:
            cache.keys = cache.keys[..., shift:, :]
            cache.values = cache.values[..., shift:, :]
        cache._idx -= shift  # noqa: SLF001
        cache.left_padding = cache.left_padding - shift
        kept = [p - shift for p in kept]
    return kept


def extract_row(cache: Any, i: int, pads: Pads) -> Any:
    """Row ``i`` of ``cache`` as a standalone one-row cache, as ``cache.extract(i)`` gives it."""
    if pads is None or type(cache) is not BatchKVCache:
        return cache.extract(i)
    row = KVCache()
    start, end = pads[i], cache._idx  # noqa: SLF001
    row.keys = mx.contiguous(cache.keys[i : i + 1, :, start:end])
    row.values = mx.contiguous(cache.values[i : i + 1, :, start:end])
    row.offset = end - start
    return row


def join_layer(current: Any | None, pads: Pads, rows: Sequence[Any], *, batched: bool,
               stable: bool = False) -> tuple[Any, Pads]:
    """One layer of a slot with ``rows`` (one-row caches) joined: ``current`` is the slot's cache of that layer
    (None when empty; one row's own cache unless ``batched``). Returns the layer's batched cache and padding.

    With ``stable``, plain ``KVCache`` layers join in shapes that repeat (``append_rows``); otherwise, and for
    any other kind, the joining rows go through mlx-lm's ``merge`` and one ``extend``."""
    plain = stable and all(type(r) is KVCache for r in rows) and (
        current is None or type(current) in (KVCache, BatchKVCache))
    if current is not None and not batched:  # one row's own cache: it heads the batch
        if plain:
            return append_rows(None, None, [current, *rows])
        current, pads = current.merge([current]), merged_pads([current])
    if plain:
        return append_rows(current, pads, rows)
    return _merge_into(current, pads, rows)


def _merge_into(current: Any | None, pads: Pads, rows: Sequence[Any]) -> tuple[Any, Pads]:
    """mlx-lm's way: one ``merge`` of ``rows``, then ``current.extend`` with it (None: the merge alone)."""
    merged, merged_padding = rows[0].merge(list(rows)), merged_pads(rows)
    if current is None:
        return merged, merged_padding
    pads = extended_pads(current, pads, merged, merged_padding)
    current.extend(merged)
    return current, pads


def append_rows(batch: Any | None, pads: Pads, rows: Sequence[Any]) -> tuple[Any, Pads]:
    """One layer's batched cache (None: an empty slot) with one-row caches ``rows`` appended, and its padding.

    Plain ``KVCache`` rows join by ``join_row``; anything else goes through mlx-lm's ``merge`` and
    ``extend`` (as does a row longer than the batch's write index)."""
    for row in rows:
        if batch is None:
            batch, pads = _one_row_batch(row)
            continue
        joined = join_row(batch, pads, row)
        if joined is not None:
            pads = joined
            continue
        batch, pads = _merge_into(batch, pads, [row])
    return batch, pads


def join_row(batch: Any, pads: Pads, row: Any) -> Pads:
    """Stack plain ``row`` under ``batch`` in place, its tokens ending at the batch's write index (moved right
    first when the row is longer), by gathers whose shapes are the buffers' widths; returns the padding, or
    None (nothing done) where that does not apply."""
    if pads is None or type(batch) is not BatchKVCache or type(row) is not KVCache:
        return None
    length = row.offset
    if batch.keys is None or row.keys is None or length <= 0:
        return None
    if length > batch._idx:  # noqa: SLF001
        pads = _move_right(batch, pads, length)
    end = batch._idx  # noqa: SLF001
    start = end - length
    index = _columns(batch.keys.shape[2], start, end, row.keys.shape[2])
    batch.keys = mx.concatenate([batch.keys, _gather(row.keys, index)])
    batch.values = mx.concatenate([batch.values, _gather(row.values, index)])
    batch.offset = mx.concatenate([batch.offset, mx.array([length], dtype=batch.offset.dtype)])
    batch.left_padding = mx.concatenate([batch.left_padding, mx.array([start], dtype=batch.left_padding.dtype)])
    return pads + [start]


def _move_right(batch: Any, pads: list[int], end: int) -> list[int]:
    """Make ``end`` the batch's write index: every row's tokens move right by the difference (more left padding),
    into a width of whole blocks."""
    old = batch._idx  # noqa: SLF001
    shift = end - old
    width = max(batch.keys.shape[2], -(-end // TRIM_BLOCK) * TRIM_BLOCK)
    index = _columns(width, shift, end, batch.keys.shape[2])
    batch.keys, batch.values = _gather(batch.keys, index), _gather(batch.values, index)
    batch.left_padding = batch.left_padding + shift
    batch._idx = end  # noqa: SLF001
    return [p + shift for p in pads]


@lru_cache(maxsize=256)
def _columns(width: int, start: int, end: int, zero: int) -> mx.array:
    """For each of ``width`` target columns, the source column: ``c - start`` inside [start, end), else
    ``zero`` (the index of the zero column ``_gather`` appends)."""
    return mx.array([c - start if start <= c < end else zero for c in range(width)], dtype=mx.int32)


def _gather(buf: mx.array, index: mx.array) -> mx.array:
    """Columns ``index`` of ``buf`` [B, H, W, D] with one zero column appended at index W."""
    zero = mx.zeros((*buf.shape[:2], 1, buf.shape[3]), dtype=buf.dtype)
    return mx.take(mx.concatenate([buf, zero], axis=2), index, axis=2)


def _one_row_batch(row: Any) -> tuple[Any, Pads]:
    """A batch of one: over a plain row's own buffers (no copy), else mlx-lm's ``merge``."""
    if type(row) is not KVCache or row.keys is None:
        return _merge_into(None, None, [row])
    batch = BatchKVCache([0])
    batch.keys, batch.values = row.keys, row.values
    batch.offset = batch.offset + row.offset
    batch._idx = row.offset  # noqa: SLF001
    return batch, [0]
