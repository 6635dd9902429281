"""The node TOML: what ``mlxcel node`` supervises (command line, environment, files, readiness).

Schema (every path relative to the TOML's own directory; the Ansible role renders it as
``mlxcel_home/node.toml``)::

    name = "stage-0"                       # in messages (default: the file's stem)
    command = ["/venv/bin/mlxcel-server", "--host", "127.0.0.3", "--port", "8080"]   # argv, no shell
    # or, instead of command, [server]: mlxcel-server's command line as plain fields (mlxcel/node/server.py)
    directory = "."                        # working directory (default: the TOML's directory)
    match = "--host 127.0.0.3 --port 8080" # text of the command line that is this node (default: the command;
                                           # with [server]: "--host <host> --port <port>")
    pidfile = "node.pid"                   # default: <stem>.pid
    log = "node.log"                       # stdout and stderr, appended (default: <stem>.log)
    inputs = ["cluster.toml", "cluster.secret"]   # files read at start-up: a change restarts the node
    stop_grace_s = 10                      # SIGTERM, then SIGKILL after this long
    [environment]                          # added to the supervisor's own environment
    OPENBLAS_NUM_THREADS = "1"
    [ready]                                # without url: running counts as ready
    url = "http://127.0.0.3:8080/health"   # ready when it answers 200
    timeout_s = 180
    [restart]                              # optional: how its supervisor restarts it (mlxcel/node/restart.py)
    policy = "on-failure"
    backoff_s = 0.5

Secrets go in as file paths only: the environment variables that carry a secret's value are refused.
Every problem is a ``NodeSpecError`` naming the file and the key.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel import config as defaults
from mlxcel.node.errors import NodeSpecError
from mlxcel.node.restart import POLICIES, RestartPolicy

_KEYS = {"name", "command", "server", "directory", "match", "pidfile", "log", "inputs", "stop_grace_s", "environment",
         "ready", "restart"}
_READY_KEYS = {"url", "timeout_s"}
_RESTART_KEYS = {"policy", "backoff_s", "backoff_max_s", "limit", "reset_s", "standby"}


@dataclass(frozen=True)
class NodeSpec:
    """One supervised process, as the node TOML describes it."""

    name: str
    command: tuple[str, ...]
    directory: Path
    match: str
    pidfile: Path
    log: Path
    inputs: tuple[Path, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    ready_url: str | None = None
    ready_timeout_s: float = defaults.DEFAULT_NODE_READY_TIMEOUT_S
    stop_grace_s: float = defaults.DEFAULT_NODE_STOP_GRACE_S
    restart: RestartPolicy = RestartPolicy()
    source: Path | None = field(default=None, compare=False)  # the node TOML itself (its supervisor reads it)

    @property
    def inputs_file(self) -> Path:
        """Where a start records the digests of what the node was started with."""
        return self.pidfile.with_name(self.pidfile.name + ".inputs")

    @property
    def state_file(self) -> Path:
        """Where the node's supervisor records itself, the node's pid, its restarts and how it last ended."""
        return self.pidfile.with_name(self.pidfile.name + ".state")


def load_node_spec(path: str | Path) -> NodeSpec:
    """Read and check a node TOML."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise NodeSpecError(f"{path}: not valid TOML: {exc}") from None
    return parse_node_spec(doc, path)


def parse_node_spec(doc: dict[str, Any], path: Path) -> NodeSpec:
    """A parsed node TOML -> NodeSpec; relative paths resolve against ``path``'s directory."""
    _no_unknown(doc, _KEYS, path, "the top level")
    base = path.resolve().parent
    command = _command(doc, path)
    ready = doc.get("ready", {})
    if not isinstance(ready, dict):
        raise NodeSpecError(f"{path}: [ready] must be a table")
    _no_unknown(ready, _READY_KEYS, path, "[ready]")
    return NodeSpec(
        name=_string(doc, "name", path, path.stem),
        command=command,
        directory=base / _string(doc, "directory", path, "."),
        match=_string(doc, "match", path, _default_match(doc, command)),
        pidfile=base / _string(doc, "pidfile", path, f"{path.stem}.pid"),
        log=base / _string(doc, "log", path, f"{path.stem}.log"),
        inputs=tuple(base / p for p in _strings(doc, "inputs", path)),
        environment=_environment(doc, path),
        ready_url=_url(ready, path),
        ready_timeout_s=_seconds(ready, "timeout_s", path, "[ready] timeout_s", defaults.DEFAULT_NODE_READY_TIMEOUT_S),
        stop_grace_s=_seconds(doc, "stop_grace_s", path, "stop_grace_s", defaults.DEFAULT_NODE_STOP_GRACE_S),
        restart=_restart(doc, path),
        source=path.resolve(),
    )


