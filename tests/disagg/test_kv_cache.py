"""Real mlx-lm caches through the handoff codec: what a decode node adopts continues token for token."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from mlxcel.disagg.kv_cache import export_cache, handoff_allocator, import_cache, mx_allocator, probe_layout
from mlxcel.disagg.kv_codec import HandoffDecoder, HandoffError, KVLayout, LayerSpec, encode_chunks, encode_header
from mlxcel.disagg.wire import CacheKind, DType
from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.sampling import SamplingParams
from mlxcel.engine.scheduler import Scheduler
from tests.engine.fakes import collect_tokens

PROMPT = tuple(range(40, 60))  # 20 tokens: longer than the sliding window (8)
OTHER = (1, 50, 51, 52, 53)


def load(path):
    from mlxcel.models.loading import load_checkpoint

    return load_checkpoint(path)


@contextlib.contextmanager
def local(loaded) -> Iterator[Scheduler]:
    from mlxcel.engine.executor import LocalExecutor

    sched = Scheduler(LocalExecutor(loaded.model, max_batch_size=2), loaded.tokenizer, context_length=2048,
                      parallel=2, warmup=False).start()
    try:
        yield sched
    finally:
        sched.close()


def greedy(prompt, rid: str, n: int = 10) -> EngineRequest:
    return EngineRequest(tuple(prompt), SamplingParams(max_tokens=n), ignore_eos=True, request_id=rid)


def handed_over(loaded, request: EngineRequest, chunk_len: int = 4096):
    """Prefill on one executor, export, encode, decode, import: what a decode node receives."""
    from mlxcel.engine.executor import LocalExecutor, Step

    layout = probe_layout(loaded.model)
    node = LocalExecutor(loaded.model, max_batch_size=1)
    node.prepare(request.request_id, request.params, 0, request.prompt)
    [first] = node.run(Step("prefill", [request.request_id], [list(request.prompt)]))
    cache, length = node.runners[0].take_cache(request.request_id)
    tensors = export_cache(cache, layout, length)
    dec = HandoffDecoder(layout, 2048, None, handoff_allocator())  # as a decode node receives
    for part in [encode_header({"n": 1}, request.prompt, layout), *encode_chunks(tensors, chunk_len)]:
        dec.feed(part)
    return first, import_cache(dec.result()), layout


def _address(a) -> int:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a, copy=False).__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_handoff_received_into_mlx_memory_is_imported_without_a_copy(dtype):
    """The decode node's receive path: chunk bytes land in MLX arrays that become the cache's own."""
    from mlx_lm.models.cache import KVCache

    assert handoff_allocator() is mx_allocator  # MLX on the CPU: a numpy view writes into the array
    layout = KVLayout(tuple(LayerSpec(CacheKind.KV, DType.BFLOAT16 if dtype == mx.bfloat16 else DType.FLOAT32, 2, 8, 8)
                            for _ in range(2)))
    caches = []
    for i in range(2):
        c = KVCache()
        k = (mx.arange(2 * 5 * 8).reshape(1, 2, 5, 8) + 100 * i).astype(dtype)
        c.update_and_fetch(k, -k)
        caches.append(c)
    dec = HandoffDecoder(layout, 64, None, mx_allocator)
    for part in [encode_header({}, tuple(range(5)), layout), *encode_chunks(export_cache(caches, layout, 5), 37)]:
        dec.feed(part)
    handoff = dec.result()
    got = import_cache(handoff)
    for c, g in zip(caches, got):
        assert mx.array_equal(c.keys[..., :5, :], g.keys) and mx.array_equal(c.values[..., :5, :], g.values)
        assert g.keys.dtype == dtype and g.offset == 5
    assert [_address(g.keys) for g in got] == [t.__array_interface__["data"][0] for t in handoff.tensors[::2]]


def test_the_copy_switch_receives_into_numpy_buffers_and_imports_a_copy(monkeypatch):
    monkeypatch.setenv("MLXCEL_HANDOFF_COPY", "1")
    assert handoff_allocator() is None
    layout = KVLayout((LayerSpec(CacheKind.KV, DType.FLOAT32, 1, 4, 4),))
    keys = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    dec = HandoffDecoder(layout, 64, None, handoff_allocator())
    for part in [encode_header({}, (1, 2, 3), layout), *encode_chunks([keys, -keys], 20)]:
        dec.feed(part)
    handoff = dec.result()
    [cache] = import_cache(handoff)
    assert np.array_equal(np.array(cache.keys), keys) and np.array_equal(np.array(cache.values), -keys)
    assert _address(cache.keys) != handoff.tensors[0].__array_interface__["data"][0]  # MLX holds its own copy
    monkeypatch.setenv("MLXCEL_HANDOFF_COPY", "0")
    assert handoff_allocator() is mx_allocator
    monkeypatch.setenv("MLXCEL_HANDOFF_COPY", "maybe")
    with pytest.raises(ValueError, match="MLXCEL_HANDOFF_COPY"):
        handoff_allocator()


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_sliding", "tiny_gemma3", "tiny_bf16", "tiny_mamba",
                                     "tiny_deepseek_v32"])
def test_an_adopted_handoff_continues_exactly_like_one_node(fixture, request):
    loaded = load(request.getfixturevalue(fixture))

    async def main():
        with local(loaded) as sched:
            ref = [await collect_tokens(sched.submit(greedy(p, f"ref{i}"))) for i, p in enumerate((PROMPT, OTHER))]
        first, cache, _ = handed_over(loaded, greedy(PROMPT, "h"))
        with local(loaded) as sched:
            other = sched.submit(greedy(OTHER, "other"))  # batched beside the adopted row
            adopted = sched.submit_prefilled(greedy(PROMPT, "h"), first, cache)
            got = [await collect_tokens(adopted), await collect_tokens(other)]
        assert got == ref

    run(main())


def test_layouts_name_the_cache_kinds_dtypes_and_shapes(tiny_llama, tiny_sliding, tiny_bf16):
    plain = probe_layout(load(tiny_llama).model)
    assert plain.unsupported is None and len(plain.layers) == 4
    assert {(s.kind, s.dtype, s.heads, s.k_dim, s.v_dim) for s in plain.layers} == {(CacheKind.KV, DType.FLOAT32, 2, 16, 16)}
    sliding = probe_layout(load(tiny_sliding).model)
    assert [s.kind for s in sliding.layers] == [CacheKind.KV, CacheKind.ROTATING] * 2
    assert sliding.layers[1].max_size == 8 and sliding.nbytes(20) < plain.nbytes(20)
    assert {s.dtype for s in probe_layout(load(tiny_bf16).model).layers} == {DType.BFLOAT16}


def test_a_sliding_layer_sends_only_its_window(tiny_sliding):
    loaded = load(tiny_sliding)
    _, cache, layout = handed_over(loaded, greedy(PROMPT, "w"), chunk_len=333)
    assert [type(c) for c in cache] == [KVCache, RotatingKVCache] * 2
    assert cache[0].keys.shape[2] == 20 and cache[1].keys.shape[2] == 8 and cache[1].offset == 20


def test_a_gemma3_sliding_layer_sends_only_its_window(tiny_gemma3):
    _, cache, layout = handed_over(load(tiny_gemma3), greedy(PROMPT, "g"), chunk_len=100)
    assert [s.kind for s in layout.layers] == [CacheKind.ROTATING, CacheKind.KV] * 2
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache] * 2
    assert cache[0].keys.shape[2] == 8 and cache[0].offset == 20 and cache[1].keys.shape[2] == 20


def rotating(keep: int, steps: int) -> tuple[RotatingKVCache, mx.array]:
    """A window-8 cache fed 5 prompt positions at once, then ``steps`` one at a time; and every key it saw."""
    seen = mx.arange(5 + steps, dtype=mx.float32).reshape(1, 1, -1, 1) * mx.ones((1, 1, 1, 2))
    c = RotatingKVCache(max_size=8, keep=keep)
    c.update_and_fetch(seen[..., :5, :], -seen[..., :5, :])
    for i in range(5, 5 + steps):
        c.update_and_fetch(seen[..., i:i + 1, :], -seen[..., i:i + 1, :])
    return c, seen


def rotating_layout(keep: int) -> KVLayout:
    return KVLayout((LayerSpec(CacheKind.ROTATING, DType.FLOAT32, 1, 2, 2, max_size=8, keep=keep),))


def through_the_wire(cache: list, layout: KVLayout, length: int) -> list:
    dec = HandoffDecoder(layout, 2048)
    for part in [encode_header({}, tuple(range(length)), layout), *encode_chunks(export_cache(cache, layout, length), 50)]:
        dec.feed(part)
    return import_cache(dec.result())


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("steps", [0, 2, 9, 13])  # not full, full, wrapped once, wrapped past the end
def test_a_rotating_cache_sends_its_window_in_temporal_order(keep, steps):
    c, seen = rotating(keep, steps)
    n = min(seen.shape[2], 8)
    want = mx.concatenate([seen[..., :keep, :], seen[..., seen.shape[2] - (n - keep):, :]], axis=2) if n == 8 else seen
    [keys, values] = export_cache([c], rotating_layout(keep), c.offset)
    assert np.array_equal(keys, np.array(want)) and np.array_equal(values, -np.array(want))


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("steps", [0, 2, 9])
def test_an_imported_rotating_cache_goes_on_like_the_original(keep, steps):
    """The rebuilt cache's next writes land where the original's do: same window after every step."""
    original, _ = rotating(keep, steps)
    layout = rotating_layout(keep)
    [copy] = through_the_wire([original], layout, original.offset)
    assert copy.offset == original.offset and copy.max_size == 8 and copy.keep == keep
    for i in range(10):
        x = mx.full((1, 1, 1, 2), 100.0 + i)
        for c in (original, copy):
            c.update_and_fetch(x, -x)
        assert [np.array_equal(a, b) for a, b in zip(export_cache([original], layout, original.offset),
                                                      export_cache([copy], layout, copy.offset))] == [True, True]


def test_a_quantized_cache_round_trips_bit_for_bit():
    from mlxcel.disagg.kv_cache import spec_of

    quantized = []
    for seed in range(3):
        c = KVCache()
        k = mx.random.normal((1, 2, len(PROMPT), 64), key=mx.random.key(seed)).astype(mx.bfloat16)
        c.update_and_fetch(k, -k)
        quantized.append(c.to_quantized(group_size=32, bits=4))
    layout = KVLayout(tuple(spec_of(type(c).__name__, c.state) for c in quantized))
    assert layout.layers[0].kind is CacheKind.QUANTIZED and layout.layers[0].k_dim == 64
    assert layout.layers[0].dtype is DType.BFLOAT16
    tensors = export_cache(quantized, layout, len(PROMPT))
    dec = HandoffDecoder(layout, 2048)
    for part in [encode_header({}, PROMPT, layout), *encode_chunks(tensors, 100)]:
        dec.feed(part)
    back = import_cache(dec.result())
    assert all(isinstance(c, QuantizedKVCache) and c.offset == len(PROMPT) for c in back)
    for a, b in zip(quantized, back):
        for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
            assert x.dtype == y.dtype
            assert mx.array_equal(x[..., :len(PROMPT), :], y).item()


def test_a_chunked_attention_model_travels_as_chunked_records(tiny_llama4):
    """llama4's chunked layers (tests/disagg/test_kv_cache_kinds.py continues them against one node)."""
    layout = probe_layout(load(tiny_llama4).model)
    assert layout.unsupported is None and layout.layers[0].kind is CacheKind.CHUNKED
    HandoffDecoder(layout, 2048)


