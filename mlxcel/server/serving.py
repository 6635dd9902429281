"""The logic behind the OpenAI endpoints: validate, encode, submit to the engine, shape the answer.

It talks to the backend only through ``mlxcel.engine.interface`` (submit,
event stream, cancel), so a pipeline coordinator serves through it unchanged.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlxcel.config import MAX_TOP_LOGPROBS
from mlxcel.engine.interface import (
    Engine,
    EngineRequest,
    EventStream,
    FinishEvent,
    TokenEvent,
    finish_error,
)
from mlxcel.engine.prompts import PromptError, encode_raw
from mlxcel.engine.sampling import SamplingParams, check_logit_bias
from mlxcel.engine.sampling_wire import logit_bias_from_doc
from mlxcel.server.structured import format_grammar, request_grammar
from mlxcel.strict_json import FieldError
from mlxcel.models.token_ids import TokenIdError, check_token_ids
from mlxcel.server import protocol as p
from mlxcel.server.chat_turn import Turn, join_deltas, prepare_turn
from mlxcel.server.errors import (
    ClientDisconnected,
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    RequestTimeout,
    Unsupported,
    error_reply,
)
from mlxcel.server.metrics import ServerMetrics
from mlxcel.server.runtime import ServerRuntime

AnyRequest = Union[p.ChatCompletionRequest, p.CompletionRequest]


@dataclass
class Outcome:
    """Everything a non-streaming answer needs, gathered from the event stream."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens: list[TokenEvent] = field(default_factory=list)


