"""The ``[server]`` table of a node TOML: an ``mlxcel-server`` command line as plain fields.

The Ansible role writes what the node is (its model, address, files, bring-up); this module turns
that into the argv, in one fixed order::

    program -m model [cluster flags --cluster-secret-file F] --host H --port P
            [--api-key-file F] [--ssl-certfile C --ssl-keyfile K] [--threads N] args...

Schema::

    [server]
    program = "/venv/bin/mlxcel-server"
    model = "/models/smollm2"
    host = "127.0.0.3"
    port = 8080
    api_key_file = "api.key"               # optional
    ssl_certfile = "tls.crt"               # optional, with ssl_keyfile
    ssl_keyfile = "tls.key"
    threads = 2                            # optional: --threads
    args = ["--parallel", "8"]             # last, so they win
    [server.cluster]                       # optional: a cluster node (without it: a single-node server)
    secret_file = "cluster.secret"
    bringup = "toml"                       # toml: --distributed-config config --node-id node_id
    node_id = "stage-0"
    config = "cluster.toml"
    # bringup = "pp_auto": role "coordinator" gets --pp-auto len(peers) --cluster-peers a,b
    # [--pp-micro-batch-size N]; any other role --pp-peer; both --cluster-control-addr control_addr
    # --cluster-config-out config_out [--cluster-name name]
    role = "stage"
    peers = ["127.0.0.3:19000", "127.0.0.4:19000"]
    control_addr = "127.0.0.3:19000"
    config_out = "cluster-{node_id}.toml"
    name = "demo"                          # optional
    micro_batch_size = 4                   # optional, the coordinator's
    spares = ["127.0.0.5:19000"]           # optional, the coordinator's: after peers in --cluster-peers, --pp-spare K
    spare_after_s = 5                      # optional, with spares: --pp-spare-after S

Paths are passed as written (the server resolves them against the node's working directory).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxcel.node.errors import NodeSpecError

_SERVER_KEYS = {"program", "model", "host", "port", "api_key_file", "ssl_certfile", "ssl_keyfile", "threads", "args",
                "cluster"}
_CLUSTER_KEYS = {"secret_file", "bringup", "node_id", "config", "role", "peers", "control_addr", "config_out", "name",
                 "micro_batch_size", "spares", "spare_after_s"}
_SPARE_KEYS = ("spares", "spare_after_s")
BRINGUPS = ("toml", "pp_auto")


def server_command(server: Any, path: Path) -> tuple[str, ...]:
    """The argv that ``[server]`` of ``path`` describes."""
    table = _table(server, path, "[server]", _SERVER_KEYS)
    argv = [_text(table, "program", path, "[server]"), "-m", _text(table, "model", path, "[server]")]
    if "cluster" in table:
        argv += _cluster_flags(table["cluster"], path)
    argv += ["--host", _text(table, "host", path, "[server]"), "--port", str(_count(table, "port", path, "[server]"))]
    if "api_key_file" in table:
        argv += ["--api-key-file", _text(table, "api_key_file", path, "[server]")]
    if ("ssl_certfile" in table) != ("ssl_keyfile" in table):
        raise NodeSpecError(f"{path}: [server] ssl_certfile and ssl_keyfile go together")
    if "ssl_certfile" in table:
        argv += ["--ssl-certfile", _text(table, "ssl_certfile", path, "[server]"),
                 "--ssl-keyfile", _text(table, "ssl_keyfile", path, "[server]")]
    if "threads" in table:
        argv += ["--threads", str(_count(table, "threads", path, "[server]"))]
    return tuple(argv + _texts(table, "args", path, "[server]", allow_empty=True))


def server_match(server: dict[str, Any]) -> str:
    """The text of the command line that is this node: its own address and port."""
    return f"--host {server['host']} --port {server['port']}"


def _cluster_flags(cluster: Any, path: Path) -> list[str]:
    where = "[server.cluster]"
    table = _table(cluster, path, where, _CLUSTER_KEYS)
    bringup = _text(table, "bringup", path, where)
    if bringup not in BRINGUPS:
        raise NodeSpecError(f"{path}: {where} bringup must be one of {', '.join(BRINGUPS)}, got {bringup!r}")
    if bringup == "toml":
        if any(k in table for k in _SPARE_KEYS):
            raise NodeSpecError(f"{path}: {where} spares and spare_after_s need bringup pp_auto")
        flags = ["--distributed-config", _text(table, "config", path, where),
                 "--node-id", _text(table, "node_id", path, where)]
    else:
        flags = _pp_auto_flags(table, path, where)
    return flags + ["--cluster-secret-file", _text(table, "secret_file", path, where)]


def _pp_auto_flags(table: dict[str, Any], path: Path, where: str) -> list[str]:
    coordinator = _text(table, "role", path, where) == "coordinator"
    if coordinator:
        peers = _texts(table, "peers", path, where)
        flags = ["--pp-auto", str(len(peers)), "--cluster-peers", ",".join(peers + _spares(table, peers, path, where))]
        flags += _spare_flags(table, path, where)
    elif any(k in table for k in _SPARE_KEYS):
        raise NodeSpecError(f"{path}: {where} spares and spare_after_s are the coordinator's (role coordinator)")
    else:
        flags = ["--pp-peer"]
    flags += ["--cluster-control-addr", _text(table, "control_addr", path, where),
              "--cluster-config-out", _text(table, "config_out", path, where)]
    if "name" in table:
        flags += ["--cluster-name", _text(table, "name", path, where)]
    if coordinator and "micro_batch_size" in table:
        flags += ["--pp-micro-batch-size", str(_count(table, "micro_batch_size", path, where))]
    return flags


def _spares(table: dict[str, Any], peers: list[str], path: Path, where: str) -> list[str]:
    """The spare peers' addresses (after the stages' in --cluster-peers); none a stage's."""
    spares = _texts(table, "spares", path, where, allow_empty=True)
    both = sorted(set(spares) & set(peers))
    if both:
        raise NodeSpecError(f"{path}: {where} spares {', '.join(both)} also in peers (a host is a stage or a spare)")
    return spares


