"""A stage that stays down is handed to a spare (docs/bringup.md §5.6, docs/pipeline.md §5.7).

``Takeover.tick`` runs on the coordinator's timer thread: a stage the monitor has seen go down and that
has stayed down ``replacer.after_s`` seconds gets one takeover thread, which asks the replacer (the
``--pp-auto`` coordinator's ``SparePool``) for a spare. When one took the stage's layers, the stage's
neighbours are told with RELOCATE (again whenever one of them restarts) and the executor swaps the
stage's address (``PipelineExecutor.move_stage``). Requests waiting to resume go on once the spare
answers GET_STATE as that stage. A stage no spare took stays down: its requests fail with 503 as
without spares. No MLX here; the executor sends the commands.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol, Sequence

from mlxcel.cluster.identity import PeerId
from mlxcel.engine.executor import ExecutorError
from mlxcel.pipeline.protocol import MsgType
from mlxcel.cluster.health import PeerMonitor
from mlxcel.topology.cluster_config import ClusterConfig, Node

log = logging.getLogger("mlxcel.pipeline.coordinator")


class StageReplacer(Protocol):
    """Who can give a stage's layers to another process: ``replace(node_id)`` blocks, returns its address."""

    after_s: float  # a stage down this long is replaced

    def replace(self, node_id: str) -> PeerId | None: ...

    def status(self) -> list[dict[str, Any]]: ...


class StageMover(Protocol):
    """What a takeover needs of the coordinator's executor (``PipelineExecutor``)."""

    monitor: PeerMonitor
    cluster: ClusterConfig

    def node_at(self, addr: PeerId) -> Node | None: ...

    def move_stage(self, old: PeerId, new: PeerId) -> None: ...

    def command(self, stage: PeerId, mtype: MsgType, header: dict, timeout: float = ...) -> Any: ...


class Takeover:
    """Watches the executor's down stages; at most one takeover at a time (spares are tried in order)."""

    def __init__(self, executor: StageMover, replacer: StageReplacer) -> None:
        self.executor, self.replacer = executor, replacer
        self._lock = threading.Lock()
        self._running: threading.Thread | None = None
        self._given_up: set[PeerId] = set()  # no spare took it: not retried (it may still come back by itself)
        self._moved: dict[str, PeerId] = {}  # node id -> the address a spare serves it at

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
        self._moved[node.id] = spare
        for neighbour in neighbours(self.executor.cluster.stages, node.id):
            self._relocate(neighbour, node.id, spare)  # before any step can reach the new process
        self.executor.move_stage(addr, spare)

    def restarted(self, node: Node) -> None:
        """A stage that restarted read its own cluster TOML again: tell it where its moved neighbours are."""
        around = {n.id for n in neighbours(self.executor.cluster.stages, node.id)}
        for node_id, address in self._moved.items():
            if node_id in around:
                threading.Thread(target=self._relocate, args=(node, node_id, address), daemon=True,
                                 name="mlxcel-relocate").start()

    def _relocate(self, stage: Node, node_id: str, address: PeerId) -> None:
        """RELOCATE on one stage, waited for (a neighbour that does not answer is down: it is told when it is back)."""
        try:
            self.executor.command(stage.address, MsgType.RELOCATE, {"node_id": node_id, "address": str(address)})
        except ExecutorError as exc:
            log.warning("stage %s did not confirm that %s moved to %s: %s", stage.id, node_id, address, exc)


def neighbours(stages: Sequence[Node], node_id: str) -> list[Node]:
    """The stages before and after ``node_id`` (one at either end of the pipeline)."""
    i = next(k for k, n in enumerate(stages) if n.id == node_id)
    return [stages[k] for k in (i - 1, i + 1) if 0 <= k < len(stages)]
