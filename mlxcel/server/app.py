"""Assemble the FastAPI app: routes, error handlers, request metrics, model loading at startup."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI

from mlxcel import __version__
from mlxcel.server.access import AccessConfig, install_access
from mlxcel.server.anthropic_api import AnthropicServing
from mlxcel.server.errors import install_error_handlers
from mlxcel.server.metrics import ServerMetrics
from mlxcel.server.responses_api import ResponsesServing
from mlxcel.server.routes import router
from mlxcel.server.runtime import ServerRuntime
from mlxcel.server.serving import OpenAIServing

_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
              "/v1/messages/count_tokens", "/v1/models", "/health", "/metrics"}


class RequestCounter:
    """Pure ASGI middleware counting responses by endpoint and status (streaming-safe)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        status = {"code": 500}

        async def record(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()


def create_app(runtime: ServerRuntime, on_fatal: Callable[[str], None] = lambda _: None,
               access: AccessConfig | None = None) -> FastAPI:
    """The server app; loading starts with the app's lifespan and the runtime closes with it.

    ``access`` adds the API key check (inside the request counter, so 401s are counted).
    """
    metrics = ServerMetrics(lambda: runtime.engine.stats() if runtime.engine is not None else None)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runtime.start_loading(on_fatal)
        try:
            yield
        finally:
            runtime.close()

    app = FastAPI(title="mlxcel", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = OpenAIServing(runtime, metrics)
    app.state.responses = ResponsesServing(app.state.serving)
    app.state.anthropic = AnthropicServing(app.state.serving)
    app.include_router(router)
    install_error_handlers(app)
    install_access(app, access)
    app.add_middleware(RequestCounter, metrics=metrics)
    return app
