"""A stage that stays down is handed to a spare (docs/bringup.md §5.6, docs/pipeline.md §5.7).

``Takeover.tick`` runs on the coordinator's timer thread: a stage the monitor has seen go down and that
has stayed down ``replacer.after_s`` seconds gets one takeover thread, which asks the replacer (the
``--pp-auto`` coordinator's ``SparePool``) for a spare and, when one took the stage's layers, swaps the
stage's address in the executor (``PipelineExecutor.move_stage``: the neighbours are told with
RELOCATE first). Requests waiting to resume go on once the spare answers GET_STATE as that stage. A
stage no spare took stays down: its requests fail with 503 as without spares. No MLX, no sockets here.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from mlxcel.cluster.identity import PeerId

if TYPE_CHECKING:
    from mlxcel.pipeline.coordinator import PipelineExecutor

log = logging.getLogger("mlxcel.pipeline.coordinator")


class StageReplacer(Protocol):
    """Who can give a stage's layers to another process: ``replace(node_id)`` blocks, returns its address."""

    after_s: float  # a stage down this long is replaced

    def replace(self, node_id: str) -> PeerId | None: ...

    def status(self) -> list[dict[str, Any]]: ...


class Takeover:
    """Watches the executor's down stages; at most one takeover at a time (spares are tried in order)."""

    def __init__(self, executor: PipelineExecutor, replacer: StageReplacer) -> None:
        self.executor, self.replacer = executor, replacer
        self._lock = threading.Lock()
        self._running: threading.Thread | None = None
        self._given_up: set[PeerId] = set()  # no spare took it: not retried (it may still come back by itself)

    def tick(self, now: float) -> None:
        """Start a takeover for the first stage down past the bound (timer thread)."""
        with self._lock:
            if self._running is not None and self._running.is_alive():
                return
            addr = self._due(now)
            if addr is None:
                return
            self._running = threading.Thread(target=self._take_over, args=(addr,), name="mlxcel-takeover", daemon=True)
            self._running.start()

    def _due(self, now: float) -> PeerId | None:
        monitor = self.executor.monitor
        for addr in monitor.down():
            status = monitor.status.get(addr)
            if status is None or addr in self._given_up or status.last_down <= 0:
                continue  # never seen up (a spare loading its slice) or already given up
            if now - status.last_down >= self.replacer.after_s:
                return addr
        return None

    def _take_over(self, addr: PeerId) -> None:
        node = self.executor.node_at(addr)
        if node is None:
            return
        log.warning("pipeline stage %s at %s has been down for %gs; assigning its layers to a spare",
                    node.id, addr, self.replacer.after_s)
        try:
            spare = self.replacer.replace(node.id)
        except Exception:  # noqa: BLE001 - a failed takeover leaves the stage down, never the coordinator
            log.exception("taking over stage %s failed", node.id)
            spare = None
        if spare is None:
            self._given_up.add(addr)
            return
        self.executor.move_stage(addr, spare)