def test_a_cache_list_travels_as_its_caches(tiny_deepseek_v32):
    """deepseek_v32: a CacheList per layer (MLA latents and the indexer's keys), each part a KV record."""
    layout = probe_layout(load(tiny_deepseek_v32).model)
    assert layout.unsupported is None and [s.kind for s in layout.layers] == [CacheKind.LIST] * 4
    assert [p.kind for p in layout.layers[0].parts] == [CacheKind.KV, CacheKind.KV]
    assert (layout.layers[0].parts[0].heads, layout.layers[0].parts[1].k_dim) == (1, 16)  # latents; indexer keys
    _, back, _ = handed_over(load(tiny_deepseek_v32), greedy(PROMPT, "v32"))
    assert all(type(c).__name__ == "CacheList" and c.caches[0].offset == len(PROMPT) for c in back)


def test_a_mamba_state_travels_whole(tiny_mamba):
    """A recurrent model (ArraysCache in every layer): its conv and SSM state arrays, whatever the prompt's length."""
    layout = probe_layout(load(tiny_mamba).model)
    assert layout.unsupported is None
    assert [s.kind for s in layout.layers] == [CacheKind.ARRAYS] * 2
    assert layout.nbytes(3) == layout.nbytes(300) > 0


def test_a_cache_whose_length_is_not_the_prompt_is_not_exported(tiny_llama):
    loaded = load(tiny_llama)
    layout = probe_layout(loaded.model)
    cache = [KVCache() for _ in layout.layers]
    for c in cache:
        c.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))
    with pytest.raises(HandoffError, match="holds 3 tokens, the prompt has 4"):
        export_cache(cache, layout, 4)
    with pytest.raises(HandoffError, match="3 layers"):
        export_cache(cache[:3], layout, 3)
