"""What every rank runs for a step: the same ``SliceRunner`` calls on its shard of the model.

Rank 0 (``TPExecutor``) and the followers (``follower``) call these in the same order with the same
arguments, so every rank evaluates the same collectives in the same order. Rank 0 runs the whole
model and samples; a follower runs the layers only (``model.model``): the final norm and LM head are
replicated, so their output would only repeat rank 0's work. A follower still evaluates exactly what
rank 0 evaluates inside the layers: an intermediate prompt chunk only its KV cache (which leaves the
last layer's two all-reduces out on every rank), any other step the last hidden state.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.engine.prefix_cache import MIN_PREFIX, PrefixCache
from mlxcel.engine.runner import RowSampler, Sampled, SliceRunner


class ShardRunner:
    """One rank's runner and prefix cache; ``head`` says whether this rank computes the LM head."""

    def __init__(self, model: Any, *, head: bool, max_rows: int, prefix_cache_bytes: int):
        self.model = model
        body = getattr(model, "model", None)
        if head or body is None:
            forward = lambda x, c: model(x, cache=c)  # noqa: E731
        else:
            forward = lambda x, c: body(x, cache=c)  # noqa: E731
        self.runner = SliceRunner(forward, lambda: make_prompt_cache(model), is_first=True, is_last=True,
                                  max_rows=max_rows)
        self.prefix = PrefixCache(prefix_cache_bytes)

    def lookup(self, prompt: Sequence[int], limit: int | None = None) -> tuple[list | None, int]:
        return self.prefix.lookup(prompt, limit=limit)

    def prepare(self, rid: str, row: RowSampler | None, cache: list | None, length: int) -> None:
        self.runner.prepare(rid, row, cache=cache, length=length)

    def run(self, kind: str, rids: list[str], tokens: list[list[int]], slot: int, sample: bool) -> list[Sampled] | None:
        with mx.stream(generation_stream):
            x = mx.array(tokens, dtype=mx.uint32)
            if kind == "prefill":
                return self.runner.prefill(rids[0], x, sample=sample)  # type: ignore[return-value]
            return self.runner.decode(slot, rids, x)  # type: ignore[return-value]

    def release(self, rid: str, tokens: Sequence[int] | None) -> None:
        if tokens is not None and self.prefix.max_bytes > 0:
            taken = self.runner.take_cache(rid)
            if taken is not None:
                cache, length = taken
                self.prefix.store(list(tokens)[:length], cache)
        self.runner.release(rid)

    def close(self) -> None:
        self.runner.release_all()
        mx.synchronize(generation_stream)


def agreed_prefix(counts: Sequence[int]) -> int:
    """The cached prefix every rank can start from: the shortest, or none when below the reuse minimum."""
    m = min(counts)
    return m if m >= MIN_PREFIX else 0
