"""longcat_flash_ngram over real roles (issue 43): router -> prefill -> decode on loopback transports
(handshake, AES-GCM), its n-gram embedding's int64 id window handed off as an ARRAY of dtype 5, gives a
single node's greedy tokens for prompts shorter and longer than the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.disagg.wire import CacheKind, DType
from tests.disagg.conftest import _model_checkpoint
from tests.disagg.test_kv_records_dsv41 import one_at_a_time


@pytest.fixture(scope="module")
def tiny_longcat_ngram(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxcel.commands.support import family_config

    config = family_config("longcat_flash_ngram")
    assert config is not None and config["emb_neighbor_num"] == 3  # a window of W = 2 ids
    return _model_checkpoint(tmp_path_factory, "tiny-longcat-ngram", config, 11)


@pytest.mark.proc  # loading a checkpoint runs ldconfig (tests/proc_marker.py)
def test_router_prefill_decode_continue_exactly_like_one_node(tiny_longcat_ngram):
    import asyncio

    from mlxcel.engine.executor import LocalExecutor
    from mlxcel.engine.scheduler import Scheduler
    from mlxcel.models.loading import load_checkpoint
    from tests.disagg.test_families import role_services

    prompts = [(41,), tuple(range(40, 47))]  # shorter than the window of 2, and longer
    loaded = load_checkpoint(tiny_longcat_ngram)
    single = Scheduler(LocalExecutor(loaded.model, max_batch_size=1), loaded.tokenizer, context_length=2048,
                       parallel=1, warmup=False).start()
    try:
        reference = asyncio.run(one_at_a_time(single, prompts))
        assert all(len(tokens) >= 2 for tokens in reference), reference  # the decode node made some of them
    finally:
        single.close()
    with role_services(tiny_longcat_ngram) as (router, prefill, decode):
        first = decode.layout.layers[0]
        assert first.kind is CacheKind.ARRAYS and first.max_size == 2 and first.arrays[0].dtype is DType.INT64
        assert prefill.layout == decode.layout and decode.layout.unsupported is None
        assert asyncio.run(one_at_a_time(router, prompts)) == reference
        assert decode.counters["handoffs"] == 2
