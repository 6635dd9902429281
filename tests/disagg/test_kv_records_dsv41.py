"""Record kind DSV41 (9): deepseek_v41's LayerCache through the handoff (``mlxcel.disagg.kv_records_dsv41``).

In process: the tiny deepseek_v41 of conftest (``DEEPSEEK_V41``: a window of 8 rows, layers pooling 1 and 4 tokens
into a compressed row, index keys, a layer with the window alone) prefilled to P tokens, exported, encoded,
decoded and imported into a fresh model instance with the same weights; its next decode steps' float32 logits equal
the original's within 1e-4, for P below, at and above the window and P not a multiple of the ratio. Headers an
attacker could write (other counts, widths, windows, ratios, dtypes; a DSV41 record where the model keeps a KVCache;
a record cut short) are refused before a tensor byte is kept, and tensors of the wrong size never close. Then
router -> prefill -> decode on real transports gives one node's tokens.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from mlxcel.disagg.kv_cache import cache_classes_supported, export_cache, import_cache, probe_layout
from mlxcel.disagg.kv_codec import (
    LAYER_RECORD,
    HandoffDecoder,
    HandoffError,
    KVLayout,
    LayerSpec,
    TensorSpec,
    encode_chunks,
    encode_header,
)
from mlxcel.disagg.wire import CacheKind, DType
from tests.disagg.conftest import DEEPSEEK_V41
from tests.disagg.test_kv_cache_kinds import build

F32 = DType.FLOAT32


@pytest.fixture(scope="module")
def pair():
    """The prefill node's model and the decode node's: separate instances, the same weights."""
    prefill, decode = build(DEEPSEEK_V41), build(DEEPSEEK_V41)
    decode.load_weights(tree_flatten(prefill.parameters()))
    mx.eval(decode.parameters())
    return prefill, decode


def test_the_layout_has_a_dsv41_record_per_layer(pair):
    layout = probe_layout(pair[0])
    assert layout.unsupported is None
    assert layout.layers == (LayerSpec(CacheKind.DSV41, F32, 1, 32, 0, max_size=8, ratio=1),
                             LayerSpec(CacheKind.DSV41, F32, 1, 32, 16, max_size=8, ratio=4),
                             LayerSpec(CacheKind.DSV41, F32, 1, 32, 0, max_size=8, ratio=0))
    shapes = [[t.shape for t in layer.tensors(13)] for layer in layout.layers]
    assert shapes == [[(1, 8, 32), (1, 13, 32)],  # window, 13 compressed rows of 1 token
                      [(1, 8, 32), (1, 3, 32), (1, 3, 16), (1, 1, 32), (1, 1, 32)],  # + index keys, open group
                      [(1, 8, 32)]]
    assert [t.shape for t in layout.layers[1].tensors(3)] == [(1, 3, 32), (1, 3, 32), (1, 3, 32)]  # no closed group
    assert [t.shape for t in layout.layers[1].tensors(8)] == [(1, 8, 32), (1, 2, 32), (1, 2, 16)]  # no open group
    assert cache_classes_supported(pair[0]) is None


def prefill(model, prompt: tuple[int, ...]) -> list:
    cache = model.make_cache()
    mx.eval(model(mx.array([prompt]), cache=cache))
    return cache


def through_the_wire(cache: list, sent: KVLayout, received: KVLayout, prompt: tuple[int, ...]) -> list:
    dec = HandoffDecoder(received, 256)
    for part in [encode_header({}, prompt, sent), *encode_chunks(export_cache(cache, sent, len(prompt)), 97)]:
        dec.feed(part)
    return import_cache(dec.result())


@pytest.mark.parametrize("length", [3, 4, 5, 8, 13])  # below, at and above the 8-row window; 3, 5, 13 % 4 != 0
def test_a_handed_off_cache_continues_like_one_nodes(pair, length):
    source, target = pair
    prompt = tuple(range(3, 3 + length))
    original = prefill(source, prompt)
    copy = through_the_wire(original, probe_layout(source), probe_layout(target), prompt)
    assert [type(c).__name__ for c in copy] == ["LayerCache"] * 3 and all(c.offset == length for c in copy)
    token = mx.array([[5]])
    for step in range(6):  # past the next group's close and the window's next eviction
        want, got = source(token, cache=original), target(token, cache=copy)
        assert want.dtype == mx.float32 and mx.allclose(want, got, atol=1e-4).item(), (length, step)
        token = mx.argmax(want[:, -1:], axis=-1)


def test_the_cache_matters(pair):
    """The comparison above would catch a lost field: a copy without layer 1's compressed rows decodes otherwise."""
    source, target = pair
    prompt = tuple(range(3, 16))
    original = prefill(source, prompt)
    copy = through_the_wire(original, probe_layout(source), probe_layout(target), prompt)
    copy[1].compress_kv = copy[1].compress_kv * 0
    token = mx.array([[5]])
    assert not mx.allclose(source(token, cache=original), target(token, cache=copy), atol=1e-4).item()