class SSEResponse(StreamingResponse):
    """Server-sent events whose generator is always closed, so cancellation reaches the engine."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def sse(payload: p.BaseModel | dict) -> str:
    data = payload if isinstance(payload, dict) else payload.model_dump(mode="json")
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


T = TypeVar("T")
_MARK = "\x00mlxcel-text\x00"


def text_template(render: Callable[[str], str]) -> Callable[[str], str]:
    """A chunk renderer for text alone: ``render(text)`` once with a marker, then the bytes around the
    marker's JSON string and ``json.dumps`` of each text between them (the same bytes as ``render(text)``,
    without building and dumping the pydantic model for every token)."""
    whole, mark = render(_MARK), json.dumps(_MARK)
    if whole.count(mark) != 1:
        return render
    head, tail = whole.split(mark)
    return lambda text: head + json.dumps(text) + tail


class OpenAIServing:
    """Chat and text completions over any ``Engine``."""

    def __init__(self, runtime: ServerRuntime, metrics: ServerMetrics):
        self.runtime = runtime
        self.metrics = metrics

    @property
    def model_name(self) -> str:
        return self.runtime.config.served_model_name

    # -- endpoints -------------------------------------------------------------------------

    def models(self) -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=self.model_name, created=self.runtime.created)])

    def submit_chat(self, req: p.ChatCompletionRequest, *,
                    ceiling: bool = False) -> tuple[Engine, Turn, EventStream]:
        """Validate, render and submit one chat request (the internal request every dialect builds).
        ``ceiling``: ``max_tokens`` is an upper bound (the Messages and Responses APIs), so one beyond what the
        context leaves after the prompt is lowered to it instead of refused."""
        engine = self._prepare(req)
        turn = prepare_turn(engine.tokenizer, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        top = self._top_logprobs(req.logprobs, req.top_logprobs)
        grammar = request_grammar(engine.tokenizer, req, turn)
        left = engine.context_length - len(turn.prompt)
        if ceiling and max_tokens is not None and max_tokens > left:
            max_tokens = max(1, left)  # a prompt that fills the context is still refused, below
        request = self._engine_request(engine, req, turn.prompt, max_tokens, param, bool(req.logprobs), top,
                                       grammar)
        return engine, turn, engine.submit(request)

    def render_chat(self, req: p.ChatCompletionRequest) -> Turn:
        """Validate and render one chat request without submitting it (token counting)."""
        return prepare_turn(self._prepare(req).tokenizer, req)

    async def chat(self, req: p.ChatCompletionRequest, raw: Request) -> Response:
        engine, turn, stream = self.submit_chat(req)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._chat_events(stream, rid, usage, engine.tokenizer, turn))
        out = await self._collect(stream, raw)
        logprobs = _chat_logprobs(out.tokens, engine.tokenizer) if req.logprobs else None
        message, finish = p.AssistantMessage(content=out.text), out.finish_reason
        if not turn.plain:
            shaped = turn.output()
            message = join_deltas(shaped.feed(out.text) + shaped.finish())
            finish = shaped.finish_reason(out.finish_reason or "stop")
        choice = p.ChatChoice(message=message, logprobs=logprobs, finish_reason=finish)
        body = p.ChatCompletion(id=rid, model=self.model_name, choices=[choice], usage=_usage(out))
        return JSONResponse(p.dump(body))

    async def completion(self, req: p.CompletionRequest, raw: Request) -> Response:
        engine = self._prepare(req)
        prompt = _completion_prompt(engine.tokenizer, req.prompt)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
        want_logprobs = req.logprobs is not None
        request = self._engine_request(engine, req, prompt, req.max_tokens, "max_tokens", want_logprobs,
                                       req.logprobs or 0, format_grammar(engine.tokenizer, req.response_format))
        stream = engine.submit(request)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._completion_events(stream, rid, usage, engine.tokenizer, want_logprobs))
        out = await self._collect(stream, raw)
        logprobs = _completion_logprobs(out.tokens, engine.tokenizer) if want_logprobs else None
        choice = p.CompletionChoice(text=out.text, logprobs=logprobs, finish_reason=out.finish_reason)
        body = p.Completion(id=rid, model=self.model_name, choices=[choice], usage=_usage(out))
        return JSONResponse(p.dump(body))

    # -- validation ------------------------------------------------------------------------

    def _prepare(self, req: AnyRequest) -> Engine:
        refused = req.refusal()  # fields we do not implement, and unknown ones (protocol.py's tables)
        if refused:
            raise Unsupported(refused.message, param=refused.param)
        if req.model != self.model_name:
            raise ModelNotFound(f"The model '{req.model}' does not exist; this server serves '{self.model_name}'.",
                                param="model")
        return self.runtime.require_engine()

    @staticmethod
    def _top_logprobs(logprobs: bool | None, top: int | None) -> int:
        if top is None:
            return 0
        if not logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
        return top

    def _engine_request(self, engine: Engine, req: AnyRequest, prompt: list[int], max_tokens: int | None,
                        param: str, logprobs: bool, top: int, grammar: str | None = None) -> EngineRequest:
        ctx = engine.context_length
        n = len(prompt)
        if max_tokens is not None and not 1 <= max_tokens <= ctx:
            raise InvalidRequest(f"{param} must be between 1 and {ctx} (the model's context length), "
                                 f"got {max_tokens}", param=param)
        if n + (max_tokens or 1) > ctx:
            asked = f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion)" \
                if max_tokens else f"{n} tokens in the prompt"
            raise ContextLengthExceeded(f"This model's maximum context length is {ctx} tokens. However, you "
                                        f"requested {asked}. Please reduce the length of the prompt or completion.",
                                        param="messages" if isinstance(req, p.ChatCompletionRequest) else "prompt")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        defaults = self.runtime.sampling_defaults
        params = SamplingParams(
            max_tokens=max_tokens or ctx - n,
            temperature=float(_given(req.temperature, defaults, "temperature", 1.0)),
            top_p=float(_given(req.top_p, defaults, "top_p", 1.0)),
            top_k=int(_given(req.top_k, defaults, "top_k", 0)),
            seed=req.seed,
            stop=stop,
            logprobs=logprobs,
            min_p=float(_given(req.min_p, defaults, "min_p", 0.0)),
            repetition_penalty=float(_given(req.repetition_penalty, defaults, "repetition_penalty", 1.0)),
            presence_penalty=float(req.presence_penalty or 0.0),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            logit_bias=_logit_bias(req.logit_bias, _vocab_size(engine.tokenizer)),
            grammar=grammar,
        )
        return EngineRequest(tuple(prompt), params, top_logprobs=top, ignore_eos=bool(req.ignore_eos))

    # -- consuming the engine ------------------------------------------------------------------

    async def _events(self, stream: EventStream) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Events with timeout, metrics and guaranteed cancellation if the consumer stops early."""
        start = last = time.perf_counter()
        timeout = self.runtime.config.request_timeout
        deadline = start + timeout if timeout else None
        first = True
        try:
            while True:
                remaining = None if deadline is None else deadline - time.perf_counter()
                if remaining is not None and remaining <= 0:
                    raise asyncio.TimeoutError
                event = stream.next_nowait()  # delivered already: no timer, no task (one per token otherwise)
                if event is None:
                    event = await asyncio.wait_for(stream.__anext__(), remaining)
                now = time.perf_counter()
                if isinstance(event, TokenEvent):
                    (self.metrics.ttft if first else self.metrics.itl).observe(now - (start if first else last))
                    first, last = False, now
                else:
                    self._count_finish(event, now - start)
                yield event
                if isinstance(event, FinishEvent):
                    return
        except asyncio.TimeoutError:
            self.metrics.finished.labels("timeout").inc()
            raise RequestTimeout(f"the request did not finish within {timeout:g}s (--request-timeout)") from None
        finally:
            stream.cancel()  # no-op when finished

    def events(self, stream: EventStream) -> AsyncIterator[TokenEvent | FinishEvent]:
        """The engine's events for a dialect's own shaping (timeout, metrics, cancellation as for chat)."""
        return self._events(stream)

    def _count_finish(self, event: FinishEvent, seconds: float) -> None:
        self.metrics.finished.labels(event.finish_reason).inc()
        self.metrics.prompt_tokens.inc(event.prompt_tokens)
        self.metrics.completion_tokens.inc(event.completion_tokens)
        self.metrics.e2e.observe(seconds)
        if event.error:
            raise finish_error(event)

    async def _collect(self, stream: EventStream, raw: Request) -> Outcome:
        """Gather a whole answer, cancelling generation if the client disconnects meanwhile."""
        return await until_disconnect(self._gather(stream), stream, raw)

    async def _gather(self, stream: EventStream) -> Outcome:
        out = Outcome()
        parts: list[str] = []
        async for event in self._events(stream):
            parts.append(event.text)
            if isinstance(event, TokenEvent):
                out.tokens.append(event)
            else:
                out.finish_reason = event.finish_reason
                out.prompt_tokens, out.completion_tokens = event.prompt_tokens, event.completion_tokens
        out.text = "".join(parts)
        return out

    async def _chat_events(self, stream: EventStream, rid: str, include_usage: bool,
                           tokenizer: Any, turn: Turn) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(delta: p.Delta, finish: str | None = None, logprobs: p.ChoiceLogprobs | None = None) -> str:
            choice = p.ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)
            return sse(p.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice]))

        text_chunk = text_template(lambda text: chunk(p.Delta(content=text)))
        shaped = None if turn.plain else turn.output()

        def chunks(text: str, lp: p.ChoiceLogprobs | None = None) -> list[str]:
            """The text as chunks: content alone (the fast path), or split into reasoning and tool calls."""
            if shaped is None:
                return [text_chunk(text)] if text and lp is None else [chunk(p.Delta(content=text), logprobs=lp)]
            deltas = shaped.feed(text)
            if lp is not None and not deltas:
                deltas = [p.Delta()]  # one chunk per token carries its logprob
            return [chunk(d, logprobs=lp if i == 0 else None) for i, d in enumerate(deltas)]

        async def body() -> AsyncIterator[str]:
            yield chunk(p.Delta(role="assistant", content=""))
            async for ev in self._events(stream):
                if isinstance(ev, TokenEvent):
                    lp = None if ev.logprob is None else _chat_logprobs([ev], tokenizer)
                    if ev.text or lp is not None:
                        for text in chunks(ev.text, lp):
                            yield text
                    continue
                finish = ev.finish_reason
                if ev.text:
                    for text in chunks(ev.text):
                        yield text
                if shaped is not None:
                    for delta in shaped.finish():
                        yield chunk(delta)
                    finish = shaped.finish_reason(finish)
                yield chunk(p.Delta(), finish=finish)
                if include_usage:
                    usage = p.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                                    total_tokens=ev.prompt_tokens + ev.completion_tokens)
                    yield sse(p.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[],
                                                    usage=usage))

        async for text in _sse_guard(body(), stream):
            yield text

    async def _completion_events(self, stream: EventStream, rid: str, include_usage: bool, tokenizer: Any,
                                 want_logprobs: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(text: str, finish: str | None = None, logprobs: p.CompletionLogprobs | None = None) -> str:
            choice = p.CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish)
            return sse(p.Completion(id=rid, created=created, model=self.model_name, choices=[choice]))

        text_chunk = text_template(lambda text: chunk(text))

        async def body() -> AsyncIterator[str]:
            async for ev in self._events(stream):
                if isinstance(ev, TokenEvent):
                    if ev.text and not want_logprobs:
                        yield text_chunk(ev.text)
                        continue
                    if ev.text or want_logprobs:
                        lp = _completion_logprobs([ev], tokenizer) if want_logprobs else None
                        yield chunk(ev.text, logprobs=lp)
                    continue
                yield chunk(ev.text, finish=ev.finish_reason)
                if include_usage:
                    usage = p.Usage(prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens,
                                    total_tokens=ev.prompt_tokens + ev.completion_tokens)
                    yield sse(p.Completion(id=rid, created=created, model=self.model_name, choices=[], usage=usage))

        async for text in _sse_guard(body(), stream):
            yield text


