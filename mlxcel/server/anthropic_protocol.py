"""Anthropic Messages API request schemas (``POST /v1/messages`` and ``/v1/messages/count_tokens``).

Same rules as protocol.py: declared fields are implemented; ``UNSUPPORTED`` lists Anthropic fields we do
not implement with the values that ask for nothing more (null always counts); any other value, and any
field Anthropic does not define, is a 400 naming it (docs/server.md, "Anthropic Messages API").
``cache_control`` is accepted everywhere Anthropic allows it: the prefix cache is automatic here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, StrictBool, StrictStr, StringConstraints, Tag

from mlxcel.server.protocol import FunctionName, Number, StrictInt, _Request

BlockId = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=256)]


class CacheControl(_Request):
    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None  # accepted, no effect: the prefix cache needs no marks


class TextBlock(_Request):
    type: Literal["text"]
    text: StrictStr
    cache_control: Optional[CacheControl] = None
    UNSUPPORTED = {"citations": ([],)}


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: BlockId
    name: FunctionName
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: BlockId
    content: Union[StrictStr, list[TextBlock], None] = None
    is_error: Optional[StrictBool] = None  # rendered like any result: templates have no error mark
    cache_control: Optional[CacheControl] = None


class ThinkingBlock(_Request):
    """An assistant's thinking sent back: accepted; templates drop earlier turns' reasoning, and so do we."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: Optional[StrictStr] = None
    cache_control: Optional[CacheControl] = None


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: StrictStr


def _block_type(value: Any) -> str:
    return value.get("type", "") if isinstance(value, dict) else getattr(value, "type", "")


Block = Annotated[
    Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
          Annotated[ToolResultBlock, Tag("tool_result")], Annotated[ThinkingBlock, Tag("thinking")],
          Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]],
    Discriminator(_block_type)]


class Message(_Request):
    role: Literal["user", "assistant"]
    content: Union[StrictStr, list[Block]]


class Tool(_Request):
    type: Optional[Literal["custom"]] = None
    name: FunctionName
    description: Optional[StrictStr] = None
    input_schema: dict[str, Any]
    cache_control: Optional[CacheControl] = None
    UNSUPPORTED = {"strict": (False,), "defer_loading": (False,), "eager_input_streaming": (False,),
                   "input_examples": ([],), "allowed_callers": (["direct"],)}


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[FunctionName] = None  # type "tool"
    disable_parallel_tool_use: Optional[StrictBool] = None


class Thinking(_Request):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[StrictInt] = None  # accepted, not enforced: the template switches thinking on/off
    UNSUPPORTED = {"display": ("summarized",)}


class Metadata(_Request):
    user_id: Optional[Annotated[str, StringConstraints(strict=True, max_length=256)]] = None  # no effect


class _Common(_Request):
    """Fields shared by a message request and a token count."""

    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    system: Union[StrictStr, list[TextBlock], None] = None
    thinking: Optional[Thinking] = None
    tool_choice: Optional[ToolChoice] = None
    tools: Optional[list[Tool]] = None


class MessagesRequest(_Common):
    max_tokens: StrictInt
    metadata: Optional[Metadata] = None
    stop_sequences: Optional[list[StrictStr]] = None
    stream: Optional[StrictBool] = False
    temperature: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    top_p: Optional[Number] = None
    # --- mlxcel extensions ---
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    ignore_eos: Optional[StrictBool] = False  # keep generating past EOS (benchmarks: fixed lengths)
    chat_template_kwargs: Optional[dict[str, Any]] = None

    UNSUPPORTED = {"service_tier": ("auto", "standard_only"), "container": (), "mcp_servers": ([],),
                   "context_management": (), "output_config": (), "inference_geo": (), "speed": ("standard",)}


class CountTokensRequest(_Common):
    chat_template_kwargs: Optional[dict[str, Any]] = None
    UNSUPPORTED = {"context_management": (), "output_config": (), "mcp_servers": ([],)}
