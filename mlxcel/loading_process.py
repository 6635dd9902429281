"""The shell of a node process whose model loads in the background while ``/health`` says how it goes.

Loading -> ready (its service serving) | failed: 503 until ready, 200 after. Neutral ground like
``mlxcel.process``: the stage, prefill and decode roles build on it; it imports no role.

SIGUSR1 drains the node (``mlxcel node drain``; docs/deploy.md, "Rolling restart"): its service's
``draining`` becomes true, now or as soon as it serves. A draining stage refuses new sequences (as
after BEGIN_DRAIN); a draining prefill or decode node says so in its STATE answer and ``/health``, and
routers send it no new request, while what it holds finishes. Only a restart ends draining.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from mlxcel.process import Endpoint, ExitSwitch, http_server


class LoadingProcess:
    """Loading -> ready | failed; a role sets ``service`` once it serves and says what /health adds."""

    def __init__(self) -> None:
        self.state = "loading"
        self.error: str | None = None
        self.service: Any = None
        self.drain_requested = False

    def _ready(self, service: Any) -> None:
        self.service = service
        self.state = "ready"
        if self.drain_requested:
            self.drain()

    def drain(self) -> None:
        """Accept no new work from now on (the service, once it serves); what it holds finishes."""
        self.drain_requested = True
        if self.service is not None and not self.service.draining:
            self.service.draining = True
            print("mlxcel: draining (SIGUSR1): no new work; what is in flight finishes", file=sys.stderr, flush=True)

    def _fail(self, message: str, on_fatal: Callable[[str], None]) -> None:
        self.state, self.error = "failed", message
        on_fatal(message)

    def start_service(self, build: Callable[[], Any], *, who: str, address: object,
                      on_fatal: Callable[[str], None]) -> float | None:
        """Build the service and start it: ready, with the seconds it took; or failed with one line
        naming ``who`` (and ``address`` when it cannot listen there), then None."""
        start = time.perf_counter()
        try:
            service = build()
            service.start()
        except OSError as exc:
            self._fail(f"{who}: cannot listen on {address}: {exc.strerror or exc}", on_fatal)
            return None
        except Exception as exc:  # noqa: BLE001 - one line, then exit
            self._fail(f"{who}: {exc}", on_fatal)
            return None
        self._ready(service)
        return time.perf_counter() - start

    def health_body(self) -> dict[str, Any]:
        """The role's /health JSON (``status`` is ``self.state``)."""
        raise NotImplementedError

    def health(self) -> JSONResponse:
        return JSONResponse(self.health_body(), status_code=200 if self.state == "ready" else 503)

    def close(self) -> None:
        if self.service is not None:
            self.service.close()


def health_app(process: LoadingProcess, title: str) -> FastAPI:
    """An app that serves only ``GET /health``."""
    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    app.get("/health")(lambda: process.health())
    return app


def serve_loading(endpoint: Endpoint, process: LoadingProcess, title: str, load: Callable[[ExitSwitch], None],
                  thread_name: str, banner: str) -> int:
    """Serve /health, run ``load(switch)`` on a thread, print ``banner`` and the health URL; the exit code."""
    switch = ExitSwitch()
    server = http_server(health_app(process, title), switch, endpoint)
    signal.signal(signal.SIGUSR1, lambda signum, frame: process.drain())
    threading.Thread(target=load, args=(switch,), name=thread_name, daemon=True).start()
    host, port = endpoint.address
    print(f"{banner}, health on http://{host}:{port}/health", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[endpoint.sock])
    finally:
        process.close()
    return switch.exit_code()
