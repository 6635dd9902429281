"""Slices chained give the whole model's logits and greedy tokens: variants of llama, qwen2 and qwen3.

The variants (tied or not, sliding layers, 4-bit, mistral's model_type) are built from mlx-lm's
own classes with a tiny ModelArgs and random weights, or loaded from a ``make-random`` checkpoint,
then cut into 2 and 3 stages and decoded over KV caches next to the whole model. Every family in
``FAMILIES`` has its row in tests/engine/test_families.py; here, the refusal of the others.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from mlxcel.engine.generate import make_cache
from mlxcel.engine.model_slice import FAMILIES, Family, ModelSlice
from mlxcel.models.errors import ModelError
from mlxcel.models.loading import load_checkpoint
from mlxcel.topology.partition import StageCosts, layer_costs, plan_stages

VOCAB = 96
BASE = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "max_position_embeddings": 256,
        "rope_theta": 10000.0}
# name -> config for mlx-lm's classes (the table of every family is tests/engine/test_families.py)
TINY = {
    "llama": {"model_type": "llama", "num_hidden_layers": 6, "tie_word_embeddings": False},
    "llama-tied": {"model_type": "llama", "num_hidden_layers": 6, "tie_word_embeddings": True},
    "llama-sliding": {"model_type": "llama", "num_hidden_layers": 6, "tie_word_embeddings": False,
                      "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"] * 3},
    "llama-4bit": {"model_type": "llama", "num_hidden_layers": 6, "tie_word_embeddings": True, "quantize": 4},
    "mistral": {"model_type": "mistral", "num_hidden_layers": 6, "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "num_hidden_layers": 6, "tie_word_embeddings": True},
    "qwen2-untied": {"model_type": "qwen2", "num_hidden_layers": 6, "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", "num_hidden_layers": 6, "tie_word_embeddings": True},
    "qwen3-untied": {"model_type": "qwen3", "num_hidden_layers": 6, "tie_word_embeddings": False},
}


def tiny_model(name: str, seed: int = 0):
    config = {**BASE, **TINY[name]}
    bits = config.pop("quantize", None)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def test_every_variant_is_of_a_claimed_family():
    assert {_get_classes({**BASE, **c})[0].__module__.rsplit(".", 1)[1] for c in TINY.values()} <= set(FAMILIES)


def _nbytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def planned(model, stages: int, costs: StageCosts | None = None) -> list[tuple[int, int]]:
    """The engine's split (``plan_stages``), priced from a checkpoint's headers or the in-memory tensors."""
    if costs is None:
        inner, tied = model.model, not hasattr(model, "lm_head")
        embed = _nbytes(inner.embed_tokens)
        costs = StageCosts(model="tiny", layers=tuple(_nbytes(layer) for layer in inner.layers), embed=embed,
                           norm=_nbytes(inner.norm), head=embed if tied else _nbytes(model.lm_head), tied=tied)
    return [(s.start, s.end) for s in plan_stages(costs, stages)]


def run_slices(slices, caches, x):
    for piece, cache in zip(slices, caches):
        x = piece(x, cache)
    return x


def assert_pipeline_matches(model, ranges: list[tuple[int, int]], steps: int = 6) -> None:
    """Prefill 2 rows of 5 tokens, then greedy-decode ``steps`` tokens: same logits and tokens as the whole model."""
    assert len(ranges) >= 2 and ranges[0][0] == 0 and ranges[-1][1] == len(model.layers)
    slices = [ModelSlice(model, a, b) for a, b in ranges]
    caches = [s.make_cache() for s in slices]
    whole_cache = make_prompt_cache(model)
    assert [type(c) for cache in caches for c in cache] == [type(c) for c in whole_cache]
    x = mx.array([[5, 17, 90, 3, 42], [7, 7, 1, 60, 33]])
    whole_tokens, sliced_tokens = [], []
    for _ in range(steps + 1):
        expected = model(x, cache=whole_cache)
        got = run_slices(slices, caches, x)
        assert got.shape == expected.shape == (2, x.shape[1], model.args.vocab_size)
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-5)
        whole_tokens.append(mx.argmax(expected[:, -1], axis=-1))
        sliced_tokens.append(mx.argmax(got[:, -1], axis=-1))
        x = sliced_tokens[-1][:, None]
    assert np.array_equal(np.array(mx.stack(sliced_tokens)), np.array(mx.stack(whole_tokens)))
    assert all(c.offset == 5 + steps for cache in caches for c in cache)


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("stages", [2, 3])
def test_sliced_family_equals_whole_model(name, stages):
    model = tiny_model(name)
    assert_pipeline_matches(model, planned(model, stages))


def test_sliding_window_caches_wrap_and_still_match():
    model = tiny_model("llama-sliding")
    ranges = planned(model, 3)
    assert ranges == [(0, 2), (2, 4), (4, 6)]
    middle = ModelSlice(model, *ranges[1]).make_cache()
    assert [type(c) for c in middle] == [RotatingKVCache, type(middle[1])] and type(middle[1]) is not RotatingKVCache
    assert_pipeline_matches(model, ranges, steps=8)  # 13 positions through a window of 3


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("stages", [2, 3])
def test_make_random_checkpoints_slice_exactly(request, family, stages):
    path = request.getfixturevalue(family)
    loaded = load_checkpoint(path)
    assert_pipeline_matches(loaded.model, planned(loaded.model, stages, layer_costs(path)))


def test_generate_make_cache_dispatches_on_slices(tiny_llama):
    loaded = load_checkpoint(tiny_llama)
    piece = ModelSlice(loaded.model, 1, 3)
    assert len(make_cache(piece)) == 2 and len(make_cache(loaded.model)) == 4


def test_middle_slice_returns_hidden_states(tiny_llama):
    loaded = load_checkpoint(tiny_llama)
    first = ModelSlice(loaded.model, 0, 2)
    out = first(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, loaded.config["hidden_size"])
    assert first.is_first and not first.is_last and len(first.layers) == 2
    last = ModelSlice(loaded.model, 2, 4)
    assert last.is_last and not last.is_first
    assert last(out).shape == (1, 3, loaded.config["vocab_size"])


@pytest.mark.parametrize("start,end", [(-1, 2), (2, 2), (0, 5), (3, 1)])
def test_bad_layer_range_is_refused(tiny_llama, start, end):
    loaded = load_checkpoint(tiny_llama)
    with pytest.raises(ModelError, match="layer range"):
        ModelSlice(loaded.model, start, end)


def gemma2():
    from mlx_lm.models import gemma2 as g

    mx.random.seed(0)
    return g.Model(g.ModelArgs(model_type="gemma2", hidden_size=32, num_hidden_layers=4, intermediate_size=64,
                               num_attention_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=VOCAB,
                               num_key_value_heads=1))


def test_gemma2_slices_with_its_row_and_the_rule_alone_refuses_it():
    """gemma2 soft-caps its final logits and scales its embeddings: the rule refuses it by name, its row
    (scale, soft-cap, array masks) slices it into the whole model's logits."""
    from mlxcel.engine.slice_rule import rule_parts

    model = gemma2()
    with pytest.raises(ModelError) as info:
        rule_parts(model, "gemma2")
    assert str(info.value) == "model family 'gemma2' cannot be sliced into pipeline stages: it scales its embedding"
    x = mx.array([[1, 2, 3, 4, 5, 6]])
    got = ModelSlice(model, 2, 4)(ModelSlice(model, 0, 2)(x))
    np.testing.assert_allclose(np.array(got), np.array(model(x)), rtol=1e-5, atol=1e-5)


