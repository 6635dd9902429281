"""Tensor-parallel errors: each is one operator-facing line (a ``CLIError``) with its ``ErrorCode``."""

from __future__ import annotations

from mlxcel.error_codes import CodedError, ErrorCode
from mlxcel.errors import CLIError


class TPError(CLIError, CodedError):
    """Tensor parallelism cannot start or cannot go on; the message says why."""

    code = ErrorCode.INTERNAL


class ShardRefusal(TPError):
    """The checkpoint does not shard over the asked rank count (or the asked modes); refused before loading."""

    code = ErrorCode.UNSUPPORTED


class HostfileError(TPError):
    """The --tp-hostfile is malformed, or names addresses the loopback rule refuses."""

    code = ErrorCode.BAD_REQUEST
