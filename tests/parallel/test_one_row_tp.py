"""Tensor parallelism's rank 0 caps its decode batch at one row where the model's caches cannot merge.

Rank 0's ``TPExecutor`` over a stand-in control channel (no followers: only its construction and health are
asked); the rows it plans are what every rank runs, so the followers never see more.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(60)


class Control:
    """The part of ``RankZeroControl`` rank 0's executor touches while starting and closing."""

    size = 2
    on_lost = None

    def broadcast(self, _: bytes) -> None:
        pass


def rank_zero(model):
    from mlxcel.parallel.executor import TPExecutor

    return TPExecutor(model, Control(), max_batch_size=4, prefix_cache_bytes=0, step_timeout=1.0,
                      on_fatal=lambda _: None)


def close(executor) -> None:
    executor.close()
    executor._ops.put((lambda: None, None))  # wakes the worker, which sees it stopped


@pytest.mark.parametrize("family,rows,batching", [
    ("llama4", 1, {"batching": "one row at a time (ChunkedKVCache has no merge)"}),
    ("llama", 4, {}),
])
def test_rank_zero_decodes_one_row_where_caches_cannot_merge(tmp_path, family, rows, batching):
    from mlxcel.models.loading import load_checkpoint
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    model = load_checkpoint(make_random_checkpoint(tmp_path / family, family=family, layers=4)).model
    executor = rank_zero(model)
    try:
        assert executor.micro_batch_size == rows
        assert executor.health() == {"status": "ok", **batching, "tp_size": 2}
    finally:
        close(executor)
