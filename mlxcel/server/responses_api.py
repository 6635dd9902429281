"""The OpenAI Responses API (``POST /v1/responses``) as a thin translation into the internal chat request.

Input items become chat messages (``function_call`` items an assistant message's tool calls,
``function_call_output`` items tool messages); the answer's pieces become output items (reasoning,
message, function_call). ``ResponseBuilder`` makes both the stream's typed events and the whole
response from the same pieces, so a streamed answer reassembles to the whole one. Stored responses
(``store``, default true) live in a bounded in-memory LRU for ``previous_response_id``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlxcel.server import protocol as p
from mlxcel.server import responses_protocol as rp
from mlxcel.server.agent_turn import AgentTurn, Finish, Piece, guarded, translated_request
from mlxcel.server.errors import InvalidRequest, Unsupported, error_reply
from mlxcel.server.serving import SSEResponse

#: stored responses kept per process (least recently used dropped first)
STORE_SIZE = 256
#: internal request field -> Responses field, for errors raised after translation
NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "reasoning_effort": "reasoning.effort",
         "response_format.json_schema.schema": "text.format.schema",  # before its prefix: the first match wins
         "response_format": "text.format", "tools": "tools", "tool_choice": "tool_choice"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseStore:
    """The last ``size`` stored responses: the response object and the conversation it ended (thread-safe)."""

    def __init__(self, size: int = STORE_SIZE):
        self._size = size
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def get(self, rid: str) -> Optional[tuple[dict, list[dict]]]:
        with self._lock:
            found = self._items.get(rid)
            if found is not None:
                self._items.move_to_end(rid)
            return found

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None


def _text(content: Any) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def conversation(req: rp.ResponsesRequest) -> list[dict]:
    """The input items as chat messages (without the instructions); call ids checked (400 naming the item)."""
    items = [rp.MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    messages: list[dict] = []
    issued: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, rp.MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, rp.FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
            issued.add(item.call_id)
        elif isinstance(item, rp.FunctionCallOutputItem):
            if item.call_id not in issued:
                raise InvalidRequest(f"input[{i}].call_id '{item.call_id}' answers no function_call earlier in the "
                                     "conversation", param=f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _response_format(text: Optional[rp.TextConfig]) -> Optional[dict]:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None or fmt.schema_ is None:
        raise InvalidRequest("text.format of type json_schema needs a name and a schema", param="text.format")
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def internal_request(req: rp.ResponsesRequest, history: list[dict]) -> p.ChatCompletionRequest:
    """The chat request this Responses request asks for (``history``: the previous response's conversation)."""
    system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    messages = system + history + conversation(req)
    if not messages:
        raise InvalidRequest("input holds no item (and there are no instructions or previous response) to answer",
                             param="input")
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, rp.FunctionChoice) else req.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    tools = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                             exclude_none=True)} for t in req.tools or ()]
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty, "chat_template_kwargs": req.chat_template_kwargs,
        "ignore_eos": req.ignore_eos,
        "tools": tools or None, "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
    }
    constraint = _response_format(req.text)
    if constraint is not None:
        body["response_format"] = constraint
    return translated_request(body, NAMES)