async def _sse_guard(body: AsyncIterator[str], stream: EventStream) -> AsyncIterator[str]:
    """Errors after the stream started become one SSE error event; every stream ends with [DONE]."""
    try:
        async for text in body:
            yield text
    except Exception as exc:  # mapped by type, like JSON errors
        yield error_reply(exc).sse()
    finally:
        stream.cancel()
    yield "data: [DONE]\n\n"


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(work: Awaitable[T], stream: EventStream, raw: Request) -> T:
    """``work``'s result; if the client disconnects first, ``work`` and the engine ``stream`` are cancelled
    and ``ClientDisconnected`` raised (every dialect's whole, non-streamed answer)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    stream.cancel()
    raise ClientDisconnected()


def _completion_prompt(tokenizer: Any, prompt: Union[str, list]) -> list[int]:
    if isinstance(prompt, str):
        return encode_raw(tokenizer, prompt)
    if not prompt:
        raise PromptError("prompt must not be empty")
    if all(isinstance(x, str) for x in prompt):
        if len(prompt) != 1:
            raise Unsupported("only one prompt per request is supported", param="prompt")
        return encode_raw(tokenizer, prompt[0])
    try:
        check_token_ids(prompt, _vocab_size(tokenizer), "prompt")
    except TokenIdError as exc:
        raise InvalidRequest(str(exc), param="prompt") from None
    return list(prompt)


def _vocab_size(tokenizer: Any) -> int:
    return getattr(tokenizer, "vocab_size", None) or len(tokenizer.get_vocab())


def _logit_bias(raw: dict[str, Any] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` object as checked (id, bias) pairs; a 400 naming ``logit_bias`` otherwise."""
    if raw is None:
        return ()
    try:
        pairs = logit_bias_from_doc(raw)
    except FieldError as exc:
        raise InvalidRequest(str(exc), param="logit_bias") from None
    check_logit_bias(pairs, vocab_size)  # a SamplingError: a 400 naming logit_bias
    return pairs


