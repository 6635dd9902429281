"""MLX arrays <-> the stage protocol's raw tensors (bfloat16 travels as its 16 bits)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.pipeline.protocol import wire_dtype


def to_wire(x: mx.array) -> tuple[str, np.ndarray]:
    """(wire dtype, numpy array) for a float MLX array."""
    dtype = wire_dtype(x.dtype)
    if dtype == "bfloat16":
        return dtype, np.array(x.view(mx.uint16), copy=False)
    return dtype, np.array(x, copy=False)


def from_wire(dtype: str, arr: np.ndarray) -> mx.array:
    """An MLX array from a decoded tensor (copied out of the message buffer)."""
    x = mx.array(arr)
    return x.view(mx.bfloat16) if dtype == "bfloat16" else x


def ids_to_wire(tokens: list[list[int]]) -> tuple[str, np.ndarray]:
    return "int32", np.asarray(tokens, dtype=np.int32)
