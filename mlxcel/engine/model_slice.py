"""A contiguous slice of a model: embedding? + layers[start:end] + final norm and head?

Pipeline stages run one slice each; a single device runs the whole model as
the slice [0, num_layers). Slices wrap mlx-lm's modules without copying them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlxcel.models.errors import ModelError


def _inner(model: Any) -> Any:
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        kind = getattr(model, "model_type", type(model).__name__)
        raise ModelError(f"model family {kind!r} cannot be sliced into stages (no embed_tokens/layers/norm)")
    return inner


@dataclass
class ModelSlice:
    """Layers [start, end) of ``model``; the first slice embeds, the last applies norm and head."""

    model: Any
    start: int
    end: int

    def __post_init__(self) -> None:
        total = len(_inner(self.model).layers)
        if not 0 <= self.start < self.end <= total:
            raise ModelError(f"layer range {self.start}-{self.end - 1} is outside the model's 0-{total - 1}")

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == len(_inner(self.model).layers)

    @property
    def layers(self) -> list:
        return _inner(self.model).layers[self.start:self.end]

    def make_cache(self) -> list:
        """One KV cache per layer of the slice, of the type the family asks for."""
        make = getattr(self.model, "make_cache", None)
        if make is not None:
            return make()[self.start:self.end]
        return [KVCache() for _ in self.layers]

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        """Token ids [B, L] (first slice) or hidden states [B, L, D] -> hidden states or logits."""
        inner = _inner(self.model)
        h = inner.embed_tokens(inputs) if self.is_first else inputs
        cache = cache if cache is not None else [None] * (self.end - self.start)
        masks: dict[Any, Any] = {}
        for layer, layer_cache in zip(self.layers, cache):
            window = inner.sliding_window if getattr(layer, "use_sliding", False) else None
            if window not in masks:
                masks[window] = create_attention_mask(h, layer_cache, window_size=window)
            h = layer(h, masks[window], cache=layer_cache)
        if not self.is_last:
            return h
        h = inner.norm(h)
        head = getattr(self.model, "lm_head", None)
        return head(h) if head is not None else inner.embed_tokens.as_linear(h)


def split_layers(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Even contiguous [start, end) ranges, earlier stages taking the remainder."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges

