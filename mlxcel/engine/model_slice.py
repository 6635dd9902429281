"""A contiguous slice of a model: embedding? + layers[start:end] + final norm and head?

Pipeline stages (remote ones, or ``InProcessPipeline`` for ``mlxcel generate --pp-size``)
run one slice each; a single device runs mlx-lm's whole model, not a slice. Slices wrap
mlx-lm's modules without copying them.

A slice re-implements the part of a family's forward pass around its decoder
layers (embedding, attention masks, norm and head), so it is only right for
families whose forward it reproduces. Those are listed in ``FAMILIES`` by the
mlx-lm module that implements them (a checkpoint's ``model_type`` may map onto
one, e.g. mistral onto llama), each tested against the whole model. Any other
family is refused by name: gemma3, for one, scales its embeddings by
sqrt(hidden) and picks sliding layers by index, which a generic slice would
silently get wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlxcel.models.errors import ModelError

MLX_LM_MODELS = "mlx_lm.models."


@dataclass(frozen=True)
class Family:
    """How one mlx-lm family begins and ends its forward pass around the decoder layers."""

    embed: Callable[[Any, mx.array], mx.array]  # (model, token ids [B, L]) -> hidden states [B, L, D]
    head: Callable[[Any, mx.array], mx.array]  # (model, hidden states) -> logits (final norm included)
    window: Callable[[Any, Any], int | None]  # (model, layer) -> its sliding window, None for full attention


def _embed_tokens(model: Any, inputs: mx.array) -> mx.array:
    return model.model.embed_tokens(inputs)


def _norm_and_head(model: Any, h: mx.array) -> mx.array:
    """Final RMSNorm, then lm_head, or the embedding as the head when the checkpoint ties them."""
    h = model.model.norm(h)
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(h)
    return model.lm_head(h)


def _full_attention(model: Any, layer: Any) -> int | None:
    return None


def _llama_window(model: Any, layer: Any) -> int | None:
    """llama's layer_types may mark layers "sliding_attention" (TransformerBlock.use_sliding)."""
    return model.model.sliding_window if layer.use_sliding else None


# Keyed by the mlx-lm module (mlx_lm.models.<name>) whose Model the checkpoint loads into.
FAMILIES: dict[str, Family] = {
    "llama": Family(_embed_tokens, _norm_and_head, _llama_window),
    "qwen2": Family(_embed_tokens, _norm_and_head, _full_attention),
    "qwen3": Family(_embed_tokens, _norm_and_head, _full_attention),
}


def family_of(model: Any) -> Family:
    """The slicing hooks of ``model``'s family; ModelError naming the family when it is not supported."""
    module = type(model).__module__
    name = module[len(MLX_LM_MODELS):] if module.startswith(MLX_LM_MODELS) else None
    family = FAMILIES.get(name) if name is not None and type(model).__name__ == "Model" else None
    if family is None:
        kind = getattr(model, "model_type", None) or name or type(model).__name__
        raise ModelError(f"model family {kind!r} cannot be sliced into pipeline stages "
                         f"(supported: {', '.join(sorted(FAMILIES))})")
    return family


@dataclass
class ModelSlice:
    """Layers [start, end) of ``model``; the first slice embeds, the last applies norm and head."""

    model: Any
    start: int
    end: int
    family: Family = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.family = family_of(self.model)
        total = len(self.model.model.layers)
        if not 0 <= self.start < self.end <= total:
            raise ModelError(f"layer range {self.start}-{self.end - 1} is outside the model's 0-{total - 1}")

    @property
    def is_first(self) -> bool:
        return self.start == 0

    @property
    def is_last(self) -> bool:
        return self.end == len(self.model.model.layers)

    @property
    def layers(self) -> list:
        return self.model.model.layers[self.start:self.end]

    def make_cache(self) -> list:
        """One KV cache per layer of the slice, of the type the family asks for."""
        make = getattr(self.model, "make_cache", None)
        if make is not None:
            return make()[self.start:self.end]
        return [KVCache() for _ in self.layers]

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        """Token ids [B, L] (first slice) or hidden states [B, L, D] -> hidden states or logits."""
        h = self.family.embed(self.model, inputs) if self.is_first else inputs
        cache = cache if cache is not None else [None] * (self.end - self.start)
        masks: dict[int | None, Any] = {}
        for layer, layer_cache in zip(self.layers, cache):
            window = self.family.window(self.model, layer)
            if window not in masks:  # as mlx-lm: one mask per attention kind, from its first layer's cache
                masks[window] = create_attention_mask(h, layer_cache, window_size=window)
            h = layer(h, masks[window], cache=layer_cache)
        return self.family.head(self.model, h) if self.is_last else h

