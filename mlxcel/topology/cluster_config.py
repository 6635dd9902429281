"""The cluster TOML: who is in the cluster, where they listen, which layers each stage serves.

Schema (docs/pipeline.md has the commented example, ``examples/cluster-loopback.toml`` a file):

    [cluster]   name, pipeline_parallel_size, secret_file (a path; never the value)
    [pipeline]  micro_batch_size, max_batch_size, prefix_cache_mb, max_resumes, micro_batch_fill, kv_bits,
                kv_group_size
    [timeouts]  startup_s, exchange_s, heartbeat_s, resume_s
    [transport] max_connections, max_pending_handshakes, max_pending_handshakes_per_ip, handshake_timeout_s,
                max_reconnect_attempts, reconnect_base_delay_s (``transport_table``)
    [[nodes]]   id, role ("coordinator" | "stage" | "prefill" | "decode" | "router"), address ("ip:port"),
                layers ("a-b", stages only)

A cluster is a pipeline (one coordinator and its stages) or disaggregated (prefill, decode and router
nodes, each holding the whole model; docs/disagg.md), never both.

Every problem is a ``ClusterConfigError`` naming the file and the key.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcel import config as defaults
from mlxcel.cluster.errors import SecretError
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import secret_file_of
from mlxcel.topology.names import DISAGG_ROLES, NODE_ROLES, PIPELINE_ROLES
from mlxcel.topology.partition import PartitionError, check_contiguous, check_coverage, parse_range
from mlxcel.topology.transport_table import Overrides, parse_transport_table

if TYPE_CHECKING:
    from mlxcel.cluster.options import TransportOptions

_TOP_KEYS = {"cluster", "pipeline", "timeouts", "transport", "nodes"}
_CLUSTER_KEYS = {"name", "pipeline_parallel_size", "secret_file"}
_PIPELINE_KEYS = {"micro_batch_size", "max_batch_size", "prefix_cache_mb", "max_resumes", "micro_batch_fill",
                  "kv_bits", "kv_group_size"}
_TIMEOUT_KEYS = {"startup_s", "exchange_s", "heartbeat_s", "resume_s"}
_NODE_KEYS = {"id", "role", "address", "layers"}


class ClusterConfigError(ValueError):
    """The cluster TOML is unreadable or inconsistent; the message names the file and the key."""


@dataclass(frozen=True)
class Node:
    """One process of the cluster."""

    id: str
    role: str
    address: PeerId
    layers: tuple[int, int] | None = None  # [start, end) for stages, once known


@dataclass(frozen=True)
class Timeouts:
    startup_s: float = defaults.DEFAULT_STARTUP_S
    exchange_s: float = defaults.DEFAULT_EXCHANGE_S
    heartbeat_s: float = defaults.DEFAULT_HEARTBEAT_S
    resume_s: float = defaults.DEFAULT_RESUME_TIMEOUT_S  # a resumed request waits this long for its stages



@dataclass(frozen=True)
class ClusterConfig:
    """A loaded, validated cluster TOML."""

    path: Path
    name: str
    pipeline_parallel_size: int
    coordinator: Node | None  # None in a disaggregated cluster
    stages: tuple[Node, ...]
    secret_file: Path | None = None
    micro_batch_size: int | None = None
    max_batch_size: int = defaults.DEFAULT_PP_MAX_BATCH
    timeouts: Timeouts = field(default_factory=Timeouts)
    prefix_cache_mb: int = defaults.DEFAULT_PREFIX_CACHE_MB  # per stage, of its slice's KV; 0 = off
    disagg: tuple[Node, ...] = ()  # a disaggregated cluster's prefill, decode and router nodes, in file order
    max_resumes: int = defaults.DEFAULT_MAX_RESUMES  # per request, after a stage failure (docs/pipeline.md §5.6)
    micro_batch_fill: bool | None = None  # decode rows fill one micro-batch before the next; None: by device (§3.9)
    transport: Overrides = ()  # [transport]: TransportOptions fields the TOML sets (every node's transport)
    kv_bits: int | None = None  # every stage's quantized KV cache (--kv-bits; docs/pipeline.md §3.12); None: its flag's
    kv_group_size: int = defaults.DEFAULT_KV_GROUP_SIZE

    @property
    def nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in (self.coordinator, *self.stages, *self.disagg) if n is not None)

    def with_role(self, role: str) -> tuple[Node, ...]:
        """The nodes of one role, in file order."""
        return tuple(n for n in self.nodes if n.role == role)

    def node(self, node_id: str) -> Node:
        for node in self.nodes:
            if node.id == node_id:
                return node
        known = ", ".join(n.id for n in self.nodes)
        raise ClusterConfigError(f"{self.path}: no node with id {node_id!r} (nodes: {known})")

    def stage_index(self, node_id: str) -> int:
        for i, node in enumerate(self.stages):
            if node.id == node_id:
                return i
        raise ClusterConfigError(f"{self.path}: {node_id!r} is not a stage")

    def with_layers(self, ranges: list[tuple[int, int]]) -> "ClusterConfig":
        """The same cluster with every stage's layer range set."""
        stages = tuple(Node(n.id, n.role, n.address, r) for n, r in zip(self.stages, ranges))
        return replace(self, stages=stages)

    def with_resume(self, max_resumes: int | None, resume_s: float | None) -> "ClusterConfig":
        """The same cluster with the flags' resume bounds (``--max-resumes``, ``--resume-timeout``) where given."""
        timeouts = self.timeouts if resume_s is None else replace(self.timeouts, resume_s=resume_s)
        return replace(self, timeouts=timeouts, max_resumes=self.max_resumes if max_resumes is None else max_resumes)

    def check_layers(self, num_layers: int) -> None:
        """Stage ranges must be contiguous from 0 and cover every layer of the model."""
        ranges = [n.layers for n in self.stages]
        if all(r is None for r in ranges):
            return
        if any(r is None for r in ranges):
            raise ClusterConfigError(f"{self.path}: give layers for every stage or for none")
        source = f"{self.path}: stage layers"
        try:
            check_contiguous(ranges, source)  # type: ignore[arg-type]
            check_coverage(ranges, num_layers, source)  # type: ignore[arg-type]
        except PartitionError as exc:
            raise ClusterConfigError(str(exc)) from None

    def transport_options(self) -> TransportOptions:
        """The options of this node's cluster transport: the defaults with the TOML's [transport] keys."""
        from mlxcel.cluster.options import TransportOptions

        return TransportOptions(**dict(self.transport))

    def micro_batch(self, max_batch_size: int) -> int:
        """Rows per micro-batch: configured, else the running rows shared evenly by the stages."""
        if self.micro_batch_size:
            return self.micro_batch_size
        return max(1, math.ceil(max_batch_size / len(self.stages)))


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read and validate a cluster TOML; raises ``ClusterConfigError``."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ClusterConfigError(f"cannot read the cluster TOML {path}: {exc.strerror or type(exc).__name__}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ClusterConfigError(f"{path} is not valid TOML: {exc}") from None
    return parse_cluster_config(doc, path)