def _usage(out: Outcome) -> p.Usage:
    return p.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                   total_tokens=out.prompt_tokens + out.completion_tokens)


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def _chat_logprobs(tokens: list[TokenEvent], tokenizer: Any) -> p.ChoiceLogprobs:
    content = []
    for ev in tokens:
        text = _token_text(tokenizer, ev.token)
        top = [p.TopLogprob(token=_token_text(tokenizer, t), logprob=lp,
                            bytes=list(_token_text(tokenizer, t).encode())) for t, lp in ev.top_logprobs]
        content.append(p.TokenLogprob(token=text, logprob=ev.logprob or 0.0, bytes=list(text.encode()),
                                      top_logprobs=top))
    return p.ChoiceLogprobs(content=content)


def _completion_logprobs(tokens: list[TokenEvent], tokenizer: Any) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs()
    offset = 0
    for ev in tokens:
        text = _token_text(tokenizer, ev.token)
        out.tokens.append(text)
        out.token_logprobs.append(ev.logprob or 0.0)
        out.top_logprobs.append({_token_text(tokenizer, t): lp for t, lp in ev.top_logprobs})
        out.text_offset.append(offset)
        offset += len(ev.text)
    return out


def _given(value: float | int | None, defaults: dict[str, float | int], key: str, fallback: float | int) -> float | int:
    """The request's value, else the checkpoint's recommendation, else OpenAI's default."""
    if value is not None:
        return value
    return defaults.get(key, fallback)
