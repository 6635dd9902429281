"""The OpenAI API in this process: the app over a ServerRuntime on the bound socket, until stopped.

Not a role itself: every role that serves the OpenAI API (``single``, ``coordinator``) calls ``serve_openai``
with the runtime it built.
"""

from __future__ import annotations

import sys

from mlxcel.process import ExitSwitch, RoleContext, http_server
from mlxcel.server.app import create_app
from mlxcel.server.runtime import ServerRuntime


def serve_openai(context: RoleContext, runtime: ServerRuntime, *, described_as: str = "") -> int:
    """Serve until SIGINT/SIGTERM or a fatal load error; returns the exit code.

    ``described_as`` ends the start-up line (e.g. " as coordinator of 2 pipeline stages").
    """
    args, access, config = context.args, context.access, runtime.config
    switch = ExitSwitch()
    app = create_app(runtime, on_fatal=switch.fatal, access=access)
    server = http_server(app, switch, log_level=args.log_level, uvicorn_options=access.uvicorn_options(),
                         graceful_shutdown_s=args.drain_timeout)
    host, port = context.address
    print(f"mlxcel: serving {config.served_model_name} on {access.scheme}://{host}:{port}{described_as} "
          f"(parallel {config.parallel}, batch {config.max_batch_size})", file=sys.stderr, flush=True)
    server.run(sockets=[context.sock])
    return switch.exit_code()