def parse_cluster_config(doc: dict[str, Any], path: Path) -> ClusterConfig:
    _no_unknown(doc, _TOP_KEYS, path, "the top level")
    cluster = _table(doc, "cluster", path)
    pipeline = _table(doc, "pipeline", path)
    timeouts = _table(doc, "timeouts", path)
    try:
        transport = parse_transport_table(_table(doc, "transport", path))
    except ValueError as exc:
        raise ClusterConfigError(f"{path}: {exc}") from None
    try:
        secret_file = secret_file_of(cluster, path)  # refuses a secret value before any other check
    except SecretError as exc:
        raise ClusterConfigError(str(exc)) from None
    _no_unknown(cluster, _CLUSTER_KEYS, path, "[cluster]")
    _no_unknown(pipeline, _PIPELINE_KEYS, path, "[pipeline]")
    _no_unknown(timeouts, _TIMEOUT_KEYS, path, "[timeouts]")
    name = cluster.get("name", defaults.DEFAULT_CLUSTER_NAME)
    if not isinstance(name, str) or not name.strip():
        raise ClusterConfigError(f"{path}: name under [cluster] must be a non-empty string")
    nodes = _nodes(doc, path)
    if any(n.role in DISAGG_ROLES for n in nodes):
        return replace(_disaggregated(nodes, cluster, path, name, secret_file, timeouts), transport=transport)
    coordinators = [n for n in nodes if n.role == "coordinator"]
    stages = tuple(n for n in nodes if n.role == "stage")
    if len(coordinators) != 1:
        raise ClusterConfigError(f"{path}: a pipeline cluster needs exactly one node with role = \"coordinator\", found {len(coordinators)}")
    if not stages:
        raise ClusterConfigError(f"{path}: no node with role = \"stage\"")
    size = cluster.get("pipeline_parallel_size", len(stages))
    if not _is_int(size) or size < 1:
        raise ClusterConfigError(f"{path}: pipeline_parallel_size under [cluster] must be a positive integer")
    if size != len(stages):
        raise ClusterConfigError(f"{path}: pipeline_parallel_size is {size} but {len(stages)} stage node(s) are listed")
    return ClusterConfig(
        path=path, name=name, pipeline_parallel_size=size, coordinator=coordinators[0], stages=stages,
        secret_file=secret_file,
        micro_batch_size=_micro_batch_size(pipeline, path),
        max_batch_size=_positive(pipeline, "max_batch_size", path, defaults.DEFAULT_PP_MAX_BATCH),
        timeouts=Timeouts(
            startup_s=_seconds(timeouts, "startup_s", path, defaults.DEFAULT_STARTUP_S),
            exchange_s=_seconds(timeouts, "exchange_s", path, defaults.DEFAULT_EXCHANGE_S),
            heartbeat_s=_seconds(timeouts, "heartbeat_s", path, defaults.DEFAULT_HEARTBEAT_S),
            resume_s=_resume_s(timeouts, path),
        ),
        prefix_cache_mb=_mebibytes(pipeline, "prefix_cache_mb", path, defaults.DEFAULT_PREFIX_CACHE_MB),
        max_resumes=_max_resumes(pipeline, path),
        micro_batch_fill=_flag(pipeline, "micro_batch_fill", path),
        transport=transport,
        **_kv_bits(pipeline, path),
    )


