"""Rows in and out of mlx-lm's ``BatchKVCache`` without waiting for the device.

mlx-lm's ``BatchKVCache.filter`` and ``.extract`` read the cache's left padding back from the device
(``tolist``). On a GPU that read waits for everything queued on the stream before it, so with
asynchronous scheduling every row that left a micro-batch drained the device once per layer: the
H200 profile of the server at 32 streams put about 11% of the scheduler thread in
``cudaEventSynchronize`` under these two calls, the GPU idle meanwhile (docs/benchmarks.md).

The runner knows every row's padding on the host: a merged row is padded to the longest row
(``merged_pads``), an extension pads both sides to the larger write index (``extended_pads``).
``filter_rows`` and ``extract_row`` do what mlx-lm's methods do, from those host values, lazily.
A layer whose cache is anything else (rotating windows, linear attention, quantized) has no host padding
(``None``) and goes through its own methods (quantized rows: ``kv_quant.BatchQuantizedKVCache``).

Rows join through mlx-lm's ``merge`` and one ``extend`` (``join_layer``). A shape-stable join by gathers
(``MLXCEL_STABLE_JOIN=1``) was tried and removed (issue 41): 0.96x on the CPU at 4 streams and no clear gain
on the H200 (docs/benchmarks.md keeps the measurements).

A family whose cache class has no ``merge`` (llama4's ``ChunkedKVCache``, deepseek_v41's ``LayerCache``) cannot
join a batch at all: ``one_row`` reads that from the model's own caches at load time, and the executor caps its
decode batch at one row (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, CacheList, KVCache, QuantizedKVCache

from mlxcel.engine.kv_quant import BatchQuantizedKVCache

Pads = list[int] | None  # each row's left padding in one layer's batched cache, or None: not tracked


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


def filter_rows(cache: Any, indices: list[int], pads: Pads) -> Pads:
    """Keep rows ``indices`` of ``cache`` in place, as ``cache.filter`` does (which cuts all the left padding
    the rows share); returns their padding after it."""
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
    shift = min(kept)
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


def join_layer(current: Any | None, pads: Pads, rows: Sequence[Any], *, batched: bool) -> tuple[Any, Pads]:
    """One layer of a slot with ``rows`` (one-row caches) joined: ``current`` is the slot's cache of that layer
    (None when empty; one row's own cache unless ``batched``). Returns the layer's batched cache and padding:
    the joining rows go through mlx-lm's ``merge`` and one ``extend``."""
    if current is not None and not batched:  # one row's own cache: it heads the batch
        current, pads = _merge([current]), merged_pads([current])
    return _merge_into(current, pads, rows)


def _merge(rows: Sequence[Any]) -> Any:
    """One batch of one-row caches: mlx-lm's ``merge``, or ours for quantized rows (mlx-lm has none)."""
    if type(rows[0]) is QuantizedKVCache:
        return BatchQuantizedKVCache.merge(list(rows))
    return rows[0].merge(list(rows))


def _merge_into(current: Any | None, pads: Pads, rows: Sequence[Any]) -> tuple[Any, Pads]:
    """mlx-lm's way: one ``merge`` of ``rows``, then ``current.extend`` with it (None: the merge alone)."""
    merged, merged_padding = _merge(rows), merged_pads(rows)
    if current is None:
        return merged, merged_padding
    pads = extended_pads(current, pads, merged, merged_padding)
    current.extend(merged)
    return current, pads


def unmergeable(caches: Sequence[Any]) -> tuple[int, str] | None:
    """The first layer whose cache cannot join a batch and the class that cannot (one with no ``merge``, also
    inside a ``CacheList``); None when every layer's cache merges."""
    for i, cache in enumerate(caches):
        name = _unmergeable_class(cache)
        if name is not None:
            return i, name
    return None


def _unmergeable_class(cache: Any) -> str | None:
    if type(cache) is QuantizedKVCache:  # ours: kv_quant.BatchQuantizedKVCache
        return None
    if isinstance(cache, CacheList):
        return next((n for n in map(_unmergeable_class, cache.caches) if n is not None), None)
    return None if callable(getattr(type(cache), "merge", None)) else type(cache).__name__


@dataclass(frozen=True)
class OneRow:
    """Why a model decodes one sequence at a time: ``family``'s layer ``layer`` keeps a ``cls`` with no merge."""

    family: str
    layer: int
    cls: str

    @property
    def reason(self) -> str:
        """The start-up log line."""
        return (f"{self.family}'s layer {self.layer} keeps a {self.cls}, which mlx-lm cannot merge into a batch: "
                "one sequence decodes at a time")

    @property
    def batching(self) -> str:
        """/health's ``batching`` and ``mlxcel models info``'s line."""
        return f"one row at a time ({self.cls} has no merge)"


def one_row(model: Any, caches: Sequence[Any]) -> OneRow | None:
    """A ``OneRow`` where ``caches`` (what ``model`` makes for one sequence) cannot join a batch, else None."""
    found = unmergeable(caches)
    if found is None:
        return None
    return OneRow(model_family(model), *found)


def model_family(model: Any) -> str:
    """The model's ``model_type`` (mlx-lm's ``Model`` keeps it, or its ``args`` do); else its module's name."""
    family = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None)
    return str(family or type(model).__module__.rsplit(".", 1)[-1])
