"""``InProcessPipeline.prefill``: the chunk rule, the software-pipelined order, the same cache as one pass."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel.config import PREFILL_STEP
from mlxcel.models.loading import load_checkpoint
from mlxcel.pipeline.inprocess import InProcessPipeline, prefill_chunks


@pytest.mark.parametrize("tokens,micro,sizes", [
    (10, 4, [3, 3, 2, 2]),  # M chunks as equal as possible, the first ones one token longer
    (8, 4, [2, 2, 2, 2]),
    (3, 4, [1, 1, 1]),  # fewer tokens than chunks: one token each
    (0, 4, []),
    (10, 1, [10]),
])
def test_chunk_rule(tokens, micro, sizes):
    assert prefill_chunks(tokens, micro) == sizes


def test_no_chunk_exceeds_the_prefill_step():
    got = prefill_chunks(2 * PREFILL_STEP + 1, 2)
    assert len(got) == 3 and sum(got) == 2 * PREFILL_STEP + 1 and max(got) <= PREFILL_STEP


class Recorder:
    """Wraps a slice: logs (stage, first position) per call, then runs it."""

    def __init__(self, stage: int, piece, log: list):
        self.stage, self.piece, self.log = stage, piece, log

    def __call__(self, x, cache):
        self.log.append((self.stage, cache[0].offset))
        return self.piece(x, cache)


def test_stage_0_runs_chunk_k_plus_1_while_stage_1_runs_chunk_k(tiny_llama):
    loaded = load_checkpoint(tiny_llama)
    pipe = InProcessPipeline(loaded.model, [(0, 2), (2, 4)], micro_batches=3)
    cache, log = pipe.make_cache(), []
    pipe.slices = [Recorder(i, s, log) for i, s in enumerate(pipe.slices)]
    pipe.prefill(mx.arange(9, dtype=mx.uint32) + 40, cache)
    # ticks: [s0 c0], [s1 c0, s0 c1], [s1 c1, s0 c2], [s1 c2] (chunk c starts at 3c)
    assert log == [(0, 0), (1, 0), (0, 3), (1, 3), (0, 6), (1, 6)]


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
def test_prefilled_cache_gives_the_whole_models_next_logits(request, family):
    loaded = load_checkpoint(request.getfixturevalue(family))
    prompt = mx.array([1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], dtype=mx.uint32)
    whole = loaded.model(prompt[None])[0, -1]
    pipe = InProcessPipeline(loaded.model, [(0, 1), (1, 3), (3, 4)], micro_batches=4)
    cache = pipe.make_cache()
    pipe.prefill(prompt[:-1], cache)
    assert [c.offset for c in cache] == [10] * 4
    piped = pipe(prompt[None, -1:], cache)[0, -1]
    assert mx.allclose(piped, whole, atol=1e-4).item()