def _nodes(doc: dict[str, Any], path: Path) -> list[Node]:
    raw = doc.get("nodes")
    if not isinstance(raw, list) or not raw:
        raise ClusterConfigError(f"{path}: no [[nodes]] entries")
    nodes: list[Node] = []
    seen_ids: set[str] = set()
    seen_addr: set[PeerId] = set()
    for i, entry in enumerate(raw):
        where = f"{path}: [[nodes]] entry {i + 1}"
        if not isinstance(entry, dict):
            raise ClusterConfigError(f"{where} must be a table")
        _no_unknown(entry, _NODE_KEYS, path, f"[[nodes]] entry {i + 1}")
        node_id, role, address = entry.get("id"), entry.get("role"), entry.get("address")
        if not isinstance(node_id, str) or not node_id.strip():
            raise ClusterConfigError(f"{where}: id must be a non-empty string")
        if node_id in seen_ids:
            raise ClusterConfigError(f"{where}: duplicate id {node_id!r}")
        if role not in NODE_ROLES:
            raise ClusterConfigError(f"{where} ({node_id}): role must be one of {', '.join(NODE_ROLES)}, got {role!r}")
        try:
            peer = PeerId.parse(address)
        except ValueError:
            raise ClusterConfigError(f"{where} ({node_id}): address must be a numeric ip:port, got {address!r}") from None
        if peer in seen_addr:
            raise ClusterConfigError(f"{where} ({node_id}): address {peer} is used by another node")
        if peer.port == 0:
            raise ClusterConfigError(f"{where} ({node_id}): address {peer} needs a fixed port")
        if role in ("stage", "prefill", "decode") and peer.ip.is_unspecified:
            raise ClusterConfigError(f"{where} ({node_id}): a {role} node's address must be the IP its peers reach it "
                                     f"at, not {peer.host}")
        layers = _layers(entry, node_id, role, where)
        seen_ids.add(node_id)
        seen_addr.add(peer)
        nodes.append(Node(node_id, role, peer, layers))
    return nodes


def _disaggregated(nodes: list[Node], cluster: dict[str, Any], path: Path, name: str, secret_file: Path | None,
                   timeouts: dict[str, Any]) -> ClusterConfig:
    """A prefill/decode/router cluster: at least one node of each role, no pipeline role, no pipeline size."""
    mixed = [n.id for n in nodes if n.role in PIPELINE_ROLES]
    if mixed:
        raise ClusterConfigError(f"{path}: a cluster is a pipeline or disaggregated, not both: {', '.join(mixed)} "
                                 "cannot join prefill, decode and router nodes")
    for role in DISAGG_ROLES:
        if not any(n.role == role for n in nodes):
            raise ClusterConfigError(f"{path}: a disaggregated cluster needs at least one node with role = \"{role}\"")
    if "pipeline_parallel_size" in cluster:
        raise ClusterConfigError(f"{path}: pipeline_parallel_size under [cluster] is for pipelines; "
                                 "a disaggregated cluster has none")
    return ClusterConfig(
        path=path, name=name, pipeline_parallel_size=1, coordinator=None, stages=(), secret_file=secret_file,
        timeouts=Timeouts(
            startup_s=_seconds(timeouts, "startup_s", path, defaults.DEFAULT_STARTUP_S),
            exchange_s=_seconds(timeouts, "exchange_s", path, defaults.DEFAULT_EXCHANGE_S),
            heartbeat_s=_seconds(timeouts, "heartbeat_s", path, defaults.DEFAULT_HEARTBEAT_S),
            resume_s=_resume_s(timeouts, path),
        ),
        disagg=tuple(nodes),
    )


