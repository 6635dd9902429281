"""The handoff of every Mamba / short-convolution family's caches (issue 43): jamba (Mamba), lfm2 (short
convolution), granitemoehybrid, nemotron_h and falcon_h1 (Mamba-2), and bailing_hybrid (linear attention) keep their recurrent and convolution
state in ``ArraysCache`` beside attention's ``KVCache``. In process, per family: a tiny model from
mlx-lm's own classes, its ``make_prompt_cache``, a prefill, then export, encode, decode and import; the
decode steps after it give the logits the original cache gives (float32, within 1e-4)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.disagg.kv_cache import probe_layout
from mlxcel.disagg.wire import CacheKind
from tests.disagg.test_kv_cache_kinds import build, through_the_wire

KV, ARR = CacheKind.KV, CacheKind.ARRAYS
NEMOTRON_H = {"model_type": "nemotron_h", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "max_position_embeddings": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "attention_bias": False, "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
              "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
              "use_bias": False, "use_conv_bias": True, "hybrid_override_pattern": ["M", "*", "M", "-"],
              "head_dim": 16}
FALCON_H1 = {"model_type": "falcon_h1", "hidden_size": 64, "head_dim": 16, "intermediate_size": 128,
             "mamba_chunk_size": 8, "mamba_d_conv": 4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 16,
             "mamba_n_heads": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
             "vocab_size": 128, "max_position_embeddings": 256}


def _config(family: str) -> dict:
    if family == "nemotron_h":
        return NEMOTRON_H
    if family == "falcon_h1":
        return FALCON_H1
    from mlxcel.commands.support import family_config

    config = family_config(family)
    assert config is not None
    return config


#: family -> the record kinds of its layers' caches
TABLE = {
    "jamba": None,  # its tiny config's attention / Mamba pattern: checked to hold both kinds
    "lfm2": None,
    "granitemoehybrid": None,
    "nemotron_h": [ARR, KV, ARR],  # the MLP layer ("-") keeps no cache
    "falcon_h1": [CacheKind.LIST] * 2,  # each layer: Mamba-2 state and attention KV side by side
    "bailing_hybrid": [ARR, KV, ARR, KV],  # GLA (linear attention) state, then MLA's KV, in turn
}


@pytest.mark.parametrize("family", list(TABLE))
@pytest.mark.parametrize("length", [3, 11])
def test_a_hybrid_cache_continues_like_one_nodes(family, length):
    model = build(_config(family))
    layout = probe_layout(model)
    assert layout.unsupported is None, layout.unsupported
    kinds = [s.kind for s in layout.layers]
    if TABLE[family] is not None:
        assert kinds == TABLE[family]
    flat = {k for s in layout.layers for k in ([p.kind for p in s.parts] if s.kind is CacheKind.LIST else [s.kind])}
    assert {ARR, KV} <= flat, kinds  # both the recurrent / convolution state and attention's KV travel
    continues_like_one_node(model, layout, family, length)


def continues_like_one_node(model, layout, family: str, length: int) -> None:
    """Prefill a ``length``-token prompt, hand the cache through the wire, then 3 greedy decode steps: the
    copy gives the original's logits (float32, within 1e-4)."""
    prompt = tuple(int(t) for t in (mx.arange(1, length + 1) * 7 % 128).tolist())
    original = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=original))
    copy = through_the_wire(original, layout, prompt)
    assert [type(c).__name__ for c in copy] == [type(c).__name__ for c in original]
    token = mx.array([[5]])
    for step in range(3):
        want, got = model(token, cache=original), model(token, cache=copy)
        assert mx.allclose(want, got, atol=1e-4).item(), (family, length, step)
        token = mx.argmax(want[:, -1:], axis=-1)


# -- the last families mlx-lm distributes (issue 43): iquestloopcoder's two passes (a KVCache per layer, then a
# RotatingKVCache of loop_window_size per layer), muse_spark (sliding / full; its Metal kernels as CPU stand-ins)
LAST = {
    "iquestloopcoder": [KV] * 4 + [CacheKind.ROTATING] * 4,
    "muse_spark": [CacheKind.ROTATING, KV] * 2,
}


@pytest.mark.parametrize("family", list(LAST))
@pytest.mark.parametrize("length", [3, 11])
def test_the_last_families_handoff_continues_like_one_node(family, length):
    """Past the windows of 4 at 11 (iquestloopcoder's second pass, muse_spark's sliding layers): the imported
    caches decode as the originals."""
    from contextlib import nullcontext

    from tests.engine.muse_spark_cpu import cpu_kernels

    with cpu_kernels() if family == "muse_spark" else nullcontext():
        model = build(_config(family))
        model.set_dtype(mx.float32)
        layout = probe_layout(model)
        assert layout.unsupported is None, layout.unsupported
        assert [s.kind for s in layout.layers] == LAST[family]
        continues_like_one_node(model, layout, family, length)


@pytest.mark.parametrize("length", [1, 2, 7])
def test_longcat_flash_ngram_carries_its_n_gram_ids_and_continues_like_one_node(length):
    """Its embedding's cache keeps the last W = emb_neighbor_num - 1 ids as int64 (an ARRAY of dtype 5, the
    ARRAYS record's b = W): prompts shorter than, as long as and longer than the window travel and decode
    as the original (float32, within 1e-4); the support matrix says yes."""
    from mlxcel.commands.support import di_support
    from mlxcel.disagg.wire import DType

    config = _config("longcat_flash_ngram")
    model = build(config)
    model.set_dtype(mx.float32)
    layout = probe_layout(model)
    assert layout.unsupported is None, layout.unsupported
    window = config["emb_neighbor_num"] - 1
    assert layout.layers[0].max_size == window and layout.layers[0].arrays[0].dtype is DType.INT64
    prompt = tuple(int(t) for t in (mx.arange(1, length + 1) * 7 % 128).tolist())
    assert [t.shape for t in layout.layers[0].tensors(length)] == [(1, min(length, window))]
    original = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=original))
    copy = through_the_wire(original, layout, prompt)
    assert copy[0].state[0][0].dtype == mx.int64 and copy[0].state[0][0].tolist() == [list(prompt[-window:])]
    token = mx.array([[5]])
    for step in range(3):
        want, got = model(token, cache=original), model(token, cache=copy)
        assert mx.allclose(want, got, atol=1e-4).item(), (length, step)
        token = mx.argmax(want[:, -1:], axis=-1)
    assert di_support(config, probe=True).cell() == "yes (ArraysCache, CacheList)"
