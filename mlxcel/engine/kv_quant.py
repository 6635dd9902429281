"""Quantized KV cache (``--kv-bits``, ``--kv-group-size``): mlx-lm's ``QuantizedKVCache`` from the first token.

``use_kv_bits(model, quant)`` makes every cache the model makes from then on a ``QuantizedKVCache`` (keys and
values packed to ``bits`` with one scale and bias per ``group_size`` values, mlx-lm's own class and attention
path: ``scaled_dot_product_attention`` sees ``cache.bits``). It sets ``make_cache`` on the model instance, the
hook mlx-lm's ``make_prompt_cache`` and ``ModelSlice.make_cache`` already call, so every role (a single node,
a pipeline stage, a TP rank, a prefill or decode node) gets the same caches without a second code path.

Policy: quantized from the first token (mlx-lm's ``quantized_kv_start`` = 0); a prompt's cache is never
converted mid-way, so a prefix-cache entry, a handoff and every stage hold one kind of cache throughout.
Only families whose every layer keeps a plain ``KVCache`` qualify: mlx-lm cannot quantize a
``RotatingKVCache`` (sliding windows), an ``ArraysCache`` (linear attention, SSM), a ``ChunkedKVCache`` or a
``CacheList``, and such a family is refused by name at start-up (``KVBitsError``).

mlx-lm has no batched quantized cache; ``BatchQuantizedKVCache`` is one, in the shape of its
``BatchKVCache`` (left-padded rows, per-row offsets), so rows join and leave a decode micro-batch as with
full-precision caches (``mlxcel.engine.batch_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache, make_prompt_cache

from mlxcel.config import DEFAULT_KV_GROUP_SIZE, KV_BITS, KV_GROUP_SIZES
from mlxcel.error_codes import CodedError, ErrorCode
from mlxcel.errors import CLIError


Parts = tuple[mx.array, mx.array, mx.array]  # packed values (uint32), scales, biases: [B, H, L, *]


class KVBitsError(CLIError, CodedError, ValueError):
    """``--kv-bits`` cannot apply: a bad width or group size (BAD_REQUEST), or a family whose caches cannot be
    quantized (UNSUPPORTED). A ``CLIError``: one line at start-up."""

    code = ErrorCode.BAD_REQUEST


@dataclass(frozen=True)
class KVQuant:
    """How the KV cache is quantized: ``bits`` per value, one scale and bias per ``group_size`` values."""

    bits: int
    group_size: int = DEFAULT_KV_GROUP_SIZE

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise KVBitsError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, got {self.bits}")
        if self.group_size not in KV_GROUP_SIZES:
            raise KVBitsError(f"--kv-group-size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, "
                              f"got {self.group_size}")


def kv_quant(bits: int | None, group_size: int = DEFAULT_KV_GROUP_SIZE) -> KVQuant | None:
    """The setting of ``--kv-bits`` / ``--kv-group-size`` (None: full precision; KVBitsError: out of bounds)."""
    return None if bits is None else KVQuant(bits, group_size)


def _family(model: Any) -> str:
    hyper = getattr(model, "args", None)  # mlx-lm's ModelArgs
    return str(getattr(hyper, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1])


def _head_dims(model: Any) -> set[int]:
    """The key/value head widths the model's args give (empty where they do not say)."""
    hyper = getattr(model, "args", None)  # mlx-lm's ModelArgs
    dims = {getattr(hyper, name, None) for name in ("head_dim", "v_head_dim", "qk_head_dim")}
    heads, hidden = getattr(hyper, "num_attention_heads", None), getattr(hyper, "hidden_size", None)
    if not any(isinstance(d, int) for d in dims) and isinstance(heads, int) and isinstance(hidden, int) and heads:
        dims.add(hidden // heads)
    return {d for d in dims if isinstance(d, int) and d > 0}


def use_kv_bits(model: Any, quant: KVQuant | None) -> None:
    """Make ``model`` build quantized caches (``quant`` None: leave it as it is). KVBitsError, naming the family and
    the cache class, where a layer's cache is not a plain ``KVCache`` or a head width is not whole groups."""
    if quant is None:
        return
    family = _family(model)
    caches = make_prompt_cache(model)
    if caches and all(type(c) is QuantizedKVCache and (c.bits, c.group_size) == (quant.bits, quant.group_size)
                      for c in caches):
        return  # already applied
    for i, cache in enumerate(caches):
        if type(cache) is not KVCache:
            raise KVBitsError(f"--kv-bits: {family}'s layer {i} keeps a {type(cache).__name__}, which mlx-lm cannot "
                              "quantize (only families whose every layer keeps a KVCache can)", ErrorCode.UNSUPPORTED)
    for dim in sorted(_head_dims(model)):
        if dim % quant.group_size:
            raise KVBitsError(f"--kv-group-size {quant.group_size}: {family}'s head width {dim} is not a whole "
                              "number of groups")
    layers = len(caches)
    model.make_cache = lambda: [QuantizedKVCache(group_size=quant.group_size, bits=quant.bits) for _ in range(layers)]


def _zeros(b: int, h: int, n: int, dim: int, dtype: mx.Dtype, bits: int, group_size: int) -> Parts:
    return (mx.zeros((b, h, n, dim * bits // 32), dtype=mx.uint32), mx.zeros((b, h, n, dim // group_size), dtype=dtype),
            mx.zeros((b, h, n, dim // group_size), dtype=dtype))


def _take(parts: Parts, index: Any) -> Parts:
    return tuple(p[index] for p in parts)  # type: ignore[return-value]


def _columns(parts: Parts, start: int, end: int | None) -> Parts:
    return tuple(p[..., start:end, :] for p in parts)  # type: ignore[return-value]


def _pad(parts: Parts, left: int, right: int) -> Parts:
    if not left and not right:
        return parts
    return tuple(mx.pad(p, [(0, 0), (0, 0), (left, right), (0, 0)]) for p in parts)  # type: ignore[return-value]


class BatchQuantizedKVCache(_BaseCache):
    """Left-padded rows of quantized keys and values (mlx-lm's ``BatchKVCache``, quantized): ``keys``/``values`` are
    (packed, scales, biases) [B, H, L, *]; ``offset`` per row, ``_idx`` the write column, ``left_padding`` per row."""

    step = 256

    def __init__(self, left_padding: Sequence[int], group_size: int, bits: int):
        self.keys: Parts | None = None
        self.values: Parts | None = None
        self.left_padding = mx.array(list(left_padding))
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Parts, Parts]:
        b, h, n, _ = keys.shape
        prev = self._idx
        if self.keys is None or self.values is None or prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step
            new_k = _zeros(b, h, grow, keys.shape[-1], keys.dtype, self.bits, self.group_size)
            new_v = _zeros(b, h, grow, values.shape[-1], values.dtype, self.bits, self.group_size)
            if self.keys is None or self.values is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = tuple(mx.concatenate([p[..., :prev, :], z], axis=2) for p, z in zip(self.keys, new_k))
                self.values = tuple(mx.concatenate([p[..., :prev, :], z], axis=2) for p, z in zip(self.values, new_v))
        self.offset = self.offset + n
        self._idx += n
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev:self._idx, :] = qk[i]
            self.values[i][..., prev:self._idx, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Parts, Parts]:
        assert self.keys is not None and self.values is not None
        return _columns(self.keys, 0, self._idx), _columns(self.values, 0, self._idx)

    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits

    @state.setter
    def state(self, v: tuple) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.bits = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:  # noqa: N803 - mlx-lm's name
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(p.nbytes for p in (*self.keys, *self.values))

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep rows ``batch_indices`` in place, cutting the left padding they all share."""
        rows = mx.array(list(batch_indices), dtype=mx.int32)
        if self.keys is not None and self.values is not None:
            self.keys, self.values = _take(self.keys, rows), _take(self.values, rows)
        self.offset, self.left_padding = self.offset[rows], self.left_padding[rows]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None and self.values is not None:
                self.keys, self.values = _columns(self.keys, shift, None), _columns(self.values, shift, None)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append ``other``'s rows in place, both right-aligned at the larger write column."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        top = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other
        assert like.keys is not None and like.values is not None

        def aligned(c: BatchQuantizedKVCache) -> tuple[Parts, Parts, mx.array]:
            left = top - c._idx
            if c.keys is None or c.values is None:
                rows = c.offset.shape[0]
                k = tuple(mx.zeros((rows, p.shape[1], 0, p.shape[3]), p.dtype) for p in like.keys)
                v = tuple(mx.zeros((rows, p.shape[1], 0, p.shape[3]), p.dtype) for p in like.values)
            else:
                k, v = c.keys, c.values
            right = size - k[0].shape[2] - left
            if right < 0:
                k, v, right = _columns(k, 0, right), _columns(v, 0, right), 0
            return _pad(k, left, right), _pad(v, left, right), c.left_padding + left

        (k1, v1, p1), (k2, v2, p2) = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = top

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row ``idx`` as a standalone one-row ``QuantizedKVCache``."""
        row = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        pad = int(self.left_padding[idx].item())
        if self.keys is not None and self.values is not None:
            row.keys = tuple(mx.contiguous(p[idx : idx + 1, :, pad:self._idx]) for p in self.keys)
            row.values = tuple(mx.contiguous(p[idx : idx + 1, :, pad:self._idx]) for p in self.values)
        row.offset = self._idx - pad
        return row

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> BatchQuantizedKVCache:
        """One-row quantized caches as one batch, each left-padded to the longest."""
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], first.group_size, first.bits)
        full = [c for c in caches if c.keys is not None]
        if longest == 0 or not full:
            return batch
        rows: list[tuple[Parts, Parts]] = []
        for c, n in zip(caches, lengths):
            ref = full[0]
            if c.keys is None or n == 0:
                k = tuple(mx.zeros((1, p.shape[1], longest, p.shape[3]), p.dtype) for p in ref.keys)
                v = tuple(mx.zeros((1, p.shape[1], longest, p.shape[3]), p.dtype) for p in ref.values)
            else:
                k = _pad(_columns(c.keys, 0, n), longest - n, 0)
                v = _pad(_columns(c.values, 0, n), longest - n, 0)
            rows.append((k, v))
        batch.keys = tuple(mx.concatenate([r[0][i] for r in rows]) for i in range(3))
        batch.values = tuple(mx.concatenate([r[1][i] for r in rows]) for i in range(3))
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def kv_bytes_per_token(config: dict, bits: int | None = None, group_size: int = DEFAULT_KV_GROUP_SIZE,
                       dtype_bytes: int | None = None) -> int:
    """Bytes one token of context takes in every layer's keys and values (config.json's shape): full precision
    ``layers x 2 x kv_heads x head_dim x dtype bytes``; quantized, ``head_dim x bits / 8`` packed bytes plus one
    scale and one bias (dtype bytes each) per ``group_size`` values. ``dtype_bytes`` defaults to torch_dtype's."""
    if bits is not None:
        KVQuant(bits, group_size)  # KVBitsError on a bad width or group size
    layers, heads = int(config["num_hidden_layers"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    width = dtype_bytes or _DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)
    if bits is None:
        per_head = head_dim * width
    else:
        if head_dim % group_size:
            raise KVBitsError(f"--kv-group-size {group_size}: head width {head_dim} is not a whole number of groups")
        per_head = head_dim * bits // 8 + 2 * (head_dim // group_size) * width
    return layers * 2 * kv_heads * per_head


def max_kv_tokens(config: dict, budget_bytes: int, bits: int | None = None, group_size: int = DEFAULT_KV_GROUP_SIZE,
                  dtype_bytes: int | None = None) -> int:
    """How many tokens of KV cache fit in ``budget_bytes`` (one sequence; weights and activations not counted)."""
    return budget_bytes // kv_bytes_per_token(config, bits, group_size, dtype_bytes)