def _layers(entry: dict[str, Any], node_id: str, role: str, where: str) -> tuple[int, int] | None:
    text = entry.get("layers")
    if text is None:
        return None
    if role != "stage":
        raise ClusterConfigError(f"{where} ({node_id}): only stages have layers")
    try:
        return parse_range(text, f"{where} ({node_id}): layers")
    except PartitionError as exc:
        raise ClusterConfigError(str(exc)) from None


def _table(doc: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise ClusterConfigError(f"{path}: [{key}] must be a table")
    return value


def _no_unknown(table: dict[str, Any], known: set[str], path: Path, where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise ClusterConfigError(f"{path}: unknown key(s) {', '.join(unknown)} in {where} (known: {', '.join(sorted(known))})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(table: dict[str, Any], key: str, path: Path, default: Any) -> Any:
    value = table.get(key, default)
    if value is default:
        return value
    if not _is_int(value) or value < 1:
        raise ClusterConfigError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def _micro_batch_size(table: dict[str, Any], path: Path) -> int | None:
    """[pipeline] micro_batch_size: the bound of --pp-micro-batch-size (``config.check_micro_batch_size``)."""
    value = table.get("micro_batch_size")
    if value is None:
        return None
    try:
        return defaults.check_micro_batch_size(value)
    except ValueError:
        raise ClusterConfigError(f"{path}: micro_batch_size under [pipeline] must be an integer from 1 to "
                                 f"{defaults.MAX_PP_MICRO_BATCH_SIZE}, got {value!r}") from None


def _kv_bits(table: dict[str, Any], path: Path) -> dict[str, Any]:
    """[pipeline] kv_bits and kv_group_size (--kv-bits and --kv-group-size for every stage), bounded alike."""
    bits, group = table.get("kv_bits"), table.get("kv_group_size")
    if bits is not None and (not _is_int(bits) or bits not in defaults.KV_BITS):
        raise ClusterConfigError(f"{path}: kv_bits under [pipeline] must be one of "
                                 f"{', '.join(map(str, defaults.KV_BITS))}, got {bits!r}")
    if group is not None and (not _is_int(group) or group not in defaults.KV_GROUP_SIZES):
        raise ClusterConfigError(f"{path}: kv_group_size under [pipeline] must be one of "
                                 f"{', '.join(map(str, defaults.KV_GROUP_SIZES))}, got {group!r}")
    if group is not None and bits is None:
        raise ClusterConfigError(f"{path}: kv_group_size under [pipeline] needs kv_bits")
    return {"kv_bits": bits, "kv_group_size": group or defaults.DEFAULT_KV_GROUP_SIZE}


def _mebibytes(table: dict[str, Any], key: str, path: Path, default: int) -> int:
    value = table.get(key, default)
    if not _is_int(value) or value < 0:
        raise ClusterConfigError(f"{path}: {key} under [pipeline] must be an integer >= 0 (MiB; 0 = off), got {value!r}")
    return value


def _seconds(table: dict[str, Any], key: str, path: Path, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ClusterConfigError(f"{path}: {key} under [timeouts] must be a positive number of seconds, got {value!r}")
    return float(value)


def _flag(table: dict[str, Any], key: str, path: Path) -> bool | None:
    value = table.get(key)
    if value is not None and not isinstance(value, bool):
        raise ClusterConfigError(f"{path}: {key} under [pipeline] must be true or false, got {value!r}")
    return value


def _max_resumes(table: dict[str, Any], path: Path) -> int:
    value = table.get("max_resumes", defaults.DEFAULT_MAX_RESUMES)
    if not _is_int(value) or not 0 <= value <= defaults.MAX_RESUMES:
        raise ClusterConfigError(f"{path}: max_resumes under [pipeline] must be an integer from 0 to "
                                 f"{defaults.MAX_RESUMES}, got {value!r}")
    return value


def _resume_s(table: dict[str, Any], path: Path) -> float:
    value = _seconds(table, "resume_s", path, defaults.DEFAULT_RESUME_TIMEOUT_S)
    if value > defaults.MAX_RESUME_TIMEOUT_S:
        raise ClusterConfigError(f"{path}: resume_s under [timeouts] must be at most {defaults.MAX_RESUME_TIMEOUT_S:g}"
                                 f" seconds, got {value!r}")
    return value
