"""Rows join and leave a batched KV cache without reading the device (mlxcel/engine/batch_rows.py).

Every row must read back exactly what it holds, through any sequence of joins, leaves and decode steps,
with the host-side padding equal to the device's; and a decode run whose rows
join and leave must never call mlx-lm's reading methods.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxcel.engine.batch_rows import extended_pads, extract_row, filter_rows, join_layer, merged_pads
from mlxcel.engine.executor import whole_model_runner
from mlxcel.engine.runner import RowSampler
from mlxcel.engine.sampling import SamplingParams


def one_row(length: int, seed: int) -> KVCache:
    cache = KVCache()
    mx.random.seed(seed)
    cache.update_and_fetch(mx.random.normal((1, 2, length, 4)), mx.random.normal((1, 2, length, 4)))
    return cache


def contents(cache: KVCache) -> tuple[mx.array, mx.array]:
    return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]


@pytest.mark.parametrize("seed", range(8))
def test_every_row_keeps_its_tokens_through_joins_leaves_and_decode_steps(seed):
    """A model of the batch: each row's own KV. After every join (lengths below and above the batch's write
    index), leave and decode step, each row reads back exactly, by ours and by mlx-lm's own ``extract``,
    the host padding is the device's, and every row ends at the write index."""
    rng = random.Random(seed)
    batch, pads, rows = None, None, []
    for step in range(14):
        if not rows or rng.random() < 0.5:
            joining = [one_row(rng.randint(1, 40), seed * 1000 + step * 10 + j) for j in range(rng.randint(1, 3))]
            rows += [contents(r) for r in joining]
            batch, pads = join_layer(batch, pads, joining, batched=batch is not None)
        elif len(rows) > 1:
            keep = sorted(rng.sample(range(len(rows)), rng.randint(1, len(rows) - 1)))
            pads = filter_rows(batch, keep, pads)
            rows = [rows[i] for i in keep]
        k = mx.random.normal((len(rows), 2, 1, 4))
        batch.update_and_fetch(k, k + 1)
        rows = [(mx.concatenate([a, k[i : i + 1]], axis=2), mx.concatenate([b, k[i : i + 1] + 1], axis=2))
                for i, (a, b) in enumerate(rows)]
        assert pads == batch.left_padding.tolist()
        assert [p + r[0].shape[2] for p, r in zip(pads, rows)] == [batch._idx] * len(rows)
        assert batch.offset.tolist() == [r[0].shape[2] for r in rows]
        for i, (keys, values) in enumerate(rows):
            for got in (extract_row(batch, i, pads), batch.extract(i)):
                assert mx.array_equal(got.keys, keys) and mx.array_equal(got.values, values)


def test_an_extension_through_mlx_lm_keeps_the_host_padding():
    theirs = KVCache.merge([one_row(3, 1), one_row(7, 2)])
    ours = KVCache.merge([one_row(3, 1), one_row(7, 2)])
    other = KVCache.merge([one_row(5, 3)])
    pads = extended_pads(ours, merged_pads([one_row(3, 1), one_row(7, 2)]), other, merged_pads([one_row(5, 3)]))
    theirs.extend(KVCache.merge([one_row(5, 3)]))
    ours.extend(other)
    assert pads == theirs.left_padding.tolist() == ours.left_padding.tolist()


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
