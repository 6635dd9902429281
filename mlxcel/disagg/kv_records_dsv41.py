"""Record kind DSV41 (9): deepseek_v41's ``LayerCache`` in a handoff (docs/disagg.md §4.1).

A ``LayerCache`` keeps a sliding window of KV rows, and in a layer that compresses (a kv source of compress
ratio r > 0) the closed groups' compressed rows, their index keys (an index source too) and the open group's
rows and gates (r > 1). Its ``state`` is read-only and its window size is not in it, so mlx-lm's state contract
cannot rebuild it; this adapter does: the decode node makes ``LayerCache(window)`` with its own window and sets
the public fields from the received arrays, whose shapes ``kv_codec`` computes from the prompt's length P and the
layer's ratio in this model's own layout (nothing's shape comes from the wire). After P tokens the cache holds
min(P, window) window rows, P // r compressed rows and index keys and P % r open rows; an array with no rows is
not sent and rebuilt as None (what the model itself keeps, or an equivalent empty array).
"""

from __future__ import annotations

from typing import Any

from mlxcel.disagg.kv_codec import HandoffError, LayerSpec, dsv41_rows, dtype_code
from mlxcel.disagg.wire import CacheKind


def _layer_cache_class() -> type | None:
    try:
        from mlx_lm.models.deepseek_v41 import LayerCache
    except ImportError:  # an mlx-lm without deepseek_v41: no cache is one
        return None
    return LayerCache


def is_layer_cache(cache: Any) -> bool:
    """Whether ``cache`` is deepseek_v41's ``LayerCache`` (the class itself, not one of the same name)."""
    cls = _layer_cache_class()
    return cls is not None and type(cache) is cls


def _name(a: Any) -> str:
    return str(a.dtype).rpartition(".")[2]


def spec_of(model: Any, index: int, cache: Any) -> LayerSpec:
    """The DSV41 spec of layer ``index``'s ``cache`` after one token, with the ratio from the model's layer
    (its attention's compressor and indexer); ValueError when the layer or the cache is not as expected."""
    try:
        attn = model.layers[index].self_attn
    except (AttributeError, IndexError, TypeError):
        raise ValueError(f"layer {index} keeps a LayerCache but the model has no layers[{index}].self_attn") from None
    compresses = bool(getattr(attn, "ratio", 0)) and bool(getattr(attn, "is_kv_source", False))
    ratio = int(attn.compressor.ratio) if compresses else 0
    index_width = int(attn.indexer.head_dim) if compresses and getattr(attn, "is_index_source", False) else 0
    window = cache.window
    if window is None or window.ndim != 3 or window.shape[:2] != (1, 1) or cache.offset != 1:
        raise ValueError(f"layer {index}'s LayerCache does not hold one window row after a token")
    if ratio > 1 and (cache.pending_kv is None or _name(cache.pending_kv) != "float32"):
        raise ValueError(f"layer {index}'s LayerCache keeps its open group's rows in other than float32")
    return LayerSpec(CacheKind.DSV41, dtype_code(_name(window)), 1, window.shape[-1], index_width,
                     max_size=int(cache.window_size), ratio=ratio)


def _fields(spec: LayerSpec, length: int) -> list[str]:
    """The LayerCache fields of the tensors sent after ``length`` tokens, in wire order."""
    return [name for name, *_ in dsv41_rows(spec, length)]


def export_arrays(cache: Any, spec: LayerSpec, length: int) -> list:
    """One DSV41 layer's tensors in wire order (their shapes and dtypes are checked by the caller)."""
    if not is_layer_cache(cache):
        raise HandoffError(f"a layer cache is a {type(cache).__name__}; the model's layout says dsv41")
    if cache.offset != length:
        raise HandoffError(f"a layer cache holds {cache.offset} tokens, the prompt has {length}")
    if cache.window_size != spec.max_size:
        raise HandoffError(f"a LayerCache keeps a {cache.window_size}-row window; the layout says {spec.max_size}")
    arrays = []
    for name in _fields(spec, length):
        a = getattr(cache, name)
        if a is None:
            raise HandoffError(f"a LayerCache after {length} tokens has no {name}; the model's layout says it has")
        arrays.append(a)
    return arrays


def rebuild(spec: LayerSpec, arrays: list, length: int) -> Any:
    """A ``LayerCache`` of this model's window holding the decoded arrays after ``length`` tokens."""
    cache = _layer_cache_class()(spec.max_size)
    names = _fields(spec, length)
    if len(arrays) != len(names):
        raise HandoffError(f"a DSV41 layer of {length} tokens takes {len(names)} tensors, not {len(arrays)}")
    for name, a in zip(names, arrays):
        setattr(cache, name, a)
    cache.offset = length
    return cache