def _refused(layout: KVLayout, sent: KVLayout, match: str, prompt=(1, 2, 3, 4, 5)) -> None:
    dec = HandoffDecoder(layout, 256)
    with pytest.raises(HandoffError, match=match):
        dec.feed(encode_header({}, prompt, sent))
    assert dec.state == "error" and dec.held == 0


@pytest.mark.parametrize("change,match", [
    (dict(ratio=2), r"layer 1: dsv41 float32 \[1 heads, k 32, index 16\] 5 window rows of 5 tokens \(window 8, "
                    r"ratio 2\) does not match this model's .*ratio 4\)"),
    (dict(max_size=16), "layer 1: .*window 16.* does not match"),  # a longer window claimed
    (dict(v_dim=32), "layer 1: .*index 32.* does not match"),
    (dict(k_dim=64), "layer 1: .*k 64.* does not match"),
    (dict(dtype=DType.BFLOAT16), "layer 1: dsv41 bfloat16 .* does not match"),
])
def test_a_dsv41_header_other_than_the_models_is_refused(pair, change, match):
    layout = probe_layout(pair[1])
    sent = KVLayout(tuple(replace(s, **change) if s.ratio == 4 else s for s in layout.layers))
    _refused(layout, sent, match)


def test_a_dsv41_record_where_the_model_keeps_a_kv_cache_is_refused(pair):
    kv = LayerSpec(CacheKind.KV, F32, 1, 32, 32)
    layout = KVLayout((kv,) * 3)
    _refused(layout, probe_layout(pair[0]), "layer 0: dsv41 float32 .* does not match this model's kv float32")
    _refused(probe_layout(pair[1]), layout, "layer 0: kv float32 .* does not match this model's dsv41 float32")


def test_a_dsv41_record_cut_short_or_with_a_record_missing_is_refused(pair):
    layout = probe_layout(pair[1])
    header = encode_header({}, (1, 2, 3, 4, 5), layout)
    for cut in (header[:-1], header[:-LAYER_RECORD.size]):
        dec = HandoffDecoder(layout, 256)
        with pytest.raises(HandoffError, match="the handoff header is .* bytes; 3 layer records make it"):
            dec.feed(cut)
        assert dec.state == "error" and dec.held == 0
    _refused(layout, KVLayout(layout.layers[:2]), "the handoff names 2 layers; this model has 3")


@pytest.mark.parametrize("sent,match", [(6, "the chunks carry more than the header's 3008 tensor bytes"),
                                         (4, "the handoff ended after 24 chunks and 2240 of 3008 tensor bytes")])
def test_tensors_for_another_prompt_length_are_refused(pair, sent, match):
    """The tensor bytes are the ones the receiver computes from P: a sender's tensors of P + 1 tokens overflow,
    those of P - 1 (a window row, a compressed row and the open group's row fewer) end short."""
    source = pair[0]
    layout = probe_layout(source)
    tensors = export_cache(prefill(source, tuple(range(3, 3 + sent))), layout, sent)
    dec = HandoffDecoder(layout, 256)
    dec.feed(encode_header({}, (1, 2, 3, 4, 5), layout))
    with pytest.raises(HandoffError, match=match):
        for part in encode_chunks(tensors, 97):
            dec.feed(part)
    assert dec.state == "error" and dec.held == 0


