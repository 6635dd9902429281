"""The cache kinds of issue 43's round two through the handoff: llama4's ChunkedKVCache (a chunked layer
sends the last min(tokens, chunk size) positions, record kind CHUNKED), and a cache class with no
``from_state`` refused by name (one named like deepseek_v41's LayerCache, which record kind DSV41 carries, but not it). In process: a tiny model of the family built
from mlx-lm's classes, its own ``make_cache``, a prefill, the wire both ways, then decode steps whose
logits equal the original cache's (float32, within 1e-4)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.disagg.kv_cache import cache_classes_supported, export_cache, import_cache, probe_layout
from mlxcel.disagg.kv_codec import LAYER_RECORD, HandoffDecoder, HandoffError, encode_chunks, encode_header
from mlxcel.disagg.wire import CacheKind, DType

LLAMA4 = {"model_type": "llama4", "text_config": {
    "model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 4, "head_dim": 16,
    "hidden_size": 64, "interleave_moe_layer_step": 2, "intermediate_size": 32, "intermediate_size_mlp": 128,
    "max_position_embeddings": 256, "num_attention_heads": 4, "num_experts_per_tok": 1, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "num_local_experts": 2, "rms_norm_eps": 1e-5, "rope_scaling": None,
    "rope_theta": 10000.0, "use_qk_norm": True, "vocab_size": 128}}


def build(config: dict):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    mx.random.seed(3)
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def llama4():
    return build(LLAMA4)


def through_the_wire(cache: list, layout, prompt: tuple[int, ...]) -> list:
    dec = HandoffDecoder(layout, 256)
    for part in [encode_header({}, prompt, layout), *encode_chunks(export_cache(cache, layout, len(prompt)), 97)]:
        dec.feed(part)
    return import_cache(dec.result())


def test_llama4s_layout_has_chunked_layers(llama4):
    layout = probe_layout(llama4)
    assert layout.unsupported is None
    assert [s.kind for s in layout.layers] == [CacheKind.CHUNKED] * 3 + [CacheKind.KV]
    chunked = layout.layers[0]
    assert (chunked.dtype, chunked.heads, chunked.k_dim, chunked.max_size) == (DType.FLOAT32, 2, 16, 4)
    assert chunked.positions(3) == 3 and chunked.positions(11) == 4  # the last chunk's worth at most
    assert LAYER_RECORD.unpack(chunked.record(11)) == (CacheKind.CHUNKED, DType.FLOAT32, 2, 16, 16, 4, 11, 0, 4)


@pytest.mark.parametrize("length", [3, 6, 9])  # inside the first chunk, across one, across two
def test_a_chunked_cache_continues_like_one_nodes(llama4, length):
    prompt = tuple(int(t) for t in np.arange(1, length + 1) * 7 % 128)
    layout = probe_layout(llama4)
    original = make_prompt_cache(llama4)
    mx.eval(llama4(mx.array([prompt]), cache=original))
    copy = through_the_wire(original, layout, prompt)
    assert [type(c).__name__ for c in copy] == [type(c).__name__ for c in original]
    token = mx.array([[5]])
    for step in range(6):  # past the next chunk boundary
        want, got = llama4(token, cache=original), llama4(token, cache=copy)
        assert mx.allclose(want, got, atol=1e-4).item(), (length, step)
        token = mx.argmax(want[:, -1:], axis=-1)


def test_a_chunked_header_with_another_chunk_size_is_refused(llama4):
    from dataclasses import replace

    from mlxcel.disagg.kv_codec import KVLayout

    layout = probe_layout(llama4)
    other = KVLayout(tuple(replace(s, max_size=8) if s.kind is CacheKind.CHUNKED else s for s in layout.layers))
    dec = HandoffDecoder(layout, 256)
    with pytest.raises(HandoffError, match="layer 0: chunked .* does not match this model's chunked"):
        dec.feed(encode_header({}, tuple(range(1, 7)), other))


def test_a_cache_class_without_from_state_is_refused_by_name():
    """A class named like deepseek_v41's LayerCache (which kv_records_dsv41 carries) is not it: by class, not name."""
    class LayerCache:  # the shape of deepseek_v41's: a state property, no setter, no from_state
        state = ()

    class Model:
        layers = [object()]

        def make_cache(self):
            return [LayerCache()]

    assert cache_classes_supported(Model()) == (
        "this model's KV cache cannot be handed off to a decode node: layer 0 keeps a LayerCache, whose class has "
        "neither from_state nor a state setter (mlx-lm's cache state contract), so a decode node cannot rebuild "
        "it (supported: KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache, CacheList, ChunkedKVCache, "
        "ConcatenateKVCache, deepseek_v41's LayerCache; a CacheList of the first six)")
