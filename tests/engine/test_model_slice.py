"""Slices chained give the whole model's logits, with and without a KV cache."""

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.engine.generate import make_cache
from mlxcel.engine.model_slice import ModelSlice, split_layers
from mlxcel.models.errors import ModelError
from mlxcel.models.loading import load_checkpoint


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("stages", [2, 3])
def test_chained_slices_equal_whole_model(request, family, stages):
    loaded = load_checkpoint(request.getfixturevalue(family))
    model = loaded.model
    tokens = mx.array([[5, 17, 99, 3, 42, 7]])
    whole = model(tokens)
    slices = [ModelSlice(model, a, b) for a, b in split_layers(loaded.num_layers, stages)]
    h = tokens
    for s in slices:
        h = s(h)
    assert h.shape == whole.shape
    np.testing.assert_allclose(np.array(h), np.array(whole), rtol=1e-5, atol=1e-5)


def test_chained_slices_with_cache_match_incremental_decode(tiny_llama):
    loaded = load_checkpoint(tiny_llama)
    model = loaded.model
    slices = [ModelSlice(model, a, b) for a, b in split_layers(loaded.num_layers, 2)]
    caches = [s.make_cache() for s in slices]
    whole_cache = make_cache(model)
    prompt = mx.array([[1, 2, 3, 4]])

    def run_slices(x):
        for s, c in zip(slices, caches):
            x = s(x, c)
        return x

    np.testing.assert_allclose(np.array(run_slices(prompt)), np.array(model(prompt, cache=whole_cache)), atol=1e-5)
    step = mx.array([[9]])
    np.testing.assert_allclose(np.array(run_slices(step)), np.array(model(step, cache=whole_cache)), atol=1e-5)
    assert all(c.offset == 5 for cache in caches for c in cache)


def test_middle_slice_returns_hidden_states(tiny_llama):
    loaded = load_checkpoint(tiny_llama)
    first = ModelSlice(loaded.model, 0, 2)
    out = first(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, loaded.config["hidden_size"])
    assert first.is_first and not first.is_last


@pytest.mark.parametrize("start,end", [(-1, 2), (2, 2), (0, 5), (3, 1)])
def test_bad_layer_range_is_refused(tiny_llama, start, end):
    loaded = load_checkpoint(tiny_llama)
    with pytest.raises(ModelError, match="layer range"):
        ModelSlice(loaded.model, start, end)


def test_split_layers_is_contiguous_and_complete():
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError):
        split_layers(3, 4)
