"""OpenAI Responses API request schemas (``POST /v1/responses``), fields in the order of OpenAI's reference.

Same rules as protocol.py: declared fields are implemented; each object's ``UNSUPPORTED`` table lists the
OpenAI fields we do not implement with the values that ask for nothing more (null always counts); any other
value, and any field OpenAI does not define, is a 400 naming it (docs/server.md, "Responses API").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Discriminator, Field, StrictBool, StrictStr, StringConstraints, Tag

from mlxcel.server.protocol import FunctionName, Number, StrictInt, _Request

CallId = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=256)]


class InputText(_Request):
    """A text part: input_text (user, system, developer) or output_text (an assistant message sent back)."""

    type: Literal["input_text", "output_text"]
    text: StrictStr
    UNSUPPORTED = {"annotations": ([],), "logprobs": ([],), "prompt_cache_breakpoint": ()}


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[StrictStr, list[InputText]]
    id: Optional[StrictStr] = None  # an output message sent back: its id and status are ignored
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    UNSUPPORTED = {"phase": ("commentary", "final_answer")}


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: CallId
    name: FunctionName
    arguments: StrictStr
    id: Optional[StrictStr] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None
    UNSUPPORTED = {"namespace": (), "caller": ()}


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: CallId
    output: Union[StrictStr, list[InputText]]
    id: Optional[StrictStr] = None
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


class ReasoningText(_Request):
    type: Literal["reasoning_text", "summary_text"]
    text: StrictStr


class ReasoningItem(_Request):
    """A reasoning item sent back: accepted; chat templates drop earlier turns' reasoning, and so do we."""

    type: Literal["reasoning"]
    id: Optional[StrictStr] = None
    summary: list[ReasoningText] = []
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[StrictStr] = None  # never issued by this server; ignored
    status: Optional[Literal["in_progress", "completed", "incomplete"]] = None


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")]],
    Discriminator(_item_type)]


class FunctionTool(_Request):
    """Responses' flat function tool: ``{"type": "function", "name", "description", "parameters"}``."""

    type: Literal["function"]
    name: FunctionName
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    UNSUPPORTED = {"strict": (False,), "defer_loading": (False,), "allowed_callers": (["direct"],),
                   "output_schema": ()}


class FunctionChoice(_Request):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[StrictStr] = None  # json_schema
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[StrictStr] = None
    strict: Optional[StrictBool] = None


class TextConfig(_Request):
    format: Optional[TextFormat] = None
    UNSUPPORTED = {"verbosity": ()}


class ReasoningConfig(_Request):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    # no summaries are written; "auto" and "concise"/"detailed" ask for one where the model makes it
    UNSUPPORTED = {"summary": ("auto",), "generate_summary": ("auto",)}


class StreamOptions(_Request):
    UNSUPPORTED = {"include_obfuscation": (False,)}


class ResponsesRequest(_Request):
    model: StrictStr
    input: Union[StrictStr, list[InputItem]]
    include: Optional[list[Literal["reasoning.encrypted_content"]]] = None  # accepted: reasoning comes as text
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[StrictInt] = None
    metadata: Optional[dict[StrictStr, StrictStr]] = None  # echoed in the response
    parallel_tool_calls: Optional[StrictBool] = True
    previous_response_id: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None  # accepted, no effect: our prefix cache needs no key
    reasoning: Optional[ReasoningConfig] = None
    safety_identifier: Optional[StrictStr] = None  # accepted, no effect
    store: Optional[StrictBool] = True
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Number] = None
    text: Optional[TextConfig] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, None] = None
    tools: Optional[list[FunctionTool]] = None
    top_p: Optional[Number] = None
    user: Optional[StrictStr] = None  # accepted, no effect
    # --- mlxcel extensions (vLLM spells them the same) ---
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    ignore_eos: Optional[StrictBool] = False  # keep generating past EOS (benchmarks: fixed lengths)
    chat_template_kwargs: Optional[dict[str, Any]] = None

    UNSUPPORTED = {
        "background": (False,),
        "conversation": (),
        "max_tool_calls": (),
        "prompt": (),
        "prompt_cache_retention": ("in_memory",),
        "service_tier": ("auto", "default"),
        "top_logprobs": (0,),
        "truncation": ("disabled",),
    }
