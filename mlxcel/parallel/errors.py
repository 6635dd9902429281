"""Tensor-parallel errors: each is one operator-facing line (a ``CLIError``)."""

from __future__ import annotations

from mlxcel.errors import CLIError


class TPError(CLIError):
    """Tensor parallelism cannot start or cannot go on; the message says why."""


class ShardRefusal(TPError):
    """The checkpoint does not shard over the asked rank count (or the asked modes); refused before loading."""


class HostfileError(TPError):
    """The --tp-hostfile is malformed, or names addresses the loopback rule refuses."""
