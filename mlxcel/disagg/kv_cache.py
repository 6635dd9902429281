"""mlx-lm caches <-> the handoff's raw tensors (``kv_codec``), and a model's ``KVLayout``.

Everything here goes through mlx-lm's cache state contract: a cache's ``state`` (what
``save_prompt_cache`` writes) is read, and a cache is rebuilt with its class's ``from_state`` (what
``load_prompt_cache`` does); no private field is touched. mlx-lm 0.32 keeps a cache's scalars
(offset, window, quantization) inside ``state``; it has no separate ``meta_state``.

``probe_layout(model)`` learns, once per process, what every layer's cache holds by running one
token through a fresh ``make_prompt_cache``: the cache class, dtype, KV heads and widths. These
classes can be handed off:

- ``KVCache`` (every position; deepseek's MLA keeps its latents in one: one head, latent and rope widths);
- ``RotatingKVCache`` (sliding-window layers: the last ``max_size`` positions in temporal order, which
  is exactly what the next decode step keeps);
- ``QuantizedKVCache`` (packed keys and values with their scales and biases);
- ``ArraysCache`` (linear attention, SSM: qwen3_next's gated delta net, mamba): its arrays as they are,
  whose shapes do not depend on the prompt's length; a recurrent state cannot be cut, so it travels whole;
- ``ChunkedKVCache`` (llama4's chunked-attention layers): the last min(tokens, chunk size) positions, which
  is what the next step's ``maybe_trim_front`` keeps; the rebuilt cache starts there (``start_position``);
- ``CacheList`` (several of the above for one layer, e.g. deepseek_v32's attention and indexer keys);
- any class on ``kv_records_generic.ALLOWED`` (``ConcatenateKVCache``), by the state contract alone
  (record kind STATE);
- deepseek_v41's ``LayerCache`` (record kind DSV41, ``kv_records_dsv41``: its ``state`` has no setter nor
  ``from_state``, so it is rebuilt with the decode node's own window from its public fields).

Any other class (batch caches,
a CacheList inside a CacheList, ...) makes the layout ``unsupported`` (the refusal names the class and why),
and a prefill node refuses such a model's requests before any prefill work.

Run these on the thread that runs the model (they evaluate MLX arrays).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlxcel import envs
from mlxcel.disagg import kv_records_dsv41 as dsv41
from mlxcel.disagg import kv_records_generic as generic
from mlxcel.disagg.kv_codec import NUMPY_DTYPES, Handoff, HandoffError, KVLayout, LayerSpec, TensorSpec, dtype_code
from mlxcel.disagg.host_staging import HostBuffer, Staging
from mlxcel.disagg.wire import CacheKind, DType

#: the cache classes a handoff carries, by the record kind that describes them
CLASSES: dict[CacheKind, type] = {CacheKind.KV: KVCache, CacheKind.ROTATING: RotatingKVCache,
                                  CacheKind.QUANTIZED: QuantizedKVCache, CacheKind.ARRAYS: ArraysCache,
                                  CacheKind.LIST: CacheList, CacheKind.CHUNKED: ChunkedKVCache}
_KINDS = {cls.__name__: kind for kind, cls in CLASSES.items()}
SUPPORTED = tuple(CLASSES.values())
_PREFIX = "this model's KV cache cannot be handed off to a decode node: "


def unsupported_cache(cache: Any, depth: int = 0) -> str | None:
    """Why ``cache`` (one layer's, fresh from ``make_prompt_cache``) cannot travel; None if it can."""
    if type(cache) not in SUPPORTED:
        if dsv41.is_layer_cache(cache):
            return "keeps a LayerCache inside a CacheList" if depth else None
        if generic.allowed(type(cache)) is None:
            return generic.contract_refusal(type(cache))
        return f"keeps a {type(cache).__name__} inside a CacheList" if depth else None
    if isinstance(cache, CacheList):
        if depth:
            return "keeps a CacheList inside a CacheList"
        for part in cache.caches:
            why = unsupported_cache(part, depth + 1)
            if why:
                return why
    return None


def cache_classes_supported(model: Any) -> str | None:
    """Why ``model``'s caches cannot travel (naming the first such layer), from their classes alone; None if
    they can. Needs no weights: ``make_prompt_cache`` only builds empty caches."""
    for i, c in enumerate(make_prompt_cache(model)):
        why = unsupported_cache(c)
        if why:
            names = [t.__name__ for t in SUPPORTED] + [c.name for c in generic.ALLOWED] + ["deepseek_v41's LayerCache"]
            return f"{_PREFIX}layer {i} {why} (supported: {', '.join(names)}; a CacheList of the first six)"
    return None


def probe_layout(model: Any) -> KVLayout:
    """The KV layout of ``model``; ``unsupported`` names the first layer whose cache cannot travel."""
    why = cache_classes_supported(model)
    if why:
        return KVLayout(unsupported=why)
    caches = make_prompt_cache(model)
    # evaluated here: whatever the forward leaves in the model (kimi_k3 keeps arrays of its first call) must
    # not stay lazy on this thread's stream, which the scheduler's thread does not have
    mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=caches), [c.state for c in caches])
    try:
        layers = tuple(dsv41.spec_of(model, i, c) if dsv41.is_layer_cache(c) else _spec_of_cache(c)
                       for i, c in enumerate(caches))
        layers = _with_id_windows(model, layers)
    except ValueError as exc:
        return KVLayout(unsupported=f"{_PREFIX}{exc}")
    return KVLayout(layers)


