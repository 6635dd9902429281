"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a thin translation
into the internal chat request.

Content blocks become chat messages (``tool_use`` blocks an assistant message's tool calls, ``tool_result``
blocks tool messages); the answer's pieces become content blocks (thinking, text, tool_use).
``MessageBuilder`` makes both the stream's events and the whole message from the same pieces. Stop
sequences are matched at the front (``AgentTurn``), so ``stop_sequence`` names the one that ended the answer.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlxcel.server import anthropic_protocol as ap
from mlxcel.server import protocol as p
from mlxcel.server.agent_turn import AgentTurn, Finish, Piece, guarded, remap_error, translated_request
from mlxcel.server.errors import APIError, InvalidRequest, Unsupported, anthropic_error, error_reply
from mlxcel.server.serving import SSEResponse

#: internal request field -> Messages field, for errors raised after translation
NAMES = {"max_tokens": "max_tokens", "messages": "messages", "tools": "tools", "tool_choice": "tool_choice",
         "chat_template_kwargs": "chat_template_kwargs"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "stop_sequence": "stop_sequence"}


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(block.text for block in system)
    return [{"role": "system", "content": text}]


def _result_text(block: ap.ToolResultBlock) -> str:
    if block.content is None:
        return ""
    return block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)


def _assistant(m: ap.Message, i: int, issued: set[str]) -> dict:
    message: dict = {"role": "assistant", "content": ""}
    for j, block in enumerate(m.content):
        if isinstance(block, ap.TextBlock):
            message["content"] += block.text
        elif isinstance(block, ap.ToolUseBlock):
            call = {"id": block.id, "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
            message.setdefault("tool_calls", []).append(call)
            issued.add(block.id)
        elif isinstance(block, ap.ToolResultBlock):
            raise InvalidRequest(f"messages[{i}].content[{j}]: tool_result blocks belong in user messages",
                                 param=f"messages[{i}].content[{j}].type")
    return message


def _user(m: ap.Message, i: int, issued: set[str]) -> list[dict]:
    out, text = [], []
    for j, block in enumerate(m.content):
        if isinstance(block, ap.ToolResultBlock):
            if block.tool_use_id not in issued:
                raise InvalidRequest(f"messages[{i}].content[{j}].tool_use_id '{block.tool_use_id}' answers no "
                                     "tool_use block earlier in the conversation",
                                     param=f"messages[{i}].content[{j}].tool_use_id")
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(block)})
        elif isinstance(block, ap.TextBlock):
            text.append(block.text)
        else:
            raise InvalidRequest(f"messages[{i}].content[{j}]: {block.type} blocks belong in assistant messages",
                                 param=f"messages[{i}].content[{j}].type")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def conversation(req: ap._Common) -> list[dict]:
    """System and messages as chat messages; every tool_result answers an earlier tool_use (400 naming it)."""
    messages = _system(req.system)
    issued: set[str] = set()
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        elif m.role == "assistant":
            messages.append(_assistant(m, i, issued))
        else:
            messages.extend(_user(m, i, issued))
    return messages


def _tool_choice(choice: Optional[ap.ToolChoice]) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest("tool_choice of type 'tool' needs a name", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _template_kwargs(req: ap._Common, template: str) -> Optional[dict]:
    kwargs = dict(req.chat_template_kwargs or {})
    thinking = req.thinking
    if thinking is not None and thinking.type != "adaptive" and "enable_thinking" in template:
        kwargs["enable_thinking"] = thinking.type == "enabled"
    return kwargs or None


def internal_request(req: ap._Common, template: str, max_tokens: Optional[int] = None) -> p.ChatCompletionRequest:
    """The chat request this Messages request asks for (``template``: the checkpoint's chat template text)."""
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.input_schema}} for t in req.tools or ()]
    choice = req.tool_choice
    body: dict[str, Any] = {
        "model": req.model, "messages": conversation(req), "max_tokens": max_tokens,
        "tools": [{"type": "function", "function": {k: v for k, v in t["function"].items() if v is not None}}
                  for t in tools] or None,
        "tool_choice": _tool_choice(choice),
        "parallel_tool_calls": False if choice is not None and choice.disable_parallel_tool_use else None,
        "chat_template_kwargs": _template_kwargs(req, template),
    }
    if isinstance(req, ap.MessagesRequest):
        body.update(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                    repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos)
    return translated_request(body, NAMES)


