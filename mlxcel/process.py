"""Process plumbing shared by every role: the listening socket, the exit switch, the uvicorn server, the exit.

Neutral ground: roles (``mlxcel/entrypoints/`` lists them) and the HTTP library (``mlxcel/server/``) import this
module; it imports neither.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, NoReturn

from mlxcel.errors import CLIError


@dataclass(frozen=True)
class Endpoint:
    """A role's bound HTTP socket and how uvicorn serves on it (TLS files, log level, drain bound)."""

    sock: socket.socket
    scheme: str = "http"
    log_level: str = "info"
    drain_timeout_s: float | None = None
    uvicorn_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    def url(self, path: str = "") -> str:
        host, port = self.address
        return f"{self.scheme}://{host}:{port}{path}"


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


#: a SIGINT or SIGTERM that came before a role's HTTP server took the signals over. Its handler raises
#: ``KeyboardInterrupt`` too, but Python drops an exception raised where it cannot propagate (a weakref
#: callback inside an import, a ``__del__``), so the server checks this once it handles the signals itself.
STOP_REQUESTED = threading.Event()


def server_class() -> type:
    """uvicorn's Server, except that SIGINT/SIGTERM end in a clean exit 0 instead of being re-raised, and a stop
    asked for before it took the signals over (``STOP_REQUESTED``) ends it as soon as it has started."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # type: ignore[no-untyped-def]
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

        async def startup(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
            await super().startup(sockets)
            if STOP_REQUESTED.is_set():  # the signals are uvicorn's now: none can be lost after this check
                self.should_exit = True

    return Server


def http_server(app: Any, switch: ExitSwitch, endpoint: Endpoint, *, drain: bool = False) -> Any:
    """The uvicorn server of ``app`` on ``endpoint`` (access log only at debug), registered with ``switch``;
    ``drain``: on SIGINT/SIGTERM requests in flight get ``endpoint.drain_timeout_s`` to finish."""
    import uvicorn

    level = endpoint.log_level
    config = uvicorn.Config(app, log_level=level, access_log=level == "debug",
                            timeout_graceful_shutdown=endpoint.drain_timeout_s if drain else None,
                            **dict(endpoint.uvicorn_options))
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
