"""Role ``router``: the OpenAI API over prefill and decode nodes; this process holds no weights.

Same endpoints, errors and access control as a single node, plus ``GET /router/stats`` (behind the
API key like every endpoint but /health): addresses redacted unless ``MLXCEL_ROUTER_STATS_VERBOSE``
is 1, true, yes or on.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from mlxcel.disagg.flags import NodeConfig, node_config
from mlxcel.disagg.wire import STATS_VERBOSE_ENV, VERBOSE_VALUES
from mlxcel.process import ExitSwitch, RoleContext, http_server
from mlxcel.server.app import create_app
from mlxcel.server.runtime import ServerRuntime


def stats_verbose(env: dict[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(STATS_VERBOSE_ENV, "")
    return value.strip().lower() in VERBOSE_VALUES


def router_factory(cfg: NodeConfig):
    """The server runtime's engine factory: a ``RouterEngine`` over the configured nodes."""

    def build(model: Any, tokenizer: Any, ctx: int, config: Any) -> Any:
        from mlxcel.disagg.router import RouterEngine
        from mlxcel.models.identity import model_identity

        engine = RouterEngine(cfg, tokenizer, context_length=ctx, identity=model_identity(config.model))
        try:
            return engine.start()
        except BaseException:
            engine.close()
            raise

    return build


def run(context: RoleContext) -> int:
    """Serve the OpenAI API and /router/stats until SIGINT/SIGTERM; returns the exit code."""
    cfg = node_config(context.args, context.dist)
    config = replace(context.config, lazy_weights=True)  # the tokenizer and config only
    runtime = ServerRuntime(config, router_factory(cfg))
    switch = ExitSwitch()
    app = create_app(runtime, on_fatal=switch.fatal, access=context.access)
    verbose = stats_verbose()

    @app.get("/router/stats")
    async def router_stats(_: Request) -> JSONResponse:
        engine = runtime.engine
        if engine is None:
            return JSONResponse({"status": runtime.state}, status_code=503, headers={"Retry-After": "1"})
        return JSONResponse(engine.router_stats(verbose))  # type: ignore[attr-defined]

    server = http_server(app, switch, log_level=context.args.log_level,
                         uvicorn_options=context.access.uvicorn_options(), graceful_shutdown_s=context.args.drain_timeout)
    host, port = context.address
    print(f"mlxcel: serving {config.served_model_name} on {context.access.scheme}://{host}:{port} as router over "
          f"{len(cfg.prefill_peers)} prefill and {len(cfg.decode_peers)} decode nodes (cluster address "
          f"{cfg.serving_bind})", file=sys.stderr, flush=True)
    server.run(sockets=[context.sock])
    return switch.exit_code()