def _no_unknown(table: dict[str, Any], known: set[str], path: Path, where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise NodeSpecError(f"{path}: unknown key(s) {', '.join(unknown)} in {where} (known: {', '.join(sorted(known))})")


def _string(doc: dict[str, Any], key: str, path: Path, default: str) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str) or not value.strip():
        raise NodeSpecError(f"{path}: {key} must be a non-empty string, got {value!r}")
    return value


def _strings(doc: dict[str, Any], key: str, path: Path) -> list[str]:
    value = doc.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise NodeSpecError(f"{path}: {key} must be a list of non-empty strings, got {value!r}")
    return value


def _command(doc: dict[str, Any], path: Path) -> tuple[str, ...]:
    """``command`` as written, or the argv that ``[server]`` describes (exactly one of the two)."""
    from mlxcel.node.server import server_command

    if "command" in doc and "server" in doc:
        raise NodeSpecError(f"{path}: command and [server] both describe the command line; keep one")
    if "server" in doc:
        return server_command(doc["server"], path)
    if "command" not in doc:
        raise NodeSpecError(f"{path}: command is missing (the node's argv, e.g. [\"/venv/bin/mlxcel-server\", ...], "
                            f"or a [server] table)")
    command = _strings(doc, "command", path)
    if not command:
        raise NodeSpecError(f"{path}: command is empty")
    return tuple(command)


def _default_match(doc: dict[str, Any], command: tuple[str, ...]) -> str:
    from mlxcel.node.server import server_match

    return server_match(doc["server"]) if "server" in doc else " ".join(command)


def _environment(doc: dict[str, Any], path: Path) -> dict[str, str]:
    from mlxcel.cluster.secret import ENV_SECRET
    from mlxcel.config import ENV_KEY

    env = doc.get("environment", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise NodeSpecError(f"{path}: [environment] must be a table of strings")
    for name in (ENV_SECRET, ENV_KEY):
        if name in env:
            raise NodeSpecError(f"{path}: [environment] {name} would put a secret's value in a file and the "
                                f"process environment; pass its path instead ({name}_FILE)")
    return dict(env)


def _restart(doc: dict[str, Any], path: Path) -> RestartPolicy:
    table = doc.get("restart", {})
    if not isinstance(table, dict):
        raise NodeSpecError(f"{path}: [restart] must be a table")
    _no_unknown(table, _RESTART_KEYS, path, "[restart]")
    policy = table.get("policy", defaults.DEFAULT_NODE_RESTART_POLICY)
    if policy not in POLICIES:
        raise NodeSpecError(f"{path}: [restart] policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    limit = table.get("limit", defaults.DEFAULT_NODE_RESTART_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise NodeSpecError(f"{path}: [restart] limit must be a positive integer, got {limit!r}")

    standby = table.get("standby", defaults.DEFAULT_NODE_RESTART_STANDBY)
    if not isinstance(standby, bool):
        raise NodeSpecError(f"{path}: [restart] standby must be true or false, got {standby!r}")

    def seconds(key: str, default: float) -> float:
        return _seconds(table, key, path, f"[restart] {key}", default)

    return RestartPolicy(policy=policy, backoff_s=seconds("backoff_s", defaults.DEFAULT_NODE_RESTART_BACKOFF_S),
                         backoff_max_s=seconds("backoff_max_s", defaults.DEFAULT_NODE_RESTART_BACKOFF_MAX_S),
                         limit=limit, reset_s=seconds("reset_s", defaults.DEFAULT_NODE_RESTART_RESET_S),
                         standby=standby)


def _url(ready: dict[str, Any], path: Path) -> str | None:
    url = ready.get("url")
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://"))):
        raise NodeSpecError(f"{path}: [ready] url must be an http:// or https:// URL, got {url!r}")
    return url


def _seconds(table: dict[str, Any], key: str, path: Path, where: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise NodeSpecError(f"{path}: {where} must be a positive number of seconds, got {value!r}")
    return float(value)
