"""A stage that goes down is re-assigned to its restarted peer, or handed to a spare if it stays down
(docs/bringup.md §5.6 and §5.7, docs/pipeline.md §5.7).

``Takeover.tick`` runs on the coordinator's timer thread and starts at most one takeover thread at a
time. For a stage the monitor has seen go down, that thread first asks the replacer (the ``--pp-auto``
coordinator's ``SparePool``) to re-assign the stage to a peer waiting at the stage's own address (a
supervisor restarted it: same address, new process), at most every ``replacer.reassign_check_s``; the
re-assigned peer serves the stage at the same address, so nothing moves and the requests waiting to
resume go on once it answers GET_STATE. A stage down ``replacer.after_s`` seconds (counted again from
a re-assignment) is handed to a spare, if there is one: its neighbours are told with RELOCATE (again
whenever one of them restarts) and the executor swaps the stage's address
(``PipelineExecutor.move_stage``). A stage no spare took stays down: its requests fail with 503 as
without spares. No MLX here; the executor sends the commands.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol, Sequence

from mlxcel.cluster.identity import PeerId
from mlxcel.engine.executor import ExecutorError
from mlxcel.pipeline.protocol import MsgType
from mlxcel.cluster.health import PeerMonitor
from mlxcel.topology.cluster_config import ClusterConfig, Node

log = logging.getLogger("mlxcel.pipeline.coordinator")


class StageReplacer(Protocol):
    """Who can give a stage's layers to a process: ``replace(node_id)`` to a spare (blocks, returns its address),
    ``reassign(node_id)`` to a peer restarted at the stage's own address (blocks, True if it did)."""

    after_s: float  # a stage down this long is replaced
    reassign_check_s: float  # a down stage's own address is dialled at most this often
    has_spares: bool
    reassigned: dict[str, int]  # node id -> re-assignments

    def replace(self, node_id: str) -> PeerId | None: ...

    def reassign(self, node_id: str) -> bool: ...

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
        self._next_dial: dict[PeerId, float] = {}  # a down stage's address -> its next re-assignment dial
        self._reassigned: dict[PeerId, float] = {}  # -> when its restarted peer was re-assigned (restarts the clock)

    def tick(self, now: float) -> None:
        """Start a takeover for the first stage due a re-assignment dial or a spare (timer thread)."""
        with self._lock:
            if self._running is not None and self._running.is_alive():
                return
            addr = self._due(now)
            if addr is None:
                return
            self._running = threading.Thread(target=self._take_over, args=(addr, now), name="mlxcel-takeover",
                                             daemon=True)
            self._running.start()

    def _due(self, now: float) -> PeerId | None:
        for addr in self.executor.monitor.down():
            since = self._down_since(addr)
            if since is None:
                continue  # never seen up (a spare or a re-assigned peer loading its slice)
            if now >= self._next_dial.get(addr, 0.0) or self._spare_due(addr, now):
                return addr
        return None

    def _down_since(self, addr: PeerId) -> float | None:
        status = self.executor.monitor.status.get(addr)
        if status is None or status.up or status.last_down <= 0:
            return None
        return max(status.last_down, self._reassigned.get(addr, 0.0))

    def _spare_due(self, addr: PeerId, now: float) -> bool:
        since = self._down_since(addr)
        return (since is not None and self.replacer.has_spares and addr not in self._given_up
                and now - since >= self.replacer.after_s)

    def _take_over(self, addr: PeerId, now: float) -> None:
        node = self.executor.node_at(addr)
        if node is None:
            return
        if now >= self._next_dial.get(addr, 0.0):
            self._next_dial[addr] = now + self.replacer.reassign_check_s
            if self._reassign(node):
                self._reassigned[addr] = time.monotonic()
                return
        if self._spare_due(addr, time.monotonic()):
            self._to_spare(addr, node)

    def _reassign(self, node: Node) -> bool:
        """The stage's own address, dialled once: a restarted peer waiting there gets the stage back (same address:
        nothing moves; the monitor sees its new boot id once it answers)."""
        try:
            return self.replacer.reassign(node.id)
        except Exception:  # noqa: BLE001 - a failed re-assignment leaves the stage down, never the coordinator
            log.exception("re-assigning stage %s failed", node.id)
            return False

    def _to_spare(self, addr: PeerId, node: Node) -> None:
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
