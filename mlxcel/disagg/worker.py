"""A prefill or decode process: the model loads in the background, /health on --host/--port says how it goes.

The HTTP port serves only ``/health`` (no API key needed): 503 while loading, 200 with the service's
state (sequences holding KV, handoffs arriving, counters) once it serves on its role transport.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from mlxcel.disagg.flags import NodeConfig, node_config
from mlxcel.process import ExitSwitch, RoleContext, http_server

log = logging.getLogger("mlxcel.disagg")


class WorkerProcess:
    """Loading -> ready (serving on the role transport) | failed."""

    def __init__(self, context: RoleContext, cfg: NodeConfig):
        self.context = context
        self.cfg = cfg
        self.state = "loading"
        self.error: str | None = None
        self.service: Any = None

    def load(self, on_fatal: Callable[[str], None]) -> None:
        from mlxcel.models.identity import model_identity
        from mlxcel.models.loading import load_checkpoint
        from mlxcel.server.runtime import context_length

        config = self.context.config
        start = time.perf_counter()
        try:
            loaded = load_checkpoint(config.model)
            kwargs: dict[str, Any] = dict(identity=model_identity(config.model),
                                          context_length=context_length(loaded.config), parallel=config.parallel,
                                          max_batch_size=config.max_batch_size, max_queue=config.max_queue,
                                          warmup=config.warmup)
            if self.cfg.role == "prefill":
                from mlxcel.disagg.prefill import PrefillService

                service: Any = PrefillService(self.cfg, loaded.model, loaded.tokenizer,
                                              prefix_cache_bytes=config.prefix_cache_mb << 20, **kwargs)
            else:
                from mlxcel.disagg.decode import DecodeService

                service = DecodeService(self.cfg, loaded.model, loaded.tokenizer, **kwargs)
            service.start()
        except OSError as exc:
            self._fail(f"{self.cfg.role} node: cannot listen on {self.cfg.serving_bind}: {exc.strerror or exc}", on_fatal)
            return
        except Exception as exc:  # noqa: BLE001 - one line, then exit
            self._fail(f"{self.cfg.role} node: {exc}", on_fatal)
            return
        self.service = service
        self.state = "ready"
        log.info("%s node serving %s on cluster address %s in %.1fs", self.cfg.role, loaded.name,
                 service.transport.identity, time.perf_counter() - start)

    def _fail(self, message: str, on_fatal: Callable[[str], None]) -> None:
        self.state, self.error = "failed", message
        on_fatal(message)

    def health(self) -> JSONResponse:
        body: dict[str, Any] = {"status": self.state, "role": self.cfg.role, "node_id": self.cfg.node_id}
        if self.service is not None:
            body.update(self.service.state())
        return JSONResponse(body, status_code=200 if self.state == "ready" else 503)

    def close(self) -> None:
        if self.service is not None:
            self.service.close()


def worker_app(process: WorkerProcess) -> FastAPI:
    app = FastAPI(title=f"mlxcel {process.cfg.role}", docs_url=None, redoc_url=None, openapi_url=None)
    app.get("/health")(lambda: process.health())
    return app


def run_worker(context: RoleContext) -> int:
    """Serve a prefill or decode node until SIGINT/SIGTERM; returns the exit code."""
    cfg = node_config(context.args, context.dist)
    process = WorkerProcess(context, cfg)
    switch = ExitSwitch()
    server = http_server(worker_app(process), switch, log_level=context.args.log_level,
                         uvicorn_options=context.access.uvicorn_options())
    threading.Thread(target=process.load, args=(switch.fatal,), name=f"mlxcel-{cfg.role}-load", daemon=True).start()
    host, port = context.address
    print(f"mlxcel: {cfg.role} node on cluster address {cfg.serving_bind}, health on http://{host}:{port}/health",
          file=sys.stderr, flush=True)
    try:
        server.run(sockets=[context.sock])
    finally:
        process.close()
    return switch.exit_code()