#: most tokens the probe feeds to find how many ids an ARRAYS layer's int64 arrays keep
MAX_ID_WINDOW = 64


def _with_id_windows(model: Any, layers: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    """``layers`` with each ARRAYS layer of int64 arrays (token ids: longcat_flash_ngram's n-gram context)
    given the window W its arrays' last axis keeps: fed one token at a time, the axis grows by one per
    token up to W, then stays (ValueError: it does not)."""
    ids = [i for i, s in enumerate(layers) if s.kind is CacheKind.ARRAYS and any(t.dtype is DType.INT64 for t in s.arrays)]
    if not ids:
        return layers
    caches, sizes = make_prompt_cache(model), []
    for _ in range(MAX_ID_WINDOW + 1):
        mx.eval(model(mx.array([[0]], dtype=mx.uint32), cache=caches))
        sizes.append([[a.shape[-1] for a in caches[i].state[0]] for i in ids])
        if len(sizes) > 1 and sizes[-1] == sizes[-2]:
            break
    out = list(layers)
    for k, i in enumerate(ids):
        widths = {w for w in sizes[-1][k]}
        if len(sizes) > MAX_ID_WINDOW or len(widths) != 1 or [s[k] for s in sizes] != [
                [min(n + 1, *widths)] * len(widths) for n in range(len(sizes))]:
            raise ValueError(f"layer {i} keeps int64 arrays that do not hold the last W (1..{MAX_ID_WINDOW}) token "
                             "ids along their last axis")
        out[i] = LayerSpec(CacheKind.ARRAYS, arrays=layers[i].arrays, max_size=widths.pop())
    return tuple(out)


def _spec_of_cache(cache: Any) -> LayerSpec:
    entry = generic.allowed(type(cache))
    return generic.spec_of(entry, cache.state) if entry is not None else spec_of(type(cache).__name__, cache.state)


def spec_of(name: str, state: Any) -> LayerSpec:
    """The layer spec of a cache of class ``name`` whose ``state`` is ``state`` (ValueError: cannot travel)."""
    kind = _KINDS.get(name)
    if kind is CacheKind.QUANTIZED:
        (kq, ks, _), (vq, _, _), _, group_size, bits = state
        return LayerSpec(kind, dtype_code(_name(ks.dtype)), kq.shape[1], kq.shape[-1] * 32 // bits,
                         vq.shape[-1] * 32 // bits, group_size=group_size, bits=bits)
    if kind is CacheKind.KV:
        keys, values, _ = state
        return LayerSpec(kind, dtype_code(_name(keys.dtype)), keys.shape[1], keys.shape[-1], values.shape[-1])
    if kind is CacheKind.ROTATING:
        keys, values, _, keep, max_size, _ = state
        return LayerSpec(kind, dtype_code(_name(keys.dtype)), keys.shape[1], keys.shape[-1], values.shape[-1],
                         max_size=max_size, keep=keep)
    if kind is CacheKind.CHUNKED:
        keys, values, _, chunk, _ = state
        return LayerSpec(kind, dtype_code(_name(keys.dtype)), keys.shape[1], keys.shape[-1], values.shape[-1],
                         max_size=chunk)
    if kind is CacheKind.ARRAYS:
        return LayerSpec(kind, arrays=tuple(TensorSpec(dtype_code(_name(a.dtype)), tuple(a.shape))
                                            for a in _arrays(state)))
    if kind is CacheKind.LIST:
        return LayerSpec(kind, parts=tuple(spec_of(sub_name, sub_state) for sub_state, sub_name in state))
    raise ValueError(f"a {name} cannot travel")


def _arrays(state: Any) -> list[mx.array]:
    """An ArraysCache's arrays from its ``state`` (arrays, left_padding, lengths) of one unpadded sequence."""
    arrays, left_padding, lengths = state
    if left_padding is not None or lengths is not None:
        raise ValueError("an ArraysCache of a padded batch cannot travel (one sequence's state can)")
    for i, a in enumerate(arrays):
        if a is None:
            raise ValueError(f"ArraysCache entry {i} is still empty after a token")
        if a.ndim == 0 or a.shape[0] != 1:
            raise ValueError(f"ArraysCache entry {i} has shape {list(a.shape)}, not one sequence's [1, ...]")
    return list(arrays)


def _name(dtype: Any) -> str:
    return str(dtype).rpartition(".")[2]


def export_cache(cache: list, layout: KVLayout, length: int, contiguous: bool = False) -> list[np.ndarray]:
    """The wire tensors of one sequence's per-layer caches holding ``length`` tokens: numpy views of the
    caches' own buffers in the model's dtype (bfloat16 as uint16), strided where a buffer holds more
    positions than ``length``; ``kv_codec.chunk_parts`` sends them without a copy. A view keeps its
    buffer alive, and MLX never writes into a buffer another array still references. ``contiguous``: each
    tensor made contiguous on the device first (what ``Staging.to_host`` copies in one DMA)."""
    if len(cache) != len(layout.layers):
        raise HandoffError(f"the cache has {len(cache)} layers; the model has {len(layout.layers)}", )
    arrays: list[mx.array] = []
    for c, spec in zip(cache, layout.layers):
        if spec.kind is CacheKind.STATE:
            if getattr(generic.allowed(type(c)), "code", None) != spec.state_class:
                raise HandoffError(f"a layer cache is a {type(c).__name__}; the model's layout says state class "
                                   f"{spec.state_class}")
            arrays += generic.export_arrays(type(c).__name__, c.state, spec, length)
            continue
        if spec.kind is CacheKind.DSV41:
            arrays += dsv41.export_arrays(c, spec, length)
            continue
        arrays += _layer_arrays(type(c).__name__, c.state, spec, length)
    wanted = layout.tensors(length)
    if len(arrays) != len(wanted):
        raise HandoffError(f"the caches give {len(arrays)} tensors; the model's layout says {len(wanted)}")
    for a, t in zip(arrays, wanted):
        if tuple(a.shape) != t.shape or dtype_code(_name(a.dtype)) is not t.dtype:
            raise HandoffError(f"a cache tensor is {_name(a.dtype)} {list(a.shape)}; the model's layout says "
                               f"{t.dtype.name.lower()} {list(t.shape)}")
    if contiguous:
        arrays = [mx.contiguous(a) for a in arrays]
    mx.eval(arrays)
    return [_to_numpy(a) for a in arrays]


def _layer_arrays(name: str, state: Any, spec: LayerSpec, length: int) -> list[mx.array]:
    """One layer's tensors in wire order, from its cache's ``state``."""
    if _KINDS.get(name) is not spec.kind:
        raise HandoffError(f"a layer cache is a {name}; the model's layout says {spec.kind.name.lower()}")
    if spec.kind is CacheKind.ARRAYS:
        try:
            return _arrays(state)
        except ValueError as exc:
            raise HandoffError(str(exc)) from None
    if spec.kind is CacheKind.LIST:
        if len(state) != len(spec.parts):
            raise HandoffError(f"a CacheList holds {len(state)} caches; the model's layout says {len(spec.parts)}")
        return [a for (sub_state, sub_name), part in zip(state, spec.parts)
                for a in _layer_arrays(sub_name, sub_state, part, length)]
    keys, values, offset = state[:3]
    if offset != length:
        raise HandoffError(f"a layer cache holds {offset} tokens, the prompt has {length}")
    if spec.kind is CacheKind.QUANTIZED:
        return [x[..., :length, :] for x in (*keys, *values)]
    if spec.kind is CacheKind.KV:
        return [keys[..., :length, :], values[..., :length, :]]
    if spec.kind is CacheKind.CHUNKED:  # positions [start, offset) held; the last ``n`` of them travel
        held, n = offset - state[4], spec.positions(length)
        if held < n:
            raise HandoffError(f"a chunked layer cache holds {held} positions, fewer than the {n} that travel")
        return [x[..., held - n:held, :] for x in (keys, values)]
    _, _, _, keep, _, write = state  # RotatingKVCache.state; ``write``: the next write index
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
    return np.array(a, copy=False)


_WIRE_MX = {DType.FLOAT32: mx.float32, DType.FLOAT16: mx.float16, DType.BFLOAT16: mx.uint16, DType.UINT32: mx.uint32,
            DType.INT64: mx.int64}
_MX_OF_NUMPY = {np.dtype(v): _WIRE_MX[k] for k, v in NUMPY_DTYPES.items()}
_ALIASES: bool | None = None


def mx_allocator(spec: TensorSpec) -> tuple[np.ndarray, mx.array]:
    """A tensor buffer in MLX memory (``HandoffDecoder``'s ``allocate``): an evaluated MLX array of the
    spec's shape and wire dtype and a writable numpy view of it, so the chunk bytes are copied once,
    straight into the array the decode node's cache will hold (``import_cache`` copies nothing)."""
    a = mx.zeros(spec.shape, dtype=_WIRE_MX[spec.dtype])
    mx.eval(a)
    return np.array(a, copy=False), a


def staged_allocator(staging: Staging) -> Any:
    """``HandoffDecoder``'s ``allocate`` over page-locked buffers: each tensor is received into a host buffer
    of the pool (its owner), which ``import_cache`` copies into MLX in one DMA; ``mx_allocator`` for a tensor
    the pool has no room for."""
    def allocate(spec: TensorSpec) -> tuple[np.ndarray, Any]:
        buf = staging.take(spec.nbytes)
        if buf is None:
            return mx_allocator(spec)
        return buf.view(0, NUMPY_DTYPES[spec.dtype], spec.shape), buf

    return allocate


def handoff_allocator(copy: bool | None = None) -> Any:
    """``mx_allocator`` where a numpy view of an MLX array writes into that array (checked once, on this
    device: MLX's CPU, Apple silicon's unified memory and CUDA's managed memory all pass), else None (numpy
    buffers, copied into MLX by ``import_cache``); ``copy`` (None: MLXCEL_HANDOFF_COPY=1) takes the copying
    path anyway."""
    global _ALIASES
    if envs.settings().handoff_copy if copy is None else copy:
        return None
    if _ALIASES is None:
        _ALIASES = _views_alias()
    return mx_allocator if _ALIASES else None


def _views_alias() -> bool:
    try:
        view, owner = mx_allocator(TensorSpec(DType.BFLOAT16, (1, 2, 3, 4)))
        view.reshape(-1)[5] = 0x3F80  # bfloat16 1.0
        return view.flags.writeable and float(owner.view(mx.bfloat16).reshape(-1)[5].item()) == 1.0
    except Exception:  # noqa: BLE001 - any failure: take the copying path
        return False


def import_cache(handoff: Handoff) -> list:
    """mlx-lm caches holding a decoded handoff's KV, ready for ``SliceRunner.prepare(cache=...)``; a tensor
    received into an MLX array (``mx_allocator``) is used as it is, any other is copied into MLX once."""
    length = len(handoff.prompt)
    owners = list(handoff.owners) if len(handoff.owners) == len(handoff.tensors) else [None] * len(handoff.tensors)
    wire = _device_arrays(handoff.tensors, owners)
    out, i = [], 0
    for spec, tensors in handoff.layer_tensors():
        arrays = [_as_dtype(a, ts.dtype) for a, ts in zip(wire[i:i + len(tensors)], spec.tensors(length))]
        i += len(tensors)
        if spec.kind is CacheKind.STATE:
            out.append(generic.rebuild(spec, arrays))
        elif spec.kind is CacheKind.DSV41:
            out.append(dsv41.rebuild(spec, arrays, length))
        else:
            out.append(CLASSES[spec.kind].from_state(_state(spec, arrays, length)))
    mx.eval([c.state for c in out])  # no lazy op left to tie the arrays to this thread's stream
    return out


def _device_arrays(tensors: list[np.ndarray], owners: list[Any]) -> list[mx.array]:
    """Each received tensor as an MLX array (wire dtype): its own array where it was received into one, a DMA
    into a fresh array where it was received into a staging buffer (then given back), else a copy into MLX."""
    staged = [k for k, o in enumerate(owners) if isinstance(o, HostBuffer)]
    fresh = {k: mx.zeros(tensors[k].shape, dtype=_MX_OF_NUMPY[tensors[k].dtype]) for k in staged}
    if staged:
        mx.eval(list(fresh.values()))
        pool = owners[staged[0]].pool
        pool.to_device([(tensors[k], np.array(fresh[k], copy=False)) for k in staged])
        for k in staged:
            owners[k].release()
    return [fresh[k] if k in fresh else (o if isinstance(o, mx.array) else mx.array(t))
            for k, (t, o) in enumerate(zip(tensors, owners))]


def _as_dtype(a: mx.array, dtype: DType) -> mx.array:
    return a.view(mx.bfloat16) if dtype is DType.BFLOAT16 else a


def _state(spec: LayerSpec, arrays: list[mx.array], length: int) -> Any:
    """The ``state`` that mlx-lm's ``from_state`` of the spec's class takes; a rotating cache's next write
    goes after its last position, a CacheList's parts come with their class names."""
    if spec.kind is CacheKind.QUANTIZED:
        return tuple(arrays[:3]), tuple(arrays[3:]), length, spec.group_size, spec.bits
    if spec.kind is CacheKind.KV:
        return arrays[0], arrays[1], length
    if spec.kind is CacheKind.ROTATING:
        return arrays[0], arrays[1], length, spec.keep, spec.max_size, arrays[0].shape[2]
    if spec.kind is CacheKind.CHUNKED:
        return arrays[0], arrays[1], length, spec.max_size, length - arrays[0].shape[2]
    if spec.kind is CacheKind.ARRAYS:
        return list(arrays), None, None
    out, i = [], 0
    for part in spec.parts:
        k = len(part.tensors(length))
        out.append((_state(part, arrays[i:i + k], length), CLASSES[part.kind].__name__))
        i += k
    return out
