"""The dtype of the all-reduces: ``--tp-reduce-dtype``.

mlx-lm's ``shard()`` turns each layer's o_proj and down_proj into MLX's ``ShardedToAllLinear``
(or its quantized twin): a local product of 1/N of the input columns, then ``all_sum`` of the
partial outputs in the model's dtype. ``set_reduce_dtype`` swaps those layers for subclasses that
cast the partial output to another dtype before the ``all_sum`` and back after it, so a float32
model can reduce in bfloat16 (half the bytes, bfloat16 rounding of every layer's two outputs).
Everything else, weights included, stays as ``shard()`` left it.

Why not fewer all-reduces: llama/qwen layers are sequential (the MLP reads the norm of the residual
*after* the attention output is added), so each layer needs both sums before its next norm, and a
layer's MLP sum before the next layer's norm; neither can be merged or deferred without changing
the result (docs/tp.md, "Fewer or smaller collectives").
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.config import DEFAULT_TP_REDUCE_DTYPE, TP_REDUCE_DTYPES
from mlxcel.parallel.errors import TPError


def _sum(layer: Any, x: mx.array) -> mx.array:
    return mx.distributed.all_sum(x.astype(layer.reduce_dtype), group=layer.group).astype(x.dtype)


class CastShardedToAllLinear(nn.ShardedToAllLinear):
    """``ShardedToAllLinear`` whose all-reduce runs in ``reduce_dtype``."""

    reduce_dtype: mx.Dtype = mx.float32

    def __call__(self, x: mx.array) -> mx.array:
        x = _sum(self, x @ self["weight"].T)
        return x + self["bias"] if "bias" in self else x


class CastQuantizedShardedToAllLinear(nn.QuantizedShardedToAllLinear):
    """``QuantizedShardedToAllLinear`` whose all-reduce runs in ``reduce_dtype``."""

    reduce_dtype: mx.Dtype = mx.float32

    def __call__(self, x: mx.array) -> mx.array:
        x = mx.quantized_matmul(x, self["weight"], scales=self["scales"], biases=self.get("biases"), transpose=True,
                                group_size=self.group_size, bits=self.bits, mode=self.mode)
        x = _sum(self, x)
        return x + self["bias"] if "bias" in self else x


_CAST = {nn.ShardedToAllLinear: CastShardedToAllLinear, nn.QuantizedShardedToAllLinear: CastQuantizedShardedToAllLinear}


def reduced_layers(model: Any) -> list[tuple[Any, str]]:
    """(parent module, attribute) of every all-reducing linear layer ``shard()`` made, in layer order."""
    found = []
    for layer in model.layers:
        for parent, name in ((getattr(layer, "self_attn", None), "o_proj"), (getattr(layer, "mlp", None), "down_proj")):
            if isinstance(getattr(parent, name, None), tuple(_CAST)):
                found.append((parent, name))
    return found


def set_reduce_dtype(model: Any, name: str) -> int:
    """Make every all-reduce of a sharded ``model`` carry ``name`` ("model": leave them as they are).

    Returns the number of layers changed (0 when the dtype is the model's own).
    """
    if name not in TP_REDUCE_DTYPES:
        raise TPError(f"--tp-reduce-dtype {name!r} is not one of {', '.join(TP_REDUCE_DTYPES)}")
    if name == DEFAULT_TP_REDUCE_DTYPE:
        return 0
    dtype = getattr(mx, name)
    layers = reduced_layers(model)
    if not layers:
        raise TPError("--tp-reduce-dtype: the model has no sharded-to-all layers (shard it first)")
    changed = 0
    for parent, attr in layers:
        layer = getattr(parent, attr)
        if layer["weight"].dtype == dtype or (layer["weight"].dtype == mx.uint32 and layer["scales"].dtype == dtype):
            continue  # already the model's dtype: no cast
        cast = _CAST[type(layer)] if type(layer) in _CAST else type(layer)
        layer.__class__ = cast
        layer.reduce_dtype = dtype
        changed += 1
    return changed
