"""In-process pipeline parallelism: a chain of model slices that behaves like one model.

``mlxcel generate --pp-size N`` runs the stages one after the other in this process. It produces
exactly the tokens of the whole model (the same layers, in the same order, on the same inputs)
and is the reference that the multi-process pipeline is compared with.

With ``--pp-micro-batch-size M`` the prompt is prefilled in M chunks, software-pipelined: stage s
runs chunk k while stage s + 1 runs chunk k - 1, each stage on its own MLX stream, so the stages
overlap where the device runs two streams at once (docs/pipeline.md, "In-process pipeline").
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Sequence

import mlx.core as mx

from mlxcel.config import DEFAULT_PP_MICRO_BATCH_SIZE, PREFILL_STEP
from mlxcel.engine.model_slice import ModelSlice


def prefill_chunks(tokens: int, micro_batches: int, most: int = PREFILL_STEP) -> list[int]:
    """Chunk sizes for ``tokens`` prompt tokens: ``micro_batches`` chunks as equal as possible (the first
    ones one token longer), fewer if there are fewer tokens, more if a chunk would exceed ``most``."""
    count = min(tokens, max(micro_batches, -(-tokens // most)))
    if count == 0:
        return []
    q, r = divmod(tokens, count)
    return [q + 1] * r + [q] * (count - r)


class InProcessPipeline:
    """Stages [start, end) of ``model`` chained; callable like an mlx-lm model."""

    def __init__(self, model: Any, ranges: Sequence[tuple[int, int]],
                 micro_batches: int = DEFAULT_PP_MICRO_BATCH_SIZE):
        self.slices = [ModelSlice(model, start, end) for start, end in ranges]
        self._sizes = [piece.cache_count for piece in self.slices]  # each stage's share of the cache list
        self.micro_batches = micro_batches
        self._streams: list[Any] = []

    @property
    def layers(self) -> list:
        return [layer for s in self.slices for layer in s.layers]

    def make_cache(self) -> list:
        """One cache per layer, stage after stage (what mlx-lm's make_prompt_cache asks a model for)."""
        return [c for s in self.slices for c in s.make_cache()]

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        cache = cache if cache is not None else [None] * sum(self._sizes)
        x, offset = inputs, 0
        for piece, size in zip(self.slices, self._sizes):
            x = piece(x, cache[offset: offset + size])
            offset += size
        return x

    def prefill(self, tokens: mx.array, cache: list) -> None:
        """Fill ``cache`` with token ids ``tokens`` [n] in micro-batches (``prefill_chunks``): at tick t,
        stage s runs chunk t - s, so stage 0 computes chunk k + 1 while stage 1 computes chunk k."""
        bounds = list(accumulate([0] + prefill_chunks(tokens.size, self.micro_batches)))
        chunks = [tokens[None, a:b] for a, b in zip(bounds, bounds[1:])]
        offsets = list(accumulate([0] + self._sizes))
        caches = [cache[a:b] for a, b in zip(offsets, offsets[1:])]
        if not self._streams:
            self._streams = [mx.new_stream(mx.default_device()) for _ in self.slices]
        handoff: list[Any] = [None] * len(self.slices)  # handoff[s]: the chunk stage s runs next
        for tick in range(len(chunks) + len(self.slices) - 1):
            self._tick(tick, chunks, caches, handoff)
        mx.eval([c.state for c in cache])

    def _tick(self, tick: int, chunks: list, caches: list, handoff: list) -> None:
        """Queue every stage's chunk of this tick, downstream first (each takes what its upstream
        produced the tick before), then evaluate them together without waiting."""
        work: list[Any] = []
        for s in reversed(range(len(self.slices))):
            k = tick - s
            if not 0 <= k < len(chunks):
                continue
            with mx.stream(self._streams[s]):
                out = self.slices[s](chunks[k] if s == 0 else handoff[s], caches[s])
            if s + 1 < len(self.slices):  # the last stage's logits are not needed: only its cache
                handoff[s + 1] = out
                work.append(out)
            work.extend(c.state for c in caches[s])
        mx.async_eval(work)


def stage_ranges(model_dir: Any, num_layers: int, pp_size: int, pp_layers: str | None) -> list[tuple[int, int]]:
    """Explicit ``--pp-layers`` (validated against the model) or a split by parameter bytes."""
    from mlxcel.topology.partition import layer_costs, parse_layer_ranges, plan_stages

    if pp_layers is not None:
        return parse_layer_ranges(pp_layers, num_layers)
    return [(s.start, s.end) for s in plan_stages(layer_costs(model_dir), pp_size)]
