"""Families whose caches cannot join a batch decode one row at a time, and every request still completes.

llama4 keeps a ``ChunkedKVCache`` in its chunked-attention layers and deepseek_v41 its own ``LayerCache``:
mlx-lm gives neither a ``merge``, so a decode step of two rows would fail. The executor reads that from the
model's own caches at load time, caps its decode batch at one row and says why (log, /health, models info);
the other requests wait their turn. A family whose caches merge keeps batching.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.sampling import SamplingParams
from tests.engine.fakes import collect_tokens

PROMPTS = [(40, 41, 42, 43, 44), (50, 51, 52), (60, 61, 62, 63, 64, 65, 66)]
N = 5
ONE_ROW = "one row at a time (ChunkedKVCache has no merge)"


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory):
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    path = make_random_checkpoint(tmp_path_factory.mktemp("tiny-llama4"), family="llama4", layers=4)
    return path, load_checkpoint(path)


def serve(loaded, prompts, *, batch: int):
    """Greedy tokens of ``prompts`` submitted together to one scheduler (``batch`` rows asked for); and it."""
    from mlxcel.engine.executor import LocalExecutor
    from mlxcel.engine.scheduler import Scheduler

    executor = LocalExecutor(loaded.model, max_batch_size=batch)
    sched = Scheduler(executor, loaded.tokenizer, context_length=512, parallel=batch, warmup=False).start()

    async def main():
        streams = [sched.submit(EngineRequest(p, SamplingParams(max_tokens=N), ignore_eos=True, request_id=f"r{i}"))
                   for i, p in enumerate(prompts)]
        return await asyncio.gather(*(collect_tokens(s) for s in streams))

    try:
        return asyncio.run(main()), sched
    finally:
        sched.close()


def test_concurrent_requests_on_llama4_complete_one_row_at_a_time(llama4, caplog):
    _, loaded = llama4
    alone = [serve(loaded, [p], batch=1)[0][0] for p in PROMPTS]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlxcel.engine"):
        together, sched = serve(loaded, PROMPTS, batch=3)
    assert together == alone and all(len(t) == N for t in together)
    assert sched.max_batch_size == 1 and sched.counters.max_rows == 1 and sched.counters.shared_steps == 0
    assert sched.health() == {"status": "ok", "batching": ONE_ROW}
    said = [r.getMessage() for r in caplog.records if "merge" in r.getMessage()]
    assert said == ["llama4's layer 0 keeps a ChunkedKVCache, which mlx-lm cannot merge into a batch: "
                    "one sequence decodes at a time"]


def test_a_family_whose_caches_merge_keeps_batching(tiny_llama):
    from mlxcel.models.loading import load_checkpoint

    _, sched = serve(load_checkpoint(tiny_llama), PROMPTS, batch=3)
    assert sched.max_batch_size == 3 and sched.counters.max_rows > 1
    assert sched.health() == {"status": "ok"}


def test_unmergeable_finds_the_first_layer_that_cannot_merge_also_inside_a_cache_list():
    from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, \
        RotatingKVCache

    from mlxcel.engine.batch_rows import unmergeable

    assert unmergeable([KVCache(), RotatingKVCache(4), ArraysCache(2), QuantizedKVCache(), CacheList(KVCache())]) \
        is None
    assert unmergeable([KVCache(), CacheList(KVCache(), ChunkedKVCache(4))]) == (1, "ChunkedKVCache")
    assert unmergeable([ChunkedKVCache(4), KVCache()]) == (0, "ChunkedKVCache")


def test_deepseek_v41_decodes_one_row_at_a_time():
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.commands.support import _build, family_config
    from mlxcel.engine.batch_rows import one_row

    model = _build(family_config("deepseek_v41"))
    cap = one_row(model, make_prompt_cache(model))
    assert cap is not None and cap.batching == "one row at a time (LayerCache has no merge)"
    assert cap.reason == ("deepseek_v41's layer 0 keeps a LayerCache, which mlx-lm cannot merge into a batch: "
                          "one sequence decodes at a time")


def test_models_info_says_how_rows_batch(llama4, tiny_llama):
    from mlxcel.commands.support import describe_modes

    assert f"batching:    {ONE_ROW}" in describe_modes(llama4[0]).splitlines()
    assert "batching:    rows of many sequences in one decode step" in describe_modes(tiny_llama).splitlines()
