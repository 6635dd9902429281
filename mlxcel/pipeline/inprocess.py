"""In-process pipeline parallelism: a chain of model slices that behaves like one model.

``mlxcel generate --pp-size N`` runs the stages one after the other in this process. It produces
exactly the tokens of the whole model (the same layers, in the same order, on the same inputs)
and is the reference that the multi-process pipeline is compared with.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from mlxcel.engine.model_slice import ModelSlice


class InProcessPipeline:
    """Stages [start, end) of ``model`` chained; callable like an mlx-lm model."""

    def __init__(self, model: Any, ranges: Sequence[tuple[int, int]]):
        self.slices = [ModelSlice(model, start, end) for start, end in ranges]
        self._sizes = [end - start for start, end in ranges]

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


def stage_ranges(model_dir: Any, num_layers: int, pp_size: int, pp_layers: str | None) -> list[tuple[int, int]]:
    """Explicit ``--pp-layers`` (validated against the model) or a split by parameter bytes."""
    from mlxcel.topology.partition import layer_costs, parse_layer_ranges, plan_stages

    if pp_layers is not None:
        return parse_layer_ranges(pp_layers, num_layers)
    return [(s.start, s.end) for s in plan_stages(layer_costs(model_dir), pp_size)]
