"""HTTP routes: parse, delegate to the serving module, return. No logic here."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from mlxcel.server import anthropic_protocol as ap
from mlxcel.server import protocol as p
from mlxcel.server import responses_protocol as rp
from mlxcel.server.metrics import CONTENT_TYPE
from mlxcel.server.serving import OpenAIServing

router = APIRouter()


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


@router.post("/v1/chat/completions")
async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
    return await _serving(request).chat(body, request)


@router.post("/v1/completions")
async def completions(body: p.CompletionRequest, request: Request) -> Response:
    return await _serving(request).completion(body, request)


@router.post("/v1/responses")
async def responses(body: rp.ResponsesRequest, request: Request) -> Response:
    return await request.app.state.responses.create(body, request)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict:
    return request.app.state.responses.retrieve(response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    return request.app.state.responses.delete(response_id)


@router.post("/v1/messages")
async def messages(body: ap.MessagesRequest, request: Request) -> Response:
    return await request.app.state.anthropic.create(body, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: ap.CountTokensRequest, request: Request) -> dict:
    return request.app.state.anthropic.count_tokens(body)


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return p.dump(_serving(request).models())


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    runtime = _serving(request).runtime
    body: dict = {"status": runtime.state}
    if runtime.ready and runtime.engine is not None and hasattr(runtime.engine, "health"):
        health = runtime.engine.health()  # a pipeline: "degraded" while a stage does not answer
        if health.get("status") != "ok":
            body = {**health, "status": health.get("status", "degraded")}
        else:  # a pipeline's stages and spares (docs/bringup.md §5.6); one row per decode step and why (models.md)
            body.update({k: health[k] for k in ("stages", "spares", "reassigned", "batching") if k in health})
    ok = body["status"] == "ready"
    return JSONResponse(body, status_code=200 if ok else 503, headers={} if ok else {"Retry-After": "1"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_serving(request).metrics.render(), media_type=CONTENT_TYPE)
