"""The contract between the HTTP front and whatever generates tokens.

A backend (the local continuous-batching engine, later a pipeline coordinator
or a disaggregated router) implements ``Engine``: ``submit`` a request of token
ids and sampling parameters, consume an ``EventStream`` of ``TokenEvent`` and
one final ``FinishEvent``, ``cancel`` it at any time. Backends may be driven by
threads: ``EventStream.push`` is thread-safe and wakes the asyncio consumer.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Union

from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import RETRY_AFTER_S, CodedError, ErrorCode

_ids = itertools.count(1)


class EngineError(CodedError):
    """Base of the errors a backend raises to the HTTP front; ``code`` decides the HTTP status."""



class EngineOverloaded(EngineError):
    """No capacity for another request now; retry after ``retry_after`` seconds."""

    code = ErrorCode.OVERLOADED

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S):
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailable(EngineError):
    """The backend is not ready (loading, warming up), is shutting down, or lost a peer it needs."""

    code = ErrorCode.UNAVAILABLE


class EngineFailure(EngineError):
    """The backend failed while generating for this request (``code`` says how)."""


def finish_error(event: "FinishEvent") -> EngineError:
    """The exception a failed ``FinishEvent`` stands for: its code picks the type."""
    code = event.code or ErrorCode.INTERNAL
    kind = EngineUnavailable if code.retryable else EngineFailure
    return kind(event.error or "generation failed", code)


@dataclass(frozen=True)
class EngineRequest:
    """What to generate: prompt token ids, sampling parameters, and output options."""

    prompt: tuple[int, ...]
    params: SamplingParams
    top_logprobs: int = 0  # alternatives reported per token (needs params.logprobs)
    ignore_eos: bool = False
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    draws: int = 0  # tokens sampled for it elsewhere already (a resumed request): its sampler starts after them


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it released (may be empty while a stop string is undecided)."""

    token: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    """The end of a request: why, trailing text, token counts; ``error`` set if the backend failed."""

    finish_reason: str  # "stop" | "length" | "error"
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    code: ErrorCode | None = None  # with ``error``: what failed (a retryable code means 503 + Retry-After)


Event = Union[TokenEvent, FinishEvent]


class EventStream:
    """An async iterator of events for one request, fed from any thread.

    Iteration ends after the ``FinishEvent``. ``cancel`` (idempotent) tells the
    backend to stop and free the request's resources.
    """

    def __init__(self, request: EngineRequest, on_cancel: Callable[[str], None]):
        self.request = request
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._on_cancel = on_cancel
        self.finished = False
        self.cancelled = False

    def push(self, event: Event) -> None:
        """Deliver an event; safe from any thread, a no-op once the loop is gone."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # event loop closed
            pass

    def cancel(self) -> None:
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._on_cancel(self.request.request_id)

    def next_nowait(self) -> Event | None:
        """The next event if one was delivered already, else None (then ``await`` the stream)."""
        if self.finished or self._queue.empty():
            return None
        event = self._queue.get_nowait()
        if isinstance(event, FinishEvent):
            self.finished = True
        return event

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> Event:
        if self.finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, FinishEvent):
            self.finished = True
        return event


class Engine(Protocol):
    """What the HTTP front needs from a backend."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def context_length(self) -> int: ...

    def submit(self, request: EngineRequest) -> EventStream:
        """Queue a request; raise EngineOverloaded when full. Call from the event loop."""

    def stats(self) -> dict[str, float]:
        """Counters and gauges for /metrics (queue depth, running batch, decode steps, ...)."""

    def close(self) -> None:
        """Stop generating, fail pending requests, release resources."""
