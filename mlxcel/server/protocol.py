"""OpenAI request and response schemas (pydantic), fields in the order of OpenAI's API reference.

Our extensions are fenced under "mlxcel extensions" in each request. The
surface refuses what it does not implement: declared fields are implemented;
each request object's ``UNSUPPORTED`` table lists the OpenAI fields we do not
implement with the values that ask for nothing beyond what we do anyway (null
always counts); any other value of those, and any field OpenAI does not define,
is a 400 naming the field (``refusal``; docs/server.md, "Parameters").
Numeric fields are strict: ``"max_tokens": "5"`` is a 400, as with OpenAI.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Iterator, Literal, NamedTuple, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, StringConstraints,
                      model_serializer)

Number = Union[StrictInt, StrictFloat]


class Refusal(NamedTuple):
    """A field the server refuses: ``param`` as OpenAI spells it (``messages[0].tool_calls``)."""

    param: str
    message: str


class _Request(BaseModel):
    """A request object; undeclared fields are kept (``extra="allow"``) so that ``refusal`` can name them."""

    model_config = ConfigDict(extra="allow")
    # OpenAI field we do not implement -> the values accepted because they ask for nothing (null: always)
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def refusal(self, path: str = "") -> Optional[Refusal]:
        """The first field of this object, or of the objects inside it, that the server refuses."""
        for name, value in (self.model_extra or {}).items():
            param = f"{path}.{name}" if path else name
            if name not in self.UNSUPPORTED:
                return Refusal(param, f"Unrecognized request argument supplied: {param}")
            accepted = (None, *self.UNSUPPORTED[name])
            if not any(_same(value, ok) for ok in accepted):
                shown = " or ".join(json.dumps(ok) for ok in accepted)
                return Refusal(param, f"'{param}' is not supported by this server; leave it out or send {shown}")
        for name in type(self).model_fields:
            for child_path, child in _children(getattr(self, name), f"{path}.{name}" if path else name):
                found = child.refusal(child_path)
                if found:
                    return found
        return None


def _same(value: Any, accepted: Any) -> bool:
    """JSON equality where true is not 1 and false is not 0 (0 and 0.0 stay equal)."""
    return isinstance(value, bool) == isinstance(accepted, bool) and value == accepted


def _children(value: Any, path: str) -> Iterator[tuple[str, _Request]]:
    if isinstance(value, _Request):
        yield path, value
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, _Request):
                yield f"{path}[{i}]", item


class StreamOptions(_Request):
    include_usage: Optional[StrictBool] = False
    UNSUPPORTED = {"include_obfuscation": (False,)}  # we add no padding field to chunks


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr
    UNSUPPORTED = {"prompt_cache_breakpoint": ()}


FunctionName = Annotated[str, StringConstraints(strict=True, pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionCall(_Request):
    name: FunctionName
    arguments: StrictStr  # JSON text, as the model wrote it


class ToolCall(_Request):
    id: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=256)]
    type: Literal["function"]
    function: FunctionCall


class FunctionDefinition(_Request):
    name: FunctionName
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema, rendered by the chat template
    UNSUPPORTED = {"strict": (False,)}  # schema-exact arguments need constrained decoding


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class JsonSchemaFormat(_Request):
    name: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")  # the output's JSON Schema
    strict: Optional[StrictBool] = None  # the output always matches the schema (constrained decoding)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None  # assistant messages
    tool_call_id: Optional[Annotated[str, StringConstraints(strict=True, max_length=256)]] = None  # tool messages
    # name: chat templates do not render it; the rest: audio, refusals. Echoed assistant
    # messages (the openai client's ChatCompletionMessage) carry "refusal": null, "annotations": [].
    UNSUPPORTED = {"name": (), "audio": (), "function_call": (), "refusal": (), "annotations": ([],)}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    model: StrictStr
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[dict[str, Any]] = None  # token id -> bias; checked by serving (count first)
    logprobs: Optional[StrictBool] = False
    max_completion_tokens: Optional[StrictInt] = None
    max_tokens: Optional[StrictInt] = None
    presence_penalty: Optional[Number] = None
    prompt_cache_key: Optional[StrictStr] = None  # accepted, no effect: our prefix cache needs no key
    safety_identifier: Optional[StrictStr] = None  # accepted, no effect: no abuse monitoring here
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Number] = None
    top_logprobs: Optional[StrictInt] = None
    top_p: Optional[Number] = None
    user: Optional[StrictStr] = None  # accepted, no effect (as safety_identifier)
    # --- mlxcel extensions (vLLM spells them the same) ---
    parallel_tool_calls: Optional[StrictBool] = True
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    response_format: Optional[ResponseFormat] = None  # text, json_object, json_schema (constrained decoding)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    tools: Optional[list[Tool]] = None
    # --- mlxcel extensions (vLLM spells them the same) ---
    top_k: Optional[StrictInt] = None  # sample from the k most likely tokens; 0 = off
    min_p: Optional[Number] = None  # drop tokens below min_p x the top probability; 0 = off
    repetition_penalty: Optional[Number] = None  # mlx-lm's multiplicative penalty; 1 = off
    ignore_eos: Optional[StrictBool] = False  # keep generating past EOS (benchmarks: fixed lengths)
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra variables for the chat template

    UNSUPPORTED = {
        "audio": (),
        "function_call": ("none",),
        "functions": ([],),
        "metadata": ({},),  # only useful with store
        "modalities": (["text"],),
        "moderation": (),
        "n": (1,),
        "prediction": (),
        "prompt_cache_options": (),
        "prompt_cache_retention": ("in_memory",),  # a maximum: our prefix cache lives in memory
        "service_tier": ("auto", "default"),
        "store": (False,),
        "verbosity": (),
        "web_search_options": (),  # {} turns web search on
    }


class CompletionRequest(_Request):
    model: StrictStr
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[dict[str, Any]] = None
    logprobs: Optional[StrictInt] = None  # number of alternatives per token, 0-20
    max_tokens: Optional[StrictInt] = None
    presence_penalty: Optional[Number] = None
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    user: Optional[StrictStr] = None  # accepted, no effect
    # --- mlxcel extensions ---
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    repetition_penalty: Optional[Number] = None
    ignore_eos: Optional[StrictBool] = False
    response_format: Optional[ResponseFormat] = None  # extension: the completion matches it (constrained)

    UNSUPPORTED = {
        "best_of": (1,),
        "echo": (False,),
        "n": (1,),
        "suffix": ("",),
    }


# ---------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # the text between the think markers (vLLM's name)
    reasoning: Optional[str] = None  # the same text, under mlx_lm.server's name
    tool_calls: Optional[list[ToolCallOut]] = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict:
        """content is always sent (null with only tool calls); the other fields only when present."""
        out = handler(self)
        return {k: v for k, v in out.items() if v is not None or k == "content"}


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: Optional[str] = None


class FunctionDelta(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict:
        """OpenAI sends only the fields a delta changes: {"content": "..."}, and {} at the end."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlxcel"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model (None fields kept, as OpenAI sends them)."""
    return model.model_dump(mode="json")
