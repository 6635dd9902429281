"""One chat completion's input and output shaping: tools and template variables in, reasoning and calls out.

``prepare_turn`` checks the tool fields against the checkpoint, renders the prompt through its chat
template (tools, ``chat_template_kwargs``, ``reasoning_effort``), and prefills a forced call. The
``TurnOutput`` of each answer turns the generated text into OpenAI deltas (content, reasoning, tool
calls); a whole answer is the same deltas joined, so streamed and non-streamed answers agree. A Harmony
(gpt-oss) turn is read by channels (``harmony.HarmonySplitter``) instead of at markers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from mlxcel.engine.prompts import encode_raw, render_chat
from mlxcel.server import harmony as hm
from mlxcel.server import protocol as p
from mlxcel.server import tool_calls as tc
from mlxcel.server.errors import InvalidRequest, Unsupported
from mlxcel.server.reasoning import Markers, MarkerSplitter, opens_in_reasoning, think_markers

MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
#: arguments the server itself passes to the template; chat_template_kwargs may not replace them
RESERVED_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
                             "return_dict", "continue_final_message", "chat_template", "tokenizer_kwargs"})


@dataclass
class Turn:
    """A rendered chat prompt and how to read its answer."""

    prompt: list[int]
    markers: Markers = field(default_factory=Markers)
    state: str = "content"  # where the answer starts: content, reasoning, or inside a (forced) tool call
    call_prefix: str = ""
    fmt: Optional[tc.ToolFormat] = None
    tools: list[dict] = field(default_factory=list)
    forced: Optional[str] = None
    parallel: bool = True
    harmony: Optional[str] = None  # a Harmony turn: the prompt's open last message (``harmony.opened_tail``)

    @property
    def plain(self) -> bool:
        """No markers to split: the text is all content."""
        return self.harmony is None and self.markers == Markers() and self.state == "content"

    def output(self) -> "TurnOutput":
        return TurnOutput(self)


def prepare_turn(tokenizer: Any, req: p.ChatCompletionRequest) -> Turn:
    """Validate the tool and template fields, render and encode the prompt (400s name the field)."""
    messages = [_message_dict(m) for m in req.messages]
    tools = [t.model_dump(mode="json", exclude_none=True) for t in req.tools or ()]
    uses_tools = bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    fmt = tc.require_format(tokenizer, "tools" if tools else _tool_param(messages)) if uses_tools else None
    tc.check_conversation(messages)
    choice = req.tool_choice if not isinstance(req.tool_choice, p.BaseModel) else req.tool_choice.model_dump()
    if choice not in (None, "none", "auto") and not tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    forced = tc.check_tools(tools, choice)
    if choice == "required" and len(tools) == 1:
        forced = tools[0]["function"]["name"]
    kwargs = _template_kwargs(tokenizer, req)
    text = render_chat(tokenizer, [tc.template_message(m) for m in messages], tools=tools or None,
                       template_kwargs=kwargs)
    think = think_markers(tokenizer)
    turn = Turn(prompt=[], fmt=fmt, tools=tools, forced=forced, parallel=req.parallel_tool_calls is not False)
    calling = bool(tools) and choice != "none"
    turn.markers = Markers(think=think, tool=(fmt.start, fmt.end) if calling and fmt else None)
    turn.state = "reasoning" if opens_in_reasoning(text, think) else "content"
    prefill = ""
    structured = req.response_format is not None and req.response_format.type != "text"
    forcing = calling and choice not in (None, "auto")
    if hm.is_harmony(tokenizer):
        prefill = tc.forced_opening(fmt, forced) if forcing else hm.FINAL if structured else ""
        turn.harmony = hm.opened_tail(text + prefill)
        if forcing and forced:
            turn.state = "tool"  # inside the call's JSON arguments, which a grammar can constrain
    elif structured and turn.state == "reasoning" and not forcing:
        prefill, turn.state = think[1] + "\n\n", "content"  # a structured answer skips the opened reasoning
    if forcing and turn.harmony is None:
        opening = tc.forced_opening(fmt, forced)
        if turn.state == "reasoning":  # a forced call skips the reasoning the template opened
            prefill = think[1] + "\n\n"
        prefill += opening
        turn.state, turn.call_prefix = "tool", opening[len(fmt.start):]
    turn.prompt = encode_raw(tokenizer, text + prefill, add_special_tokens=False)
    return turn


def _tool_param(messages: list[dict]) -> str:
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            return f"messages[{i}].tool_calls"
        if m["role"] == "tool":
            return f"messages[{i}].tool_call_id"
    return "messages"


def _template_kwargs(tokenizer: Any, req: p.ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    size = len(json.dumps(kwargs, separators=(",", ":")).encode())
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequest(f"chat_template_kwargs is {size} bytes of JSON; at most {MAX_TEMPLATE_KWARGS_BYTES} "
                             f"are accepted", param="chat_template_kwargs")
    clash = sorted(RESERVED_KWARGS & set(kwargs))
    if clash:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(clash)} (the server passes it)",
                             param="chat_template_kwargs")
    if req.reasoning_effort is not None:
        if "reasoning_effort" not in str(getattr(tokenizer, "chat_template", "") or ""):
            raise Unsupported("this checkpoint's chat template takes no reasoning_effort; leave it out",
                              param="reasoning_effort")
        kwargs["reasoning_effort"] = req.reasoning_effort
    return kwargs


def _message_dict(m: p.ChatMessage) -> dict:
    if isinstance(m.content, list):
        content = "".join(part.text for part in m.content)
    else:
        content = m.content or ""
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump(mode="json", exclude_none=True) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


class TurnOutput:
    """Generated text in, OpenAI deltas out (content, reasoning, tool calls with running indexes)."""

    def __init__(self, turn: Turn):
        self._turn = turn
        if turn.harmony is not None:
            self._split = hm.HarmonySplitter(turn.harmony, calls=turn.markers.tool is not None)
        else:
            self._split = MarkerSplitter(turn.markers, turn.state, turn.call_prefix)
        self._calls = 0
        self._forced = turn.forced

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> list[p.Delta]:
        return self._deltas(self._split.feed(text))

    def finish(self) -> list[p.Delta]:
        return self._deltas(self._split.finish())

    def finish_reason(self, reason: str) -> str:
        """``stop`` becomes ``tool_calls`` once a call was made (OpenAI's and mlx-lm's rule)."""
        return "tool_calls" if reason == "stop" and self.called else reason

    def _deltas(self, pieces: list) -> list[p.Delta]:
        out: list[p.Delta] = []
        for kind, text in pieces:
            if kind == "content":
                out.append(p.Delta(content=text))
            elif kind == "reasoning":
                out.append(p.Delta(reasoning_content=text, reasoning=text))
            else:
                out.extend(self._call_deltas(text))
        return out

    def _call_deltas(self, text: str) -> list[p.Delta]:
        fmt = self._turn.fmt
        calls = tc.parse_calls(fmt, text, self._turn.tools, self._forced) if fmt else []
        self._forced = None  # only the first call is forced
        out = []
        for call in calls:
            if self._calls and not self._turn.parallel:
                break
            head = p.ToolCallDelta(index=self._calls, id=call["id"], type="function",
                                   function=p.FunctionDelta(name=call["function"]["name"], arguments=""))
            args = p.ToolCallDelta(index=self._calls, function=p.FunctionDelta(arguments=call["function"]["arguments"]))
            out += [p.Delta(tool_calls=[head]), p.Delta(tool_calls=[args])]
            self._calls += 1
        return out


def join_deltas(deltas: list[p.Delta]) -> p.AssistantMessage:
    """The whole message the deltas stream (what the ``openai`` client reassembles)."""
    content, reasoning = [], []
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.content:
            content.append(d.content)
        if d.reasoning_content:
            reasoning.append(d.reasoning_content)
        for c in d.tool_calls or ():
            call = calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
            call["name"] += c.function.name or ""
            call["arguments"] += c.function.arguments or ""
    text = "".join(reasoning) or None
    tool_calls = [p.ToolCallOut(id=c["id"], function=p.FunctionCallOut(name=c["name"], arguments=c["arguments"]))
                  for _, c in sorted(calls.items())] or None
    return p.AssistantMessage(content="".join(content) if content or not tool_calls else None,
                              reasoning_content=text, reasoning=text, tool_calls=tool_calls)
