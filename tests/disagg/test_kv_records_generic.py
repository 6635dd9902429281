"""Record kind STATE (8): an allow-listed mlx-lm cache class carried by the cache state contract alone
(``mlxcel.disagg.kv_records_generic``), and a class without the contract refused by name.

In process: a tiny llama whose ``make_cache`` gives one layer a ``ConcatenateKVCache`` (the allow-list's
class), a prefill, the wire both ways, then decode steps whose logits equal the original cache's (float32,
within 1e-4); the headers an attacker could write (another class code, other shapes, a STATE layer where the
model keeps a KVCache) are refused before any tensor byte is kept.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, make_prompt_cache

from mlxcel.disagg import kv_records_generic as generic
from mlxcel.disagg.kv_cache import cache_classes_supported, probe_layout
from mlxcel.disagg.kv_codec import HandoffDecoder, HandoffError, KVLayout, LayerSpec, TensorSpec, encode_header
from mlxcel.disagg.wire import CacheKind, DType
from tests.disagg.test_kv_cache_kinds import build, through_the_wire

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 128,
         "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def model():
    m = build(LLAMA)
    m.make_cache = lambda: [KVCache(), ConcatenateKVCache(), KVCache()]
    return m


def test_the_layout_names_the_class_by_its_code(model):
    layout = probe_layout(model)
    assert layout.unsupported is None
    state = layout.layers[1]
    assert [s.kind for s in layout.layers] == [CacheKind.KV, CacheKind.STATE, CacheKind.KV]
    assert (state.state_class, state.grows) == (1, 2) and generic.ALLOWED[0].name == "ConcatenateKVCache"
    assert state.tensors(5) == [TensorSpec(DType.FLOAT32, (1, 2, 5, 16))] * 2


@pytest.mark.parametrize("length", [1, 6])
def test_a_state_cache_continues_like_one_nodes(model, length):
    prompt = tuple(range(3, 3 + length))
    layout = probe_layout(model)
    original = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=original))
    copy = through_the_wire(original, layout, prompt)
    assert [type(c).__name__ for c in copy] == ["KVCache", "ConcatenateKVCache", "KVCache"]
    token = mx.array([[5]])
    for step in range(3):
        want, got = model(token, cache=original), model(token, cache=copy)
        assert mx.allclose(want, got, atol=1e-4).item(), (length, step)
        token = mx.argmax(want[:, -1:], axis=-1)


def _refused(layout: KVLayout, sent: KVLayout, match: str) -> None:
    dec = HandoffDecoder(layout, 256)
    with pytest.raises(HandoffError, match=match):
        dec.feed(encode_header({}, (1, 2, 3), sent))
    assert dec.state == "error" and dec.held == 0


@pytest.mark.parametrize("change,match", [
    (dict(state_class=2), "layer 1: state of class 2 with 2 arrays after 3 tokens; .* does not match this model's "
                          "state of class 1"),
    (dict(grows=-1), "layer 1: .* does not match"),  # fixed shapes claimed: other ARRAY records
    (dict(arrays=(TensorSpec(DType.FLOAT32, (1, 4, 1, 16)),) * 2), "layer 1: .* does not match"),
    (dict(arrays=(TensorSpec(DType.FLOAT16, (1, 2, 1, 16)),) * 2), "layer 1: .* does not match"),
])
def test_a_state_header_other_than_the_models_is_refused(model, change, match):
    layout = probe_layout(model)
    sent = KVLayout(tuple(replace(s, **change) if s.kind is CacheKind.STATE else s for s in layout.layers))
    _refused(layout, sent, match)


def test_a_state_record_where_the_model_keeps_a_kv_cache_is_refused(model):
    layout = probe_layout(model)
    sent = KVLayout((layout.layers[1], layout.layers[1], layout.layers[2]))
    _refused(layout, sent, "the handoff header is 198 bytes; 5 layer records make it 150")
    half = replace(layout.layers[1], arrays=layout.layers[1].arrays[:1])  # the same header size: compared
    sent = KVLayout((half, half, layout.layers[2]))
    _refused(layout, sent, "layer 0: state of class 1 with 1 arrays after 3 tokens does not match this model's kv float32")


def test_the_allow_list_is_by_class_not_by_name():
    """A class named like an allowed one (a wire name could say anything) is not it."""
    class ConcatenateKVCache:
        state = ()

        @classmethod
        def from_state(cls, state):
            return cls()

    class Model:
        layers = [object()]

        def make_cache(self):
            return [ConcatenateKVCache()]

    assert generic.allowed(ConcatenateKVCache) is None
    assert "layer 0 keeps a ConcatenateKVCache, which is not on the allow-list" in cache_classes_supported(Model())


def test_the_state_example_matches_the_codec():
    from tests.disagg.test_doc_vectors import example_parts
    from mlxcel.disagg.kv_codec import encode_chunks

    one = TensorSpec(DType.FLOAT32, (1, 1, 1, 1))
    layout = KVLayout((LayerSpec(CacheKind.STATE, arrays=(one, one), state_class=1, grows=2),))
    keys = np.array([[[[1.0], [2.0]]]], np.float32)
    written = [encode_header({"nonce": "0123456789abcdef"}, (7, 8), layout), *encode_chunks([keys, -keys], 24)]
    parts = example_parts("### 4.7 Worked example")
    assert parts == written
    dec = HandoffDecoder(layout, 16)
    for part in parts:
        dec.feed(part)
    got = dec.result()
    assert got.prompt == (7, 8) and np.array_equal(got.tensors[0], keys) and np.array_equal(got.tensors[1], -keys)