def gemma3_text():
    from mlx_lm.models import gemma3_text as g

    mx.random.seed(0)
    return g.Model(g.ModelArgs(model_type="gemma3_text", hidden_size=32, num_hidden_layers=4, intermediate_size=64,
                               num_attention_heads=2, head_dim=16, vocab_size=VOCAB, num_key_value_heads=1,
                               sliding_window=4, sliding_window_pattern=2))


def test_gemma3_needs_its_hooks():
    """Why hooks matter: the generic forward (no embedding scale, every layer full attention) is not gemma3's;
    with its row (sqrt(hidden) scale, sliding layers by absolute index) one slice is the whole model."""
    model = gemma3_text()
    x = mx.array([[1, 2, 3, 4, 5, 6]])  # longer than the window of 4
    real = np.array(model(x))
    whole = ModelSlice(model, 0, 4)
    assert whole.family is FAMILIES["gemma3_text"]
    np.testing.assert_allclose(np.array(whole(x)), real, rtol=1e-5, atol=1e-5)
    whole.family, whole.kinds = Family(), [None] * 4  # the generic hooks: every layer full attention
    assert not np.allclose(np.array(whole(x)), real, atol=1e-3)


def test_models_outside_mlx_lm_are_refused():
    class Model(nn.Module):
        model_type = "homebrew"

    with pytest.raises(ModelError, match="model family 'homebrew' cannot be sliced"):
        ModelSlice(Model(), 0, 1)


@pytest.mark.parametrize("switch, queued", [(None, True), ("1", True), ("0", False)])
def test_a_stage_queues_each_decode_layer_as_built_on_a_cpu(monkeypatch, switch, queued):
    """``MLXCEL_LAYER_OVERLAP`` (unset: on a CPU): a stage's decode step queues every layer's output with
    ``mx.async_eval`` as it is built, a prompt chunk none; the tokens are the whole model's either way."""
    from mlxcel import envs
    from mlxcel.engine.executor import slice_runner

    if switch is None:
        monkeypatch.delenv("MLXCEL_LAYER_OVERLAP", raising=False)
    else:
        monkeypatch.setenv("MLXCEL_LAYER_OVERLAP", switch)
    envs.reload()
    model = tiny_model("llama")
    ranges = planned(model, 2)
    runners = [slice_runner(model, a, b, max_rows=2) for a, b in ranges]
    queued_now: list[int] = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: (queued_now.append(1), real(*a))[1])
    caches = [r._make_cache() for r in runners]
    whole = make_prompt_cache(model)
    x = mx.array([[5, 17, 90, 3, 42]])
    for step in range(4):
        queued_now.clear()
        got = x
        for r, c in zip(runners, caches):
            got = r.forward(got, c)
        expected = model(x, cache=whole)
        np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-5, atol=1e-5)
        layers = len(model.layers) if queued and step > 0 else 0  # the prompt (step 0) is never split
        assert len(queued_now) == layers
        x = mx.argmax(got[:, -1], axis=-1)[:, None]
    envs.reload()
