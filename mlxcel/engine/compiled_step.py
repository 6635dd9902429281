"""A compiled decode step: one row, one position, over fixed-capacity KV buffers.

A decode step of a small model on a GPU is bound by host work, not by the device: building the
lazy graph of every layer in Python (a few microseconds per operation, hundreds of operations per
slice) and launching its kernels one by one. ``mx.compile`` traces the step once and replays the
captured graph, with its elementwise operations fused, for every later token of the same shapes.

Shapes stay fixed because the step works on mlx-lm's own ``KVCache`` buffers, whose capacity
grows in blocks of ``KVCache.step`` (256) positions, instead of on the slice ``keys[:offset]``
that changes every token: inside the traced function each layer sees ``_FixedView``, which writes
the new position with ``mx.slice_update`` at an offset held in an array, masks every position
after it, and passes that array to RoPE. So one trace serves every token until the buffer grows
(one new trace per 256 positions). Outside the step the caches stay plain ``KVCache`` objects with
their integer ``offset``, so batching, the prefix cache and the KV handoff see nothing new.

The step applies only where it is exact by construction: one row, one new position, every layer
a plain ``KVCache`` already holding the prompt (``CompiledDecode.accepts``); anything else (a
prompt chunk, a batched micro-batch, rotating, quantized, MLA or linear-attention caches) runs
the plain forward.

It is OFF by default (``MLXCEL_COMPILE_STEP=1`` turns it on): measured on an H200 (MLX CUDA 0.32.4,
2026-12-02, docs/benchmarks.md) it made a Qwen3-0.6B-shaped stage step slower, 3.7 -> 5.9 ms of
compute per token in bfloat16 and 4.0 -> 4.3 ms in 4-bit, and the single process too (149.6 -> 115.7
tok/s in bfloat16), although it ran faster on the CPU (a 28-layer tiny model, 57 -> 43 ms per
step on the loaded 2-core box). bench/gpu/step_probe.py found why: compiling cut the graph
construction of 14 layers from 0.63 to 0.35 ms, but the boolean mask over the buffer costs about
1 ms there (MLX's CUDA attention leaves its decode kernel), and even unmasked the compiled step was
no faster than the plain 1.86 ms. It is kept as an opt-in, with its tests, for the next MLX.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxcel.config import env_switch

Forward = Callable[[mx.array, list], mx.array]
COMPILE_ENV = "MLXCEL_COMPILE_STEP"


def compile_enabled() -> bool:
    """``MLXCEL_COMPILE_STEP`` when set (1/0), else off (it measured slower on the H200; see the module)."""
    return env_switch(COMPILE_ENV) is True


class _FixedView:
    """What one layer's attention sees while the step is traced: the whole buffer, written at ``offset``."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset  # offset: int32 scalar array

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """Query i (at offset + i) sees the buffer's positions 0 .. offset + i; the rest are unused."""
        if window_size is not None:  # never reached: windowed layers use RotatingKVCache (see accepts)
            raise ValueError("a compiled step has no sliding window")
        positions = mx.arange(self.keys.shape[2])
        return positions[None, :] <= (self.offset + mx.arange(n))[:, None]


class CompiledDecode:
    """``forward(inputs, cache)`` with its single-row decode steps compiled; every other call as is."""

    def __init__(self, forward: Forward):
        self.forward = forward
        self._step = mx.compile(self._traced)
        self.compiled_steps = 0  # steps that ran compiled (tests and benchmarks read it)

    def _traced(self, inputs: mx.array, offset: mx.array, *buffers: mx.array) -> tuple[mx.array, ...]:
        views = [_FixedView(buffers[i], buffers[i + 1], offset) for i in range(0, len(buffers), 2)]
        out = self.forward(inputs, views)
        return (out, *[b for v in views for b in (v.keys, v.values)])

    @staticmethod
    def accepts(inputs: mx.array, cache: list | None) -> bool:
        """One row, one position, every layer a plain KVCache holding at least one position at one offset."""
        if not cache or inputs.shape[0] != 1 or inputs.shape[1] != 1:
            return False
        if any(type(c) is not KVCache or c.keys is None or c.offset == 0 for c in cache):
            return False
        return len({c.offset for c in cache}) == 1

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        if not self.accepts(inputs, cache):
            return self.forward(inputs, cache)
        assert cache is not None
        offset = cache[0].offset
        for c in cache:
            _reserve(c, offset + 1)
        out, *buffers = self._step(inputs, mx.array(offset, dtype=mx.int32),
                                   *[b for c in cache for b in (c.keys, c.values)])
        for c, keys, values in zip(cache, buffers[0::2], buffers[1::2]):
            c.keys, c.values, c.offset = keys, values, offset + 1
        self.compiled_steps += 1
        return out


def _reserve(cache: KVCache, positions: int) -> None:
    """Grow a KVCache's buffers to hold ``positions``, in whole blocks of ``KVCache.step`` (zeros after offset)."""
    capacity = cache.keys.shape[2]
    if positions <= capacity:
        return
    step = cache.step
    grown = (positions + step - 1) // step * step
    kept = cache.offset

    def grow(buf: mx.array) -> mx.array:
        pad = mx.zeros((*buf.shape[:2], grown - kept, buf.shape[3]), buf.dtype)
        return mx.concatenate([buf[..., :kept, :], pad], axis=2)

    cache.keys, cache.values = grow(cache.keys), grow(cache.values)


def decode_forward(forward: Forward, enabled: bool | None = None) -> Forward:
    """``forward`` with compiled single-row decode steps when enabled (``compile_enabled()`` by default)."""
    on = compile_enabled() if enabled is None else enabled
    return CompiledDecode(forward) if on else forward


def compiled_steps(forward: Any) -> int | None:
    """How many steps a forward from ``decode_forward`` ran compiled (None: not compiled)."""
    return forward.compiled_steps if isinstance(forward, CompiledDecode) else None
