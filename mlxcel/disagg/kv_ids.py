"""The token ids a handoff's int64 arrays carry (docs/disagg.md §4.1, §4.3), sans-I/O.

An ARRAYS layer that keeps a window W (record b > 0) holds, in each of its int64 arrays, the last
min(P, W) token ids the model read (longcat_flash_ngram's n-gram context): the prompt's own last ids,
which the receiver has from the header. So no id a sender writes there is ever used: each such array
must equal the header's prompt tail, else the handoff is refused (BAD_TENSOR) before any of it reaches
the model.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from mlxcel.disagg.wire import CacheKind, DType


def id_window_mismatch(layers: Sequence[Any], prompt: Sequence[int], tensors: Sequence[np.ndarray]) -> str | None:
    """Why the received ``tensors`` (wire order) of ``layers`` (``LayerSpec``) are not the prompt's last
    token ids where an int64 window says they are; None when they are (or no layer keeps one)."""
    i, length = 0, len(prompt)
    for n, spec in enumerate(_flat(layers)):
        specs = spec.tensors(length)
        for k, t in enumerate(specs):
            if spec.kind is CacheKind.ARRAYS and spec.max_size and t.dtype is DType.INT64:
                want = np.asarray(prompt[length - t.shape[-1]:], dtype=np.int64)
                if not np.array_equal(tensors[i + k].reshape(-1, t.shape[-1]), np.broadcast_to(want, (
                        tensors[i + k].size // t.shape[-1], t.shape[-1]))):
                    return (f"cache {n}'s int64 array {k} is not the prompt's last {t.shape[-1]} token ids "
                            "(an n-gram window holds exactly those)")
        i += len(specs)
    return None


def _flat(layers: Sequence[Any]) -> list[Any]:
    """Every cache of ``layers`` in wire order: a LIST layer's caches in place of it."""
    return [p for s in layers for p in (s.parts if s.kind is CacheKind.LIST else (s,))]
