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