def _input(arguments: str) -> dict:
    """A call's arguments as a tool_use ``input`` object; text that is no JSON object becomes ``{}``."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    """Pieces in, content blocks and the stream's events out."""

    def __init__(self, model: str, prompt_tokens: int):
        self.content: list[dict] = []
        self._open: Optional[str] = None
        self.message = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
                        "model": model, "content": self.content, "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": json.loads(json.dumps(self.message))}, {"type": "ping"}]

    def feed(self, piece: Piece) -> list[dict]:
        kind = {"content": "text", "reasoning": "thinking", "call": "tool_use"}[piece.kind]
        events = self._close() if self._open is not None and (self._open != kind or kind == "tool_use") else []
        index = len(self.content)
        if kind == "tool_use":
            block = {"type": "tool_use", "id": piece.call_id.replace("call_", "toolu_", 1), "name": piece.name,
                     "input": {}}
            self.content.append(block)
            args = _input(piece.text)
            block_start = json.loads(json.dumps(block))
            block["input"] = args
            return events + [{"type": "content_block_start", "index": index, "content_block": block_start},
                             {"type": "content_block_delta", "index": index,
                              "delta": {"type": "input_json_delta", "partial_json": json.dumps(args)}},
                             {"type": "content_block_stop", "index": index}]
        if self._open is None:
            block = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
            self.content.append(block)
            self._open = kind
            events.append({"type": "content_block_start", "index": index, "content_block": dict(block)})
        index = len(self.content) - 1
        self.content[-1][kind] += piece.text
        delta = {"type": "text_delta", "text": piece.text} if kind == "text" else \
            {"type": "thinking_delta", "thinking": piece.text}
        return events + [{"type": "content_block_delta", "index": index, "delta": delta}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def finish(self, end: Finish) -> list[dict]:
        events = self._close()
        reason = STOP_REASONS.get(end.reason, "end_turn")
        self.message.update(stop_reason=reason, stop_sequence=end.stop_sequence,
                            usage={"input_tokens": end.prompt_tokens, "output_tokens": end.completion_tokens})
        return events + [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": end.stop_sequence},
                          "usage": {"output_tokens": end.completion_tokens}},
                         {"type": "message_stop"}]


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


def _error_event(exc: BaseException) -> str:
    reply = error_reply(exc)
    return _sse(anthropic_error(reply.status, reply.json()["error"]["message"]))


class AnthropicServing:
    """The Messages endpoints over the shared chat serving."""

    def __init__(self, serving: Any):
        self.serving = serving

    def _template(self) -> str:
        tokenizer = self.serving.runtime.require_engine().tokenizer
        return str(getattr(tokenizer, "chat_template", "") or "")

    @staticmethod
    def _check(req: ap._Common) -> None:
        refused = req.refusal()
        if refused:
            raise Unsupported(refused.message, param=refused.param)

    async def create(self, req: ap.MessagesRequest, raw: Request) -> Response:
        self._check(req)
        internal = internal_request(req, self._template(), req.max_tokens)
        turn = AgentTurn(self.serving, internal, NAMES, tuple(req.stop_sequences or ()))
        builder = MessageBuilder(self.serving.model_name, turn.prompt_tokens)
        if req.stream:
            return SSEResponse(guarded(self._stream(turn, builder), turn.stream, _error_event))
        pieces, end = await turn.collect(raw)
        for piece in pieces:
            builder.feed(piece)
        builder.finish(end)
        return JSONResponse(builder.message)

    @staticmethod
    async def _stream(turn: AgentTurn, builder: MessageBuilder) -> AsyncIterator[str]:
        for event in builder.start():
            yield _sse(event)
        async for item in turn.pieces():
            for event in builder.finish(item) if isinstance(item, Finish) else builder.feed(item):
                yield _sse(event)

    def count_tokens(self, req: ap.CountTokensRequest) -> dict:
        self._check(req)
        try:
            turn = self.serving.render_chat(internal_request(req, self._template()))
        except APIError as exc:
            raise remap_error(exc, NAMES) from None
        return {"input_tokens": len(turn.prompt)}