def test_an_export_that_does_not_match_the_layout_is_refused(pair):
    source = pair[0]
    layout = probe_layout(source)
    cache = prefill(source, (3, 4, 5, 6, 7))
    with pytest.raises(HandoffError, match="a layer cache holds 5 tokens, the prompt has 4"):
        export_cache(cache, layout, 4)
    cache[1].index_k = None
    with pytest.raises(HandoffError, match="a LayerCache after 5 tokens has no index_k"):
        export_cache(cache, layout, 5)
    cache = prefill(source, (3, 4, 5, 6, 7))
    cache[1].pending_kv = cache[1].pending_kv.astype(mx.float16)
    with pytest.raises(HandoffError, match="a cache tensor is float16 .*; the model's layout says float32"):
        export_cache(cache, layout, 5)
    with pytest.raises(HandoffError, match="a layer cache is a KVCache; the model's layout says dsv41"):
        export_cache([KVCache()] + cache[1:], layout, 5)


def test_a_dsv41_spec_outside_its_bounds_cannot_be_made():
    with pytest.raises(ValueError, match="a DSV41 layer of 2 heads"):
        LayerSpec(CacheKind.DSV41, F32, 2, 32, 0, max_size=8)
    with pytest.raises(ValueError, match="index keys only beside compressed rows"):
        LayerSpec(CacheKind.DSV41, F32, 1, 32, 16, max_size=8, ratio=0)
    with pytest.raises(ValueError, match="cannot travel"):
        LayerSpec(CacheKind.DSV41, F32, 1, 32, 0, max_size=0)


def test_the_dsv41_example_matches_the_codec():
    from tests.disagg.test_doc_vectors import example_parts

    layout = KVLayout((LayerSpec(CacheKind.DSV41, F32, 1, 1, 1, max_size=2, ratio=2),))
    sent = [np.array([[[2.0], [3.0]]], np.float32), np.array([[[4.0]]], np.float32),
            np.array([[[5.0]]], np.float32), np.array([[[6.0]]], np.float32), np.array([[[7.0]]], np.float32)]
    assert [TensorSpec(F32, a.shape) for a in sent] == layout.tensors(3)
    written = [encode_header({"nonce": "0123456789abcdef"}, (7, 8, 9), layout), *encode_chunks(sent, 24)]
    parts = example_parts("### 4.8 Worked example")
    assert parts == written
    dec = HandoffDecoder(layout, 16)
    for part in parts:
        dec.feed(part)
    got = dec.result()
    assert got.prompt == (7, 8, 9) and all(np.array_equal(a, b) for a, b in zip(got.tensors, sent))



async def one_at_a_time(engine, prompts) -> list[list[int]]:
    from tests.disagg.test_families import greedy
    from tests.engine.fakes import collect_tokens

    return [await collect_tokens(engine.submit(greedy(p, f"r{i}"))) for i, p in enumerate(prompts)]


@pytest.mark.proc  # loading a checkpoint runs ldconfig (tests/proc_marker.py)
def test_router_prefill_decode_continue_exactly_like_one_node(tiny_deepseek_v41):
    """Real transports over loopback (handshake, AES-GCM): greedy requests of 5, 8 and 13-token prompts handed
    off as DSV41 records give a single node's tokens. One at a time: mlx-lm's LayerCache has no ``merge``, so
    the engine cannot batch two deepseek_v41 sequences on any node."""
    import asyncio

    from mlxcel.engine.executor import LocalExecutor
    from mlxcel.engine.scheduler import Scheduler
    from mlxcel.models.loading import load_checkpoint
    from tests.disagg.test_families import role_services

    prompts = [tuple(range(40, 40 + n)) for n in (5, 8, 13)]
    loaded = load_checkpoint(tiny_deepseek_v41)
    single = Scheduler(LocalExecutor(loaded.model, max_batch_size=1), loaded.tokenizer, context_length=2048,
                       parallel=1, warmup=False).start()
    try:
        reference = asyncio.run(one_at_a_time(single, prompts))
    finally:
        single.close()
    with role_services(tiny_deepseek_v41) as (router, prefill, decode):
        assert [spec.kind for spec in decode.layout.layers] == [CacheKind.DSV41] * 3
        assert prefill.layout == decode.layout and decode.layout.unsupported is None
        assert asyncio.run(one_at_a_time(router, prompts)) == reference
        assert decode.counters["handoffs"] == 3
