"""Structured output at the front: ``response_format`` and forced tool calls as grammar text.

The grammar (``mlxcel.engine.grammar``) travels with the sampling parameters to wherever the token is
sampled; here it is built and compiled once against the served vocabulary, so an oversize schema or one
using a JSON Schema feature the grammar library does not implement is a 400 naming it, before anything is
queued. A forced call (``tool_choice`` ``required`` or a named function) of a family whose arguments are
JSON (``json_tools``, ``kimi_k2``, ``harmony``) is constrained after the prefilled opening: its arguments match the
tool's ``parameters`` schema, then the call closes and the answer ends.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from mlxcel.engine import grammar as g
from mlxcel.server import protocol as p
from mlxcel.server import tool_calls as tc
from mlxcel.server.chat_turn import Turn
from mlxcel.server.errors import InvalidRequest

#: family -> the text that closes a call's arguments (the grammar ends the answer there)
ARGUMENT_CLOSE = {"json_tools": "}", "kimi_k2": "", "harmony": ""}  # harmony's <|call|> is an end token
_ANY_OBJECT = {"type": "object"}


def request_grammar(tokenizer: Any, req: p.ChatCompletionRequest, turn: Turn) -> Optional[str]:
    """The grammar a chat completion's output must match (None: unconstrained); 400s name the field."""
    forced = _forced_call_grammar(turn)
    if forced is not None:
        return _compiled(tokenizer, forced, "tools")
    return format_grammar(tokenizer, req.response_format)


def format_grammar(tokenizer: Any, fmt: Optional[p.ResponseFormat]) -> Optional[str]:
    """The grammar of a ``response_format`` (chat and, as an extension, completions); None for text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _compiled(tokenizer, g.json_grammar(None), "response_format")
    if fmt.json_schema is None:
        raise InvalidRequest("response_format of type json_schema needs json_schema", param="response_format")
    schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else _ANY_OBJECT
    param = "response_format.json_schema.schema"
    _check_size(schema, param)
    return _compiled(tokenizer, g.json_grammar(schema), param)


def _forced_call_grammar(turn: Turn) -> Optional[str]:
    fmt = turn.fmt
    if turn.state != "tool" or fmt is None or fmt.family not in ARGUMENT_CLOSE:
        return None
    if turn.forced is None and fmt.family != "json_tools":  # a choice among calls: openings of plain text only
        return None
    chosen = [t for t in turn.tools if turn.forced is None or t["function"]["name"] == turn.forced]
    calls = []
    for i, tool in enumerate(chosen):
        schema = tool["function"].get("parameters") or {"type": "object", "properties": {}}
        _check_size(schema, f"tools[{i}].function.parameters")
        head = "" if turn.forced else tc.FORCED_OPENINGS[fmt.family].format(name=tool["function"]["name"])
        calls.append((head, json.dumps(schema)))
    return g.tool_call_grammar(calls, ARGUMENT_CLOSE[fmt.family])


def _check_size(schema: Any, param: str) -> None:
    size = len(json.dumps(schema, separators=(",", ":")).encode())
    if size > g.MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"{param} is {size} bytes of JSON; at most {g.MAX_GRAMMAR_BYTES} are accepted",
                             param=param)


def _compiled(tokenizer: Any, text: str, param: str) -> str:
    try:
        return g.check(text, name=param, source=tokenizer)
    except g.GrammarError as exc:
        raise InvalidRequest(str(exc), param=param) from None
