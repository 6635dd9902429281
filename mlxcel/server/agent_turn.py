"""The shared back half of the agent dialects (Responses, Messages): one internal chat request, generated
pieces out.

A dialect translates its request into a ``ChatCompletionRequest`` (the internal request: messages, tools,
sampling, output constraint) and submits it through ``OpenAIServing.submit_chat``, so the chat template,
the tool-call format, forced calls and the reasoning split are the chat endpoint's own. What comes back is
a sequence of ``Piece`` (reasoning text, content text, whole tool calls) and one ``Finish``, which each
dialect shapes into its own objects and stream events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Literal, Optional, Protocol, Union

from fastapi import Request
from pydantic import ValidationError

from mlxcel.engine.interface import EventStream, TokenEvent
from mlxcel.engine.stops import StopMatcher
from mlxcel.server import protocol as p
from mlxcel.server.chat_turn import Turn, TurnOutput
from mlxcel.server.errors import APIError, InvalidRequest
from mlxcel.server.serving import until_disconnect


@dataclass(frozen=True)
class Piece:
    """Generated output: ``text`` is reasoning or content text, or a whole call's JSON arguments."""

    kind: Literal["content", "reasoning", "call"]
    text: str = ""
    call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class Finish:
    """Why the answer ended: stop, length, tool_calls or stop_sequence (with the sequence)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: Optional[str] = None


Output = Union[Piece, Finish]


class Serving(Protocol):
    """The part of ``OpenAIServing`` a dialect uses."""

    def submit_chat(self, req: p.ChatCompletionRequest, *, ceiling: bool = False) -> tuple[Any, Turn, EventStream]: ...

    def events(self, stream: EventStream) -> AsyncIterator[Any]: ...


def remap_error(exc: APIError, names: dict[str, str]) -> APIError:
    """The same error with the internal request's field names replaced by the dialect's (prefix match)."""
    param = exc.param
    for old, new in names.items():
        if param is not None and (param == old or param.startswith((old + ".", old + "["))):
            param = new + param[len(old):]
            message = str(exc).replace(old, new)
            return type(exc)(message, param=param)
    return exc


def translated_request(body: dict[str, Any], names: dict[str, str]) -> p.ChatCompletionRequest:
    """The chat request another API's request was translated into; what the chat request refuses (no message
    at all, say) is the caller's 400, named in its own API's fields by ``names``, never a 500."""
    try:
        return p.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        where, why = ".".join(str(part) for part in first.get("loc", ())), first.get("msg", "invalid")
        error = InvalidRequest(f"{where}: {why}" if where else why, param=where or None)
        raise remap_error(error, names) from None


class AgentTurn:
    """One submitted internal request; ``pieces`` streams its output, ``collect`` gathers it.

    ``stops`` are matched here, on the raw generated text (as the engine matches ``stop``), so the answer
    can say which one ended it.
    """

    def __init__(self, serving: Serving, req: p.ChatCompletionRequest, names: dict[str, str],
                 stops: tuple[str, ...] = ()):
        try:
            _, self.turn, self.stream = serving.submit_chat(req, ceiling=True)  # max tokens: an upper bound
        except APIError as exc:
            raise remap_error(exc, names) from None
        self._serving = serving
        self._stops = StopMatcher(stops)
        self._raw = ""
        self.prompt_tokens = len(self.turn.prompt)

    async def pieces(self) -> AsyncIterator[Output]:
        shaped, stream = TurnOutput(self.turn), self.stream
        completion = 0
        try:
            async for ev in self._serving.events(stream):
                completion += isinstance(ev, TokenEvent)
                if self._stops.stops:
                    self._raw += ev.text
                text = self._stops.feed(ev.text)
                for piece in _pieces(shaped.feed(text) if text else []):
                    yield piece
                if self._stops.stopped:
                    stream.cancel()
                    for piece in _pieces(shaped.finish()):
                        yield piece
                    yield Finish("stop_sequence", self.prompt_tokens, completion, self._matched())
                    return
                if isinstance(ev, TokenEvent):
                    continue
                for piece in _pieces(shaped.feed(self._stops.flush()) + shaped.finish()):
                    yield piece
                reason = shaped.finish_reason(ev.finish_reason)
                yield Finish(reason, ev.prompt_tokens or self.prompt_tokens, ev.completion_tokens or completion)
        finally:
            stream.cancel()

    def _matched(self) -> str:
        """The stop string that matched: the one found earliest in the text (none matched before)."""
        found = [(self._raw.find(s), s) for s in self._stops.stops if s in self._raw]
        return min(found)[1]

    async def collect(self, raw: Request) -> tuple[list[Piece], Finish]:
        """The whole answer, cancelling generation if the client disconnects meanwhile."""
        return await until_disconnect(self._gather(), self.stream, raw)

    async def _gather(self) -> tuple[list[Piece], Finish]:
        out: list[Piece] = []
        async for item in self.pieces():
            if isinstance(item, Finish):
                return merge(out), item
            out.append(item)
        raise RuntimeError("the event stream ended without a finish")


def _pieces(deltas: list[p.Delta]) -> list[Piece]:
    """Chat deltas as pieces: a call's head delta (id, name) and its arguments delta become one piece."""
    out: list[Piece] = []
    head: Optional[p.ToolCallDelta] = None
    for d in deltas:
        if d.content:
            out.append(Piece("content", d.content))
        if d.reasoning_content:
            out.append(Piece("reasoning", d.reasoning_content))
        for c in d.tool_calls or ():
            if c.id is not None:
                head = c
                continue
            if head is not None:
                out.append(Piece("call", c.function.arguments or "", head.id or "", head.function.name or ""))
                head = None
    return out


def merge(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text pieces of one kind joined (what a whole answer holds)."""
    out: list[Piece] = []
    for piece in pieces:
        if out and piece.kind != "call" and out[-1].kind == piece.kind:
            out[-1] = Piece(piece.kind, out[-1].text + piece.text)
        else:
            out.append(piece)
    return out


async def guarded(body: AsyncIterator[str], stream: EventStream,
                  on_error: Callable[[BaseException], str]) -> AsyncIterator[str]:
    """A dialect's SSE body: an error after the stream started becomes the dialect's error event; the
    engine stream is always cancelled at the end."""
    try:
        async for text in body:
            yield text
    except Exception as exc:  # mapped by type, as for JSON errors
        yield on_error(exc)
    finally:
        stream.cancel()
