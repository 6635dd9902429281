"""Which connection a prefill node's next KV handoff travels on (docs/disagg.md §4, "Lanes").

A handoff is one large stream. On one connection, the handoffs of concurrent requests to a decode
node queue behind each other: one socket, one reader thread and one AEAD context per direction. The
prefill node spreads them over a few *lanes* (pooled connections of the transport, ``pool.py``),
each handoff whole on the least busy lane, so their copies and crypto run side by side on hosts with
the cores for it; a handoff of ``split_min_bytes()`` or more (16 MiB) is split over every lane instead
(docs/disagg.md §4.9), so one large handoff's crypto runs on several cores too. The decode node sees more
authenticated connections from the same identity, and keys streams by (sender, stream id) as before.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from mlxcel.cluster.aead_pipeline import usable_cores
from mlxcel import envs
from mlxcel.disagg.wire import DEFAULT_SPLIT_MIN_BYTES

def split_min_bytes() -> int:
    """Tensor bytes from which a handoff is split over every lane (MLXCEL_HANDOFF_SPLIT_MIN_BYTES; 16 MiB)."""
    value = envs.settings().handoff_split_min_bytes
    return DEFAULT_SPLIT_MIN_BYTES if value is None else int(value)


def default_lanes(cores: int | None = None) -> int:
    """1 below 4 usable cores, else a quarter of them, at most 4 (MLXCEL_HANDOFF_LANES overrides, 1..16)."""
    value = envs.settings().handoff_lanes
    if value is not None:
        return int(value)
    cores = usable_cores() if cores is None else cores
    return 1 if cores < 4 else min(4, cores // 4)


class LanePicker:
    """The least busy of ``count`` lanes, held while a handoff is in flight (thread-safe)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"a prefill node needs at least one lane, not {count}")
        self._busy = [0] * count
        self._taken = [0] * count
        self._lock = threading.Lock()

    def busy(self) -> tuple[int, ...]:
        """Handoffs in flight per lane."""
        with self._lock:
            return tuple(self._busy)

    def taken(self) -> tuple[int, ...]:
        """Handoffs started per lane since the node started."""
        with self._lock:
            return tuple(self._taken)

    @contextlib.contextmanager
    def take(self) -> Iterator[int]:
        """The lane to send on (the lowest-numbered of the least busy), released when the block ends."""
        with self._lock:
            lane = min(range(len(self._busy)), key=self._busy.__getitem__)
            self._busy[lane] += 1
            self._taken[lane] += 1
        try:
            yield lane
        finally:
            with self._lock:
                self._busy[lane] -= 1
