"""mlx-lm KV caches <-> the handoff's raw tensors (``kv_codec``), and a model's ``KVLayout``.

``probe_layout(model)`` learns, once per process, what every layer's cache holds by running one
token through a fresh ``make_prompt_cache``: the cache class, dtype, KV heads and widths. Three
classes can be handed off: ``KVCache`` (every position), ``RotatingKVCache`` (sliding-window layers:
the last ``max_size`` positions in temporal order, which is exactly what the next decode step keeps)
and ``QuantizedKVCache`` (packed keys and values with their scales and biases). Any other class
(recurrent ``ArraysCache``, ``ChunkedKVCache``, ``CacheList``, ...) makes the layout ``unsupported``,
and a prefill node refuses such a model's requests before any prefill work.

Run these on the thread that runs the model (they evaluate MLX arrays).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from mlxcel.disagg.kv_codec import Handoff, HandoffError, KVLayout, LayerSpec, dtype_code
from mlxcel.disagg.wire import CacheKind, DType

SUPPORTED = (KVCache, RotatingKVCache, QuantizedKVCache)


def probe_layout(model: Any) -> KVLayout:
    """The KV layout of ``model``; ``unsupported`` names the first layer whose cache cannot travel."""
    caches = make_prompt_cache(model)
    for i, c in enumerate(caches):
        if type(c) not in SUPPORTED:
            return KVLayout(unsupported=f"this model's KV cache cannot be handed off to a decode node: layer {i} "
                                        f"keeps a {type(c).__name__} (supported: "
                                        f"{', '.join(t.__name__ for t in SUPPORTED)})")
    model(mx.array([[0]], dtype=mx.uint32), cache=caches)
    try:
        layers = tuple(_layer_spec(c) for c in caches)
    except ValueError as exc:
        return KVLayout(unsupported=f"this model's KV cache cannot be handed off to a decode node: {exc}")
    return KVLayout(layers)


def _layer_spec(c: Any) -> LayerSpec:
    if isinstance(c, QuantizedKVCache):
        (kq, ks, _), (vq, _, _) = c.keys, c.values
        return LayerSpec(CacheKind.QUANTIZED, dtype_code(_name(ks.dtype)), kq.shape[1], kq.shape[-1] * 32 // c.bits,
                         vq.shape[-1] * 32 // c.bits, group_size=c.group_size, bits=c.bits)
    spec = LayerSpec(CacheKind.KV, dtype_code(_name(c.keys.dtype)), c.keys.shape[1], c.keys.shape[-1], c.values.shape[-1])
    if isinstance(c, RotatingKVCache):
        return LayerSpec(CacheKind.ROTATING, spec.dtype, spec.heads, spec.k_dim, spec.v_dim,
                         max_size=c.max_size, keep=c.keep)
    return spec


def _name(dtype: Any) -> str:
    return str(dtype).rpartition(".")[2]


def export_cache(cache: list, layout: KVLayout, length: int) -> list[np.ndarray]:
    """The wire tensors of one sequence's per-layer caches holding ``length`` tokens (C-contiguous numpy)."""
    if len(cache) != len(layout.layers):
        raise HandoffError(f"the cache has {len(cache)} layers; the model has {len(layout.layers)}", )
    arrays: list[mx.array] = []
    for c, spec in zip(cache, layout.layers):
        if getattr(c, "offset", None) != length:
            raise HandoffError(f"a layer cache holds {getattr(c, 'offset', None)} tokens, the prompt has {length}")
        arrays += _layer_arrays(c, spec, length)
    mx.eval(arrays)
    return [_to_numpy(a) for a in arrays]


def _layer_arrays(c: Any, spec: LayerSpec, length: int) -> list[mx.array]:
    if spec.kind is CacheKind.QUANTIZED:
        return [x[..., :length, :] for x in (*c.keys, *c.values)]
    if spec.kind is CacheKind.KV:
        return [c.keys[..., :length, :], c.values[..., :length, :]]
    keys, values, offset, keep, _, write = c.state  # RotatingKVCache.state; ``write``: the next write index
    n = spec.positions(length)
    return [_window(_temporal(x, write, offset, keep), keep, n) for x in (keys, values)]


def _temporal(x: mx.array, write: int, offset: int, keep: int) -> mx.array:
    """A rotating buffer in temporal order: the ``keep`` first positions, the oldest (from ``write`` on),
    then the newest (before ``write``); a buffer not yet wrapped is cut at ``write``."""
    if write == x.shape[2]:
        return x
    if write < offset:
        return mx.concatenate([x[..., :keep, :], x[..., write:, :], x[..., keep:write, :]], axis=2)
    return x[..., :write, :]


def _window(x: mx.array, keep: int, n: int) -> mx.array:
    """The ``keep`` first and the last ``n - keep`` positions of a temporally ordered rotating buffer."""
    if x.shape[2] <= n:
        return x
    return mx.concatenate([x[..., :keep, :], x[..., x.shape[2] - (n - keep):, :]], axis=2)


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a, copy=False))


def import_cache(handoff: Handoff) -> list:
    """mlx-lm caches holding a decoded handoff's KV, ready for ``SliceRunner.prepare(cache=...)``."""
    length = len(handoff.prompt)
    out = []
    for spec, tensors in handoff.layer_tensors():
        arrays = [_from_numpy(t, spec.dtype if t.dtype != np.uint32 else DType.UINT32) for t in tensors]
        out.append(_layer_cache(spec, arrays, length))
    mx.eval([c.state for c in out])  # no lazy op left to tie the arrays to this thread's stream
    return out


def _from_numpy(t: np.ndarray, dtype: DType) -> mx.array:
    a = mx.array(t)
    return a.view(mx.bfloat16) if dtype is DType.BFLOAT16 else a


def _layer_cache(spec: LayerSpec, arrays: list[mx.array], length: int) -> Any:
    """A cache rebuilt through mlx-lm's ``from_state``; a rotating one's next write goes after its last position."""
    if spec.kind is CacheKind.QUANTIZED:
        return QuantizedKVCache.from_state((tuple(arrays[:3]), tuple(arrays[3:]), length, spec.group_size, spec.bits))
    if spec.kind is CacheKind.KV:
        return KVCache.from_state((arrays[0], arrays[1], length))
    return RotatingKVCache.from_state((arrays[0], arrays[1], length, spec.keep, spec.max_size, arrays[0].shape[2]))