def _spare_flags(table: dict[str, Any], path: Path, where: str) -> list[str]:
    spares = table.get("spares", [])
    flags = ["--pp-spare", str(len(spares))] if spares else []
    if "spare_after_s" in table:
        after = table["spare_after_s"]
        if not spares:
            raise NodeSpecError(f"{path}: {where} spare_after_s needs spares (with no spare there is nothing to assign)")
        if isinstance(after, bool) or not isinstance(after, (int, float)) or after <= 0:
            raise NodeSpecError(f"{path}: {where} spare_after_s must be a positive number, got {after!r}")
        flags += ["--pp-spare-after", f"{after:g}"]
    return flags


def _table(value: Any, path: Path, where: str, known: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise NodeSpecError(f"{path}: {where} must be a table")
    unknown = sorted(set(value) - known)
    if unknown:
        raise NodeSpecError(f"{path}: unknown key(s) {', '.join(unknown)} in {where} (known: {', '.join(sorted(known))})")
    return value


def _text(table: dict[str, Any], key: str, path: Path, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value.strip():
        raise NodeSpecError(f"{path}: {where} {key} must be a non-empty string, got {value!r}")
    return value


def _texts(table: dict[str, Any], key: str, path: Path, where: str, allow_empty: bool = False) -> list[str]:
    value = table.get(key, [] if allow_empty else None)
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or (not value and not allow_empty):
        raise NodeSpecError(f"{path}: {where} {key} must be a list of non-empty strings, got {value!r}")
    return value


def _count(table: dict[str, Any], key: str, path: Path, where: str) -> int:
    value = table.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise NodeSpecError(f"{path}: {where} {key} must be a positive integer, got {value!r}")
    return value