def as_messages(output: list[dict]) -> list[dict]:
    """A response's output items as chat messages (what the next turn's history holds)."""
    message: dict = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            message["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            message.setdefault("tool_calls", []).append(call)
    return [message]


class ResponseBuilder:
    """Pieces in, output items and the stream's typed events (with ``sequence_number``) out."""

    def __init__(self, req: rp.ResponsesRequest, model: str, rid: str):
        self.seq = 0
        self.output: list[dict] = []
        self._open: Optional[dict] = None
        self.response = {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": model, "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False, "temperature": req.temperature,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                     if req.text and req.text.format else {"type": "text"}},
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, p.BaseModel)
            else (req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "top_p": req.top_p,
            "truncation": "disabled", "usage": None, "metadata": req.metadata or {},
        }

    def event(self, type_: str, **fields: Any) -> dict:
        out = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def start(self) -> list[dict]:
        snapshot = json.loads(json.dumps(self.response))
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def feed(self, piece: Piece) -> list[dict]:
        events: list[dict] = []
        want = "message" if piece.kind == "content" else piece.kind
        if self._open is not None and (self._open["type"] != want or piece.kind == "call"):
            events += self._close()
        if piece.kind == "call":
            return events + self._call(piece)
        if self._open is None:
            events += self._begin(piece.kind)
        part = self._open["content"][0]
        part["text"] += piece.text
        kind = "response.output_text.delta" if piece.kind == "content" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if piece.kind == "content" else {}
        events.append(self.event(kind, item_id=self._open["id"], output_index=len(self.output) - 1,
                                 content_index=0, delta=piece.text, **extra))
        return events

    def _begin(self, kind: str) -> list[dict]:
        if kind == "content":
            item = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        events = [self.event("response.output_item.added", output_index=index, item=json.loads(json.dumps(item)))]
        item["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=dict(part)))
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index, part = len(self.output) - 1, item["content"][0]
        done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        return [self.event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                           **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=dict(part)),
                self.event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item)))]

    def _call(self, piece: Piece) -> list[dict]:
        item = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": piece.call_id,
                "name": piece.name, "arguments": ""}
        self.output.append(item)
        index = len(self.output) - 1
        events = [self.event("response.output_item.added", output_index=index, item=dict(item))]
        item["arguments"], item["status"] = piece.text, "completed"
        events += [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                              delta=piece.text),
                   self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=piece.text, name=piece.name),
                   self.event("response.output_item.done", output_index=index, item=dict(item))]
        return events

    def finish(self, end: Finish) -> list[dict]:
        incomplete = end.reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        self.response["status"] = "incomplete" if incomplete else "completed"
        self.response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        self.response["usage"] = {
            "input_tokens": end.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": end.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": end.prompt_tokens + end.completion_tokens}
        kind = "response.incomplete" if incomplete else "response.completed"
        return events + [self.event(kind, response=self.response)]


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


class ResponsesServing:
    """``POST /v1/responses`` (and GET/DELETE of a stored response) over the shared chat serving."""

    def __init__(self, serving: Any, store: Optional[ResponseStore] = None):
        self.serving = serving
        self.store = store or ResponseStore()

    async def create(self, req: rp.ResponsesRequest, raw: Request) -> Response:
        refused = req.refusal()
        if refused:
            raise Unsupported(refused.message, param=refused.param)
        history = self._history(req.previous_response_id)
        internal = internal_request(req, history)
        turn = AgentTurn(self.serving, internal, NAMES)
        rid = _id("resp")
        builder = ResponseBuilder(req, self.serving.model_name, rid)
        kept = history + conversation(req)
        if req.stream:
            return SSEResponse(guarded(self._stream(turn, builder, kept, req), turn.stream,
                                       lambda exc: _error_event(builder, exc)))
        pieces, end = await turn.collect(raw)
        for piece in pieces:
            builder.feed(piece)
        builder.finish(end)
        self._keep(req, builder.response, kept)
        return JSONResponse(builder.response)

    async def _stream(self, turn: AgentTurn, builder: ResponseBuilder, kept: list[dict],
                      req: rp.ResponsesRequest) -> AsyncIterator[str]:
        for event in builder.start():
            yield _sse(event)
        async for item in turn.pieces():
            events = builder.finish(item) if isinstance(item, Finish) else builder.feed(item)
            if isinstance(item, Finish):
                self._keep(req, builder.response, kept)
            for event in events:
                yield _sse(event)

    def _history(self, previous: Optional[str]) -> list[dict]:
        if previous is None:
            return []
        found = self.store.get(previous)
        if found is None:
            raise InvalidRequest(f"Previous response with id '{previous}' not found (this server keeps the last "
                                 f"{self.store.size} stored responses, in memory).",
                                 param="previous_response_id")
        return found[1]

    def _keep(self, req: rp.ResponsesRequest, response: dict, kept: list[dict]) -> None:
        if req.store is not False:
            self.store.put(response, kept + as_messages(response["output"]))

    def retrieve(self, rid: str) -> dict:
        found = self.store.get(rid)
        if found is None:
            raise ResponseNotFound(f"Response with id '{rid}' not found.", param="response_id")
        return found[0]

    def delete(self, rid: str) -> dict:
        if not self.store.delete(rid):
            raise ResponseNotFound(f"Response with id '{rid}' not found.", param="response_id")
        return {"id": rid, "object": "response", "deleted": True}


class ResponseNotFound(InvalidRequest):
    status = 404
    code = "not_found"


def _error_event(builder: ResponseBuilder, exc: BaseException) -> str:
    detail = error_reply(exc).json()["error"]
    return _sse(builder.event("error", code=detail["code"], message=detail["message"], param=detail["param"]))
