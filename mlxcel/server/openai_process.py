"""The OpenAI API in this process: the app over a ServerRuntime on the bound socket, until stopped.

Not a role itself: every role that serves the OpenAI API (``single``, ``coordinator``, ``router``,
``tp``) calls ``serve_openai`` with the runtime it built, and ``routes`` for any endpoints of its own.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from mlxcel.process import Endpoint, ExitSwitch, http_server
from mlxcel.server.access import AccessConfig
from mlxcel.server.app import create_app
from mlxcel.server.runtime import ServerRuntime


def serve_openai(endpoint: Endpoint, access: AccessConfig, runtime: ServerRuntime, *, described_as: str = "",
                 details: str | None = None, routes: Callable[[Any], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM or a fatal load error; returns the exit code.

    ``described_as`` ends the start-up line (e.g. " as coordinator of 2 pipeline stages"), whose
    parenthesis is ``details`` (default: the batching settings); ``routes(app)`` adds the role's own endpoints.
    """
    config = runtime.config
    switch = ExitSwitch()
    app = create_app(runtime, on_fatal=switch.fatal, access=access)
    if routes is not None:
        routes(app)
    server = http_server(app, switch, endpoint, drain=True)
    details = details if details is not None else f"parallel {config.parallel}, batch {config.max_batch_size}"
    print(f"mlxcel: serving {config.served_model_name} on {endpoint.url()}{described_as} ({details})",
          file=sys.stderr, flush=True)
    server.run(sockets=[endpoint.sock])
    return switch.exit_code()
