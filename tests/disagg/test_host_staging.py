"""Handoff staging through a pool of host buffers: the pool's accounting, exact copies both ways, and a real
cache through export, staging, the codec, the staged receive and import (the CPU takes the memory backend,
as ``MLXCEL_HANDOFF_STAGING=1`` does; CUDA's DMA backend is measured by bench/gpu/managed_probe.py)."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxcel.disagg.host_staging import MemoryBackend, Staging, shared_staging, size_class
from mlxcel.disagg.kv_cache import export_cache, import_cache, staged_allocator
from mlxcel.disagg.kv_codec import HandoffDecoder, KVLayout, LayerSpec, encode_chunks, encode_header
from mlxcel.disagg.wire import CacheKind, DType


def test_size_classes_waste_at_most_an_eighth():
    for n in (1, 4096, 4097, 5000, 1 << 20, (1 << 20) + 1, 3_145_728, 172_000_000):
        c = size_class(n)
        assert c >= n and (c <= 4096 or c <= n * 1.125 + 4096)
    assert size_class(3_000_000) == size_class(2_900_000)  # near sizes share a class, so buffers are reused


def test_the_pool_reuses_given_back_and_collected_buffers_and_stops_at_its_limit():
    pool = Staging(MemoryBackend(), limit=(5 << 20) // 2)
    a = pool.take(1 << 20)
    assert a is not None and pool.in_use == size_class(1 << 20)
    ptr = a.ptr
    a.release()
    a.release()  # twice: once counts
    assert pool.in_use == 0
    b = pool.take(1 << 20)
    assert b is not None and b.ptr == ptr  # the same block again, not a new one
    c = pool.take(1 << 20)
    assert c is not None and pool.take(1 << 20) is None  # a third would pass the 2.5 MiB limit
    del c  # a handoff dropped half-way: its buffer comes back when collected
    gc.collect()
    d = pool.take(1 << 20)
    assert d is not None and pool.held == 2 * size_class(1 << 20)


def test_to_host_copies_contiguous_and_strided_views_exactly():
    pool = Staging(MemoryBackend())
    whole = mx.arange(2 * 3 * 10 * 4, dtype=mx.float32).reshape(2, 3, 10, 4)
    sliced = whole[..., :7, :]  # a cache buffer holding more positions than the prompt
    half = (whole * 2).astype(mx.float16)
    mx.eval(whole, sliced, half)
    views = [np.array(sliced, copy=False), np.array(half, copy=False), np.array(mx.contiguous(sliced), copy=False)]
    assert not views[0].flags.c_contiguous and views[2].flags.c_contiguous
    copies, buf = pool.to_host(views)
    for v, c in zip(views, copies):
        assert np.array_equal(v, c) and c.dtype == v.dtype and c.ctypes.data % 256 == 0
        assert buf.ptr <= c.ctypes.data < buf.ptr + buf.nbytes  # in the staging buffer, not the source
    buf.release()
    assert pool.in_use == 0


def test_to_device_refuses_a_size_mismatch():
    pool = Staging(MemoryBackend())
    target = mx.zeros((4,), dtype=mx.float32)
    mx.eval(target)
    with pytest.raises(ValueError, match="16-byte array"):
        pool.to_device([(np.zeros(5, np.float32), np.array(target, copy=False))])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_cache_through_staging_both_ways_arrives_exactly_and_gives_every_buffer_back(dtype):
    wire = DType.BFLOAT16 if dtype == mx.bfloat16 else DType.FLOAT32
    layout = KVLayout(tuple(LayerSpec(CacheKind.KV, wire, 2, 8, 8) for _ in range(3)))
    caches = []
    for i in range(3):
        c = KVCache()
        k = (mx.arange(2 * 5 * 8).reshape(1, 2, 5, 8) + 100 * i).astype(dtype)
        c.update_and_fetch(k, -k)  # its buffer holds 256 positions: the export is a strided view
        caches.append(c)
    sender, receiver = Staging(MemoryBackend()), Staging(MemoryBackend())
    exported = export_cache(caches, layout, 5, contiguous=True)
    assert all(t.flags.c_contiguous for t in exported)
    staged, buf = sender.to_host(exported)
    dec = HandoffDecoder(layout, 64, None, staged_allocator(receiver))
    for part in [encode_header({}, tuple(range(5)), layout), *encode_chunks(staged, 37)]:
        dec.feed(part)
    buf.release()
    handoff = dec.result()
    assert receiver.in_use > 0  # received into the pool's buffers
    got = import_cache(handoff)
    for c, g in zip(caches, got):
        assert mx.array_equal(c.keys[..., :5, :], g.keys) and mx.array_equal(c.values[..., :5, :], g.values)
        assert g.keys.dtype == dtype and g.offset == 5
    assert receiver.in_use == 0 and sender.in_use == 0  # every buffer given back
    handoff.tensors.clear()  # the staged views die with the handoff; the imported arrays are MLX's own
    assert mx.array_equal(caches[2].keys[..., :5, :], got[2].keys)


def test_a_full_receive_pool_falls_back_to_mlx_memory():
    layout = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, 1, 4, 4),))
    keys = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    full = Staging(MemoryBackend(), limit=0)
    dec = HandoffDecoder(layout, 64, None, staged_allocator(full))
    for part in [encode_header({}, (1, 2, 3), layout), *encode_chunks([keys, -keys], 20)]:
        dec.feed(part)
    [cache] = import_cache(dec.result())
    assert np.array_equal(np.array(cache.keys), keys) and np.array_equal(np.array(cache.values), -keys)


def test_staging_is_off_on_a_cpu_unless_asked_for():
    assert shared_staging(None) is None  # MLX on the CPU: nothing to gain
    assert shared_staging(False) is None
    forced = shared_staging(True)
    assert isinstance(forced.backend, MemoryBackend) and shared_staging(True) is forced  # one pool per process
