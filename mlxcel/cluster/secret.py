"""The pre-shared cluster secret: sources, precedence, validation, a redacting type.

Sources, highest precedence first (reference, "Cluster authentication"):

1. ``--cluster-secret-file <PATH>``
2. ``MLXCEL_CLUSTER_SECRET_FILE=<PATH>``
3. ``MLXCEL_CLUSTER_SECRET=<VALUE>`` (both environment variables set is an error)
4. ``secret_file = "<PATH>"`` under ``[cluster]`` in the cluster TOML, relative to
   the TOML's own directory.

The TOML is parsed once, by the cluster config loader
(``mlxcel.topology.cluster_config``): it applies ``secret_file_of`` to the ``[cluster]``
table and hands the resolved path to ``load_secret(toml_secret_file=...)``; nothing here
reads the TOML.

The value must be at least 16 bytes after trimming one trailing newline.  It never
appears in a repr, an error, a log line or a TOML file.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NoReturn

from mlxcel import envs
from mlxcel.private_file import read_private_file

from .errors import SecretError

log = logging.getLogger("mlxcel.cluster.secret")

MIN_SECRET_LEN = 16
ENV_SECRET_FILE = "MLXCEL_CLUSTER_SECRET_FILE"
ENV_SECRET = "MLXCEL_CLUSTER_SECRET"
CLI_FLAG = "--cluster-secret-file"
TOML_FIELD = "secret_file under [cluster] in the cluster TOML"

MISSING_MESSAGE = (
    "a cluster secret is required but none was configured: pass --cluster-secret-file <PATH>, "
    "set MLXCEL_CLUSTER_SECRET_FILE=<PATH> or MLXCEL_CLUSTER_SECRET=<VALUE>, "
    'or set secret_file = "<PATH>" under [cluster] in the cluster TOML'
)


class ClusterSecret:
    """The secret bytes plus where they came from; never shows the value."""

    __slots__ = ("_value", "source", "path")

    def __init__(self, value: bytes, source: str = "value", path: Path | None = None) -> None:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError("ClusterSecret takes bytes")
        if len(value) < MIN_SECRET_LEN:
            raise SecretError(f"the cluster secret from {source} is too short: it must be at least {MIN_SECRET_LEN} bytes after trimming one trailing newline")
        self._value = bytes(value)
        self.source = source
        self.path = path

    def reveal(self) -> bytes:
        """The raw secret bytes, for key derivation and MACs only."""
        return self._value

    def __repr__(self) -> str:
        return f"ClusterSecret(<redacted>, source={self.source!r})"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSecret):
            return NotImplemented
        return hmac.compare_digest(self._value, other._value)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> NoReturn:
        raise TypeError("a ClusterSecret cannot be pickled")

    def __copy__(self) -> "ClusterSecret":
        return self

    def __deepcopy__(self, memo: dict) -> "ClusterSecret":
        return self


@dataclass(frozen=True)
class _Source:
    label: str
    path: Path | None = None
    value: bytes | None = None


def _trim(raw: bytes) -> bytes:
    """Trim exactly one trailing newline."""
    return raw[:-1] if raw.endswith(b"\n") else raw


def _read_file(path: Path, label: str) -> bytes:
    return read_private_file(path, "the cluster secret file", f"{path} (from {label})", SecretError, log)


def secret_file_of(cluster: Mapping[str, object], toml_path: Path) -> Path | None:
    """The secret file a cluster TOML's [cluster] table names (relative to the TOML), or None.

    Raises ``SecretError`` when the table holds the secret value itself or a malformed path.
    """
    for forbidden in ("secret", "cluster_secret"):
        if forbidden in cluster:
            raise SecretError(f"{toml_path} sets {forbidden} under [cluster]; the secret value never goes into the TOML, set secret_file instead")
    value = cluster.get("secret_file")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SecretError(f"secret_file under [cluster] in {toml_path} must be a non-empty string path")
    path = Path(value).expanduser()
    return path if path.is_absolute() else toml_path.parent / path


def _choose(cli_file: str | os.PathLike[str] | None, env: envs.Settings,
            toml_secret_file: str | os.PathLike[str] | None) -> _Source | None:
    env_file, env_value = env.cluster_secret_file, env.cluster_secret
    if env_file is not None and env_value is not None:
        raise SecretError(f"both {ENV_SECRET_FILE} and {ENV_SECRET} are set; set only one of them")
    if cli_file is not None:
        return _Source(CLI_FLAG, path=Path(cli_file).expanduser())
    if env_file is not None:
        if not env_file:
            raise SecretError(f"{ENV_SECRET_FILE} is set but empty")
        return _Source(ENV_SECRET_FILE, path=Path(env_file).expanduser())
    if env_value is not None:
        return _Source(ENV_SECRET, value=os.fsencode(env_value))
    if toml_secret_file is not None:
        return _Source(TOML_FIELD, path=Path(toml_secret_file))
    return None


def load_secret(
    cli_file: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    toml_secret_file: str | os.PathLike[str] | None = None,
    required: bool = True,
) -> ClusterSecret | None:
    """Load the secret from the highest-precedence configured source.

    ``toml_secret_file`` is the cluster TOML's ``secret_file``, already resolved by the
    cluster config loader (``ClusterConfig.secret_file``, from ``secret_file_of``).
    Returns None when nothing is configured and ``required`` is false; raises
    ``SecretError`` (naming every source) when it is true.
    """
    source = _choose(cli_file, envs.settings() if env is None else envs.read(env), toml_secret_file)
    if source is None:
        if required:
            raise SecretError(MISSING_MESSAGE)
        return None
    if source.path is not None:
        raw = _read_file(source.path, source.label)
        path: Path | None = source.path.resolve()
    else:
        raw, path = source.value or b"", None
    return ClusterSecret(_trim(raw), source=source.label, path=path)
