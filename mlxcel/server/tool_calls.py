"""Tool calls at the front: which format the checkpoint speaks, forcing a call, parsing calls back.

The format is mlx-lm's: ``TokenizerWrapper`` infers a parser module from the chat template
(``mlx_lm.tool_parsers.<family>``, with its ``tool_call_start``/``tool_call_end`` markers); we only
wrap it. A forced call (``tool_choice: "required"`` or a named function) prefills the assistant turn
with the family's call opening (``FORCED_OPENINGS``), so the model continues inside a call. gpt-oss's
Harmony format, which mlx-lm does not read, is ``harmony``'s (family ``harmony``).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mlxcel.server import harmony
from mlxcel.server.errors import InvalidRequest, Unsupported

log = logging.getLogger("mlxcel.server")

#: parser family -> the text that opens a call to ``{name}`` (after the start marker); families not listed
#: support ``tool_choice`` none/auto only
FORCED_OPENINGS = {
    "json_tools": '\n{{"name": "{name}", "arguments": ',
    "qwen3_coder": "\n<function={name}>\n",
    "glm47": "{name}",
    "kimi_k2": "<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
    "minimax_m2": '\n<invoke name="{name}">\n',
    "harmony": harmony.CALL_HEAD.format(recipient="functions.{name}"),
}


@dataclass(frozen=True)
class ToolFormat:
    """How one checkpoint writes tool calls (mlx-lm's parser and markers)."""

    family: str
    parse: Callable[..., Any]
    start: str
    end: str


def tool_format(tokenizer: Any) -> Optional[ToolFormat]:
    """The checkpoint's tool-call format as mlx-lm inferred it, or None when its template knows no tools."""
    parse = getattr(tokenizer, "tool_parser", None)
    start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
    if parse is None or not start or not end:
        return None
    return ToolFormat(parse.__module__.rsplit(".", 1)[-1], parse, start, end)


#: gpt-oss's calls: no start marker (a call is a message to ``functions.NAME``), ended by ``<|call|>``
HARMONY = ToolFormat("harmony", harmony.parse_tool_call, "", "<|call|>")


def require_format(tokenizer: Any, param: str) -> ToolFormat:
    """The tool format, or a 400 naming ``param`` that says why this checkpoint takes no tools."""
    if harmony.is_harmony(tokenizer):
        return HARMONY
    fmt = tool_format(tokenizer)
    if fmt is None:
        raise Unsupported(f"'{param}': this checkpoint's chat template knows no tools (mlx-lm infers no tool-call "
                          "format from it), so it cannot take tools or tool calls", param=param)
    return fmt


def forced_opening(fmt: ToolFormat, name: Optional[str]) -> str:
    """The assistant-turn prefill of a forced call: the start marker, and the opening of ``name``'s call."""
    opening = FORCED_OPENINGS.get(fmt.family)
    if opening is None:
        raise Unsupported(f"tool_choice 'required' or a named function is not supported for this checkpoint's "
                          f"tool-call format ({fmt.family}); use 'auto'", param="tool_choice")
    if fmt is HARMONY:
        return harmony.forced_prefill(name)
    return fmt.start + (opening.format(name=name) if name else "")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_calls(fmt: ToolFormat, text: str, tools: list[dict], forced: Optional[str]) -> list[dict]:
    """One call text (between the markers) -> OpenAI tool calls ``{id, type, function: {name, arguments}}``.

    A text the parser cannot read yields nothing, except in a call forced to ``forced``: then the call
    keeps that name and the model's text after the opening as its arguments (not yet valid JSON for sure).
    """
    try:
        parsed = fmt.parse(text, tools)
    except Exception as exc:  # the parsers raise ValueError, JSONDecodeError, KeyError, ... on bad text
        log.warning("could not parse a %s tool call (%s)", fmt.family, type(exc).__name__)
        parsed = []
    calls = parsed if isinstance(parsed, list) else [parsed]
    calls = [c for c in calls if isinstance(c, dict) and isinstance(c.get("name"), str)]
    if forced and not any(c["name"] == forced for c in calls):
        head = FORCED_OPENINGS[fmt.family].format(name=forced)
        raw = text[len(head):] if text.startswith(head) else text
        return [_openai_call(None, forced, raw.strip())]
    return [_openai_call(c.get("id"), c["name"], c.get("arguments", {})) for c in calls]


def _openai_call(call_id: Any, name: str, arguments: Any) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    cid = call_id if isinstance(call_id, str) and call_id else new_call_id()
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def template_message(message: dict) -> dict:
    """An assistant message's tool calls as templates expect them: arguments as objects where they parse."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call["function"])
        try:
            loaded = json.loads(fn["arguments"])
        except ValueError:
            loaded = None
        if isinstance(loaded, dict):
            fn["arguments"] = loaded
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}


def check_conversation(messages: list[dict]) -> None:
    """Each tool message answers a call issued earlier in the conversation (400 naming the field)."""
    issued: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or ():
            issued.add(call["id"])
        if m["role"] != "tool":
            continue
        cid = m.get("tool_call_id")
        if cid is None:
            raise InvalidRequest(f"messages[{i}].tool_call_id is required in a tool message",
                                 param=f"messages[{i}].tool_call_id")
        if cid not in issued:
            raise InvalidRequest(f"messages[{i}].tool_call_id '{cid}' answers no tool call issued earlier in "
                                 f"the conversation", param=f"messages[{i}].tool_call_id")


def check_tools(tools: list[dict], choice: Any) -> Optional[str]:
    """Unique tool names; the named ``tool_choice`` must be one of them. Returns the forced name, if any."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise InvalidRequest(f"tools[{i}].function.name '{name}' is declared twice",
                                 param=f"tools[{i}].function.name")
        seen.add(name)
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in seen:
            raise InvalidRequest(f"tool_choice names the function '{name}', which is not in tools",
                                 param="tool_choice")
        return name
    if choice in ("required",) and not tools:
        raise InvalidRequest("tool_choice 'required' needs at least one tool in tools", param="tool_choice")
    return None
