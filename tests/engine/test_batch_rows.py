"""Rows join and leave a batched KV cache without reading the device (mlxcel/engine/batch_rows.py).

The host-side padding must give exactly what mlx-lm's own ``filter``/``extract`` give (which read it
back from the device), through any sequence of merges, extensions and filters; and a decode run whose
rows join and leave must never call those reading methods.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxcel.engine.batch_rows import extended_pads, extract_row, filter_rows, merged_pads
from mlxcel.engine.executor import whole_model_runner
from mlxcel.engine.runner import RowSampler
from mlxcel.engine.sampling import SamplingParams


def one_row(length: int, seed: int) -> KVCache:
    cache = KVCache()
    mx.random.seed(seed)
    cache.update_and_fetch(mx.random.normal((1, 2, length, 4)), mx.random.normal((1, 2, length, 4)))
    return cache


def batch(lengths: list[int], seed: int) -> tuple[BatchKVCache, BatchKVCache, list[int]]:
    """Two identical merged caches of rows of ``lengths`` (one for mlx-lm's methods, one for ours), and the pads."""
    rows = [one_row(n, seed + i) for i, n in enumerate(lengths)]
    return KVCache.merge(rows), KVCache.merge(rows), merged_pads(rows)


def same(a: Any, b: Any) -> None:
    assert getattr(a, "_idx", None) == getattr(b, "_idx", None)
    offsets = [x.offset.tolist() if isinstance(x.offset, mx.array) else x.offset for x in (a, b)]
    assert offsets[0] == offsets[1]
    assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)


@pytest.mark.parametrize("seed", range(6))
def test_host_padding_tracks_mlx_lm_through_merges_extensions_and_filters(seed):
    rng = random.Random(seed)
    theirs, ours, pads = batch([rng.randint(1, 9) for _ in range(rng.randint(1, 4))], seed * 100)
    for step in range(12):
        if rng.random() < 0.5 or len(pads) == 1:  # rows join
            joining_t, joining_o, joining_pads = batch([rng.randint(1, 12) for _ in range(rng.randint(1, 3))],
                                                       seed * 100 + step * 10 + 50)
            pads = extended_pads(ours, pads, joining_o, joining_pads)
            theirs.extend(joining_t)
            ours.extend(joining_o)
        else:  # rows leave
            keep = sorted(rng.sample(range(len(pads)), rng.randint(1, len(pads) - 1)))
            theirs.filter(keep)
            pads = filter_rows(ours, keep, pads)
        if rng.random() < 0.5:  # a decode position for every row
            k = mx.random.normal((len(pads), 2, 1, 4))
            theirs.update_and_fetch(k, k)
            ours.update_and_fetch(k, k)
        assert pads == theirs.left_padding.tolist() == ours.left_padding.tolist()
        same(theirs, ours)
        for i in range(len(pads)):
            same(theirs.extract(i), extract_row(ours, i, pads))


def test_caches_without_host_padding_use_mlx_lm_methods():
    rows = [one_row(3, 1), one_row(5, 2)]
    assert merged_pads([rows[0], object()]) is None
    merged = KVCache.merge(rows)
    assert filter_rows(merged, [1], None) is None and merged.left_padding.tolist() == [0]
    assert extract_row(merged, 0, None).offset == 5


def test_rows_join_and_leave_a_decode_slot_without_reading_the_padding_back(tiny_llama, monkeypatch):
    from mlxcel.models.loading import load_checkpoint

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("mlx-lm's filter/extract read the padding back from the device")

    model = load_checkpoint(tiny_llama).model
    runner = whole_model_runner(model, max_rows=4)
    prompts = {"a": [5, 17, 90, 3, 42, 7], "b": [7, 7, 1], "c": [9, 8, 7, 6, 5, 4, 3, 2, 1]}
    last: dict[str, int] = {}
    for rid, prompt in prompts.items():
        runner.prepare(rid, RowSampler(SamplingParams()))
        last[rid] = runner.prefill(rid, mx.array([prompt]), sample=True)[0].token
    monkeypatch.setattr(BatchKVCache, "filter", refuse)
    monkeypatch.setattr(BatchKVCache, "extract", refuse)
    for rows in (["a"], ["a", "b"], ["a", "b", "c"], ["b", "c"], ["c"]):  # join, join, leave, leave
        got = runner.decode(0, rows, mx.array([[last[r]] for r in rows]))
        last.update({r: s.token for r, s in zip(rows, got)})
    cache, length = runner.take_cache("c")
    assert length == len(prompts["c"]) + 3  # three decode steps and cache[0].offset == length
