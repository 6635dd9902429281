"""Exceptions -> OpenAI error bodies, by exception type, in one place (JSON responses and SSE alike).

Body: ``{"error": {"message", "type", "param", "code"}}``. Types follow OpenAI:
invalid_request_error (400/404), server_error (500), overloaded/unavailable (503).
The Anthropic Messages routes answer the same errors in Anthropic's shape (``anthropic_error``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlxcel.engine.interface import EngineError, EngineOverloaded
from mlxcel.engine.prompts import PromptError
from mlxcel.engine.sampling import SamplingError
from mlxcel.error_codes import RETRY_AFTER_S, ErrorClass
from mlxcel.models.errors import ModelError
from mlxcel.server.protocol import ErrorDetail, ErrorResponse

log = logging.getLogger("mlxcel.server")


class APIError(Exception):
    """An error raised by the serving layer, already in OpenAI's terms."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class InvalidRequest(APIError):
    pass


class Unsupported(APIError):
    code = "unsupported_parameter"


class ModelNotFound(APIError):
    status = 404
    code = "model_not_found"


class ContextLengthExceeded(APIError):
    code = "context_length_exceeded"


class RequestTimeout(APIError):
    status = 504
    type = "timeout_error"
    code = "request_timeout"


class ClientDisconnected(Exception):
    """The client went away before the answer was ready (not an error to report)."""


@dataclass
class ErrorReply:
    status: int
    body: ErrorResponse
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> dict:
        return self.body.model_dump(mode="json")

    def response(self) -> JSONResponse:
        return JSONResponse(self.json(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        return f"data: {json.dumps(self.json())}\n\n"


def _reply(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
           headers: dict[str, str] | None = None) -> ErrorReply:
    detail = ErrorDetail(message=message, type=type_, param=param, code=code)
    return ErrorReply(status, ErrorResponse(error=detail), headers or {})


_TYPE_TAGS = {"int", "float", "str", "bool", "none"}


def _is_field(part: object) -> bool:
    """Locations also name union members ('int', 'list[str]', 'TextPart'); our fields are snake_case."""
    if isinstance(part, int):
        return True
    text = str(part)
    return text != "body" and text not in _TYPE_TAGS and text == text.lower() and not set(text) & set("[-")


def _validation_param(loc: tuple) -> str | None:
    parts = [p for p in loc if _is_field(p)]
    text = ""
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else str(p))
    return text or None


def _from_validation(exc: RequestValidationError) -> ErrorReply:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return _reply(400, "We could not parse the JSON body of your request: malformed JSON.",
                      "invalid_request_error", code="invalid_json")
    param = _validation_param(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        return _reply(400, f"Missing required parameter: '{param}'.", "invalid_request_error", param,
                      "missing_required_parameter")
    if param is None:
        return _reply(400, "The request body must be a JSON object.", "invalid_request_error")
    return _reply(400, f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", "invalid_request_error",
                  param, "invalid_type")


#: OpenAI-style (type, code) of an engine error, by the class of its ErrorCode
_ENGINE_TYPES = {
    ErrorClass.UNAVAILABLE: ("service_unavailable", "service_unavailable"),
    ErrorClass.BAD_INPUT: ("invalid_request_error", "invalid_value"),
    ErrorClass.CANCELLED: ("client_closed_request", None),
    ErrorClass.INTERNAL: ("server_error", "generation_failed"),
}


def _engine_reply(exc: EngineError) -> ErrorReply:
    """An engine error by its code: 503 + Retry-After (unavailable), 400, 499 or 500."""
    code = exc.code
    if isinstance(exc, EngineOverloaded):  # the server's own queue is full
        return _reply(503, str(exc), "server_overloaded", code="server_overloaded",
                      headers={"Retry-After": str(exc.retry_after)})
    type_, api_code = _ENGINE_TYPES[code.error_class]
    headers = {"Retry-After": str(RETRY_AFTER_S)} if code.retryable else {}
    return _reply(code.http_status, str(exc), type_, code=api_code, headers=headers)


def error_reply(exc: BaseException) -> ErrorReply:
    """The one mapping from an exception type to status, body and headers."""
    if isinstance(exc, APIError):
        return _reply(exc.status, str(exc), exc.type, exc.param, exc.code)
    if isinstance(exc, RequestValidationError):
        return _from_validation(exc)
    if isinstance(exc, ClientDisconnected):  # nobody reads it; nginx's code for the access log and metrics
        return _reply(499, "client closed the request", "client_closed_request")
    if isinstance(exc, SamplingError):
        return _reply(400, str(exc), "invalid_request_error", exc.param, "invalid_value")
    if isinstance(exc, PromptError):
        return _reply(400, str(exc), "invalid_request_error", None, "invalid_prompt")
    if isinstance(exc, ModelError):
        return _reply(400, str(exc), "invalid_request_error", "model")
    if isinstance(exc, EngineError):
        return _engine_reply(exc)
    if isinstance(exc, StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _reply(exc.status_code, str(exc.detail), type_, headers=dict(exc.headers or {}))
    log.error("internal error: %r", exc, exc_info=exc)
    return _reply(500, "The server had an internal error while processing your request.", "server_error",
                  code="internal_error")


#: routes that answer in Anthropic's error shape (the Messages API)
ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``, the type by status."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI sees through ``error_reply`` (in Anthropic's shape on its routes)."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        reply = error_reply(exc)
        if is_anthropic(request.url.path):
            body = anthropic_error(reply.status, reply.json()["error"]["message"])
            return JSONResponse(body, status_code=reply.status, headers=reply.headers)
        return reply.response()

    for exc_type in (APIError, RequestValidationError, ClientDisconnected, SamplingError, PromptError, ModelError,
                     EngineError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, handle)
