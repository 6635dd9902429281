"""Plan a zero-config cluster and render its TOML (docs/bringup.md §5).

Stage ids follow the lexicographic order of the peers' addresses (``str(PeerId)``): stage-0 is the
smallest. Layers come from the partitioner ``mlxcel plan`` uses (``plan_stages``), priced by
parameter bytes and layer kind (docs/pipeline.md, "Partition by cost") and capped by the memory each
peer reported. The body is deterministic: the same
checkpoint, peers, memories, name, control address and secret file give the same bytes, so the
coordinator's file is reproduced byte for byte by rerunning its command. The coordinator's and a
peer's file share the body and differ in their header comments.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from mlxcel.cluster.identity import PeerId
from mlxcel.topology.partition import StageCosts, format_range, human_bytes, plan_stages

from .wire import ASSIGNMENT_PROTOCOL_VERSION, COORDINATOR_NODE_ID


@dataclass(frozen=True)
class PlannedStage:
    """Stage ``index`` (node ``stage-<index>``) at ``address`` holds layers [start, end)."""

    index: int
    address: PeerId
    start: int
    end: int
    bytes: int
    memory: int

    @property
    def node_id(self) -> str:
        return f"stage-{self.index}"


@dataclass(frozen=True)
class ClusterPlan:
    """The cluster a --pp-auto coordinator assigns."""

    name: str
    coordinator: PeerId
    stages: tuple[PlannedStage, ...]
    secret_file: Path | None

    @property
    def memory(self) -> list[int]:
        return [s.memory for s in self.stages]

    def body(self) -> str:
        """The TOML body both the coordinator's and each peer's file carry."""
        lines = ["[cluster]", f"name = {_str(self.name)}", f"pipeline_parallel_size = {len(self.stages)}"]
        if self.secret_file is not None:
            lines.append(f"secret_file = {_str(str(self.secret_file))}")
        lines += ["", "[[nodes]]", f"id = {_str(COORDINATOR_NODE_ID)}", 'role = "coordinator"',
                  f"address = {_str(str(self.coordinator))}"]
        for s in self.stages:
            lines += ["", "[[nodes]]", f"id = {_str(s.node_id)}", 'role = "stage"', f"address = {_str(str(s.address))}",
                      f"layers = {_str(format_range(s.start, s.end))}",
                      f"# {human_bytes(s.bytes)} of parameters; the peer reported {human_bytes(s.memory)} of memory"]
        return "\n".join(lines) + "\n"


def _str(value: str) -> str:
    """A TOML basic string (escaped by tomli-w)."""
    return tomli_w.dumps({"v": value}).strip()[len("v = "):]


def order_peers(peers: list[PeerId]) -> list[PeerId]:
    """Stage order: the lexicographic order of the addresses as written (``ip:port``)."""
    return sorted(peers, key=str)


def plan_cluster(costs: StageCosts, *, name: str, coordinator: PeerId, memory: dict[PeerId, int],
                 secret_file: Path | None) -> ClusterPlan:
    """Stages in address order, layers by parameter bytes within each peer's memory
    (raises ``PartitionError`` naming the stage that cannot fit)."""
    peers = order_peers(list(memory))
    planned = plan_stages(costs, len(peers), [memory[p] for p in peers])
    stages = tuple(PlannedStage(s.index, p, s.start, s.end, s.bytes, memory[p]) for s, p in zip(planned, peers))
    return ClusterPlan(name, coordinator, stages, secret_file)


def offer_fields(plan: ClusterPlan, index: int, *, mlxcel: str, model_identity: str) -> dict:
    """The OFFER message's fields for stage ``index`` of ``plan`` (docs/bringup.md §3)."""
    stage = plan.stages[index]
    return {"mlxcel": mlxcel, "cluster": plan.name, "model_identity": model_identity, "stage": index,
            "stages": len(plan.stages), "node_id": stage.node_id, "layers": [stage.start, stage.end],
            "memory": plan.memory, "coordinator": str(plan.coordinator), "toml": plan.body()}


def coordinator_header(plan: ClusterPlan, version: str) -> str:
    n = len(plan.stages)
    return (f"# Cluster TOML planned by an mlxcel {version} --pp-auto {n} coordinator "
            f"(assignment protocol {ASSIGNMENT_PROTOCOL_VERSION}).\n"
            "# The coordinator's copy: rerunning the same command against the same peers rewrites it byte for byte.\n"
            "# Start a node from it: mlxcel-server -m <checkpoint> --distributed-config <this file> "
            "--node-id <coordinator|stage-i>\n\n")


def peer_header(node_id: str, coordinator: PeerId) -> str:
    return (f"# Cluster TOML received by --pp-peer {node_id} from the coordinator at {coordinator} "
            f"(assignment protocol {ASSIGNMENT_PROTOCOL_VERSION}).\n"
            "# The next assignment this peer commits overwrites it.\n"
            f"# Start this node from it: mlxcel-server -m <checkpoint> --distributed-config <this file> "
            f"--node-id {node_id}\n\n")


def stage_file(path: Path, text: str) -> Path:
    """Write ``text`` to a temporary file next to ``path`` (created with its directory); returns it.
    ``publish`` renames it into place; raises ``OSError``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def publish(staged: Path, path: Path) -> None:
    """Move a staged file into place (atomic on one filesystem)."""
    os.replace(staged, path)


def write_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    publish(stage_file(path, text), path)
