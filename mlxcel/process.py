"""Process plumbing shared by every role: the listening socket, the exit switch, the uvicorn server, the exit.

Neutral ground: roles (``mlxcel/roles.py`` lists them) import this module; it imports no role.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from mlxcel.errors import CLIError

if TYPE_CHECKING:
    from mlxcel.pipeline.runtime import Distributed
    from mlxcel.server.access import AccessConfig
    from mlxcel.server.runtime import ServerConfig


@dataclass(frozen=True)
class RoleContext:
    """Everything a role's ``run`` gets: checked flags and configuration, and the socket already bound."""

    args: argparse.Namespace
    config: ServerConfig
    dist: Distributed | None
    access: AccessConfig
    sock: socket.socket

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen before loading anything, so a taken port fails in milliseconds."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CLIError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise CLIError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def error_line(message: str) -> None:
    """``mlxcel: error: <message>`` on stderr in ONE write: other threads' log lines never land inside it."""
    sys.stderr.write(f"mlxcel: error: {message}\n")
    sys.stderr.flush()


class ExitSwitch:
    """The process's exit code and its uvicorn server: ``fatal`` prints one line and stops serving."""

    def __init__(self) -> None:
        self.code = 0
        self.server: Any = None

    def fatal(self, message: str) -> None:
        error_line(message)
        self.code = 1
        self.stop()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    def exit_code(self) -> int:
        return self.code or (0 if self.server is not None and self.server.started else 1)


def server_class() -> type:
    """uvicorn's Server, except that SIGINT/SIGTERM end in a clean exit 0 instead of being re-raised."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # type: ignore[no-untyped-def]
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return Server


def http_server(app: Any, switch: ExitSwitch, *, log_level: str, uvicorn_options: dict[str, Any],
                graceful_shutdown_s: float | None = None) -> Any:
    """The uvicorn server of ``app`` (access log only at debug), registered with ``switch``."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=graceful_shutdown_s, **uvicorn_options)
    server = switch.server = server_class()(config)
    return server


def exit_process(code: int) -> NoReturn:
    """Flush and leave without static destructors.

    MLX aborts at interpreter exit after running compiled kernels on a non-main thread
    (ml-explore/mlx#3126); every role has closed its engine by the time it returns.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
