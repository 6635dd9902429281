"""OpenAI request and response schemas (pydantic), fields in the order of OpenAI's API reference.

Our extensions are fenced under "mlxcel extensions" in each request. Unknown
fields are ignored (clients such as LangChain send many); fields we know but
do not support are refused by the serving module when set to a non-default.
Numeric fields are strict: ``"max_tokens": "5"`` is a 400, as with OpenAI.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_serializer

Number = Union[StrictInt, StrictFloat]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: Optional[StrictBool] = False


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: Optional[StrictStr] = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    model: StrictStr
    frequency_penalty: Optional[Number] = 0
    logit_bias: Optional[dict[str, Number]] = None
    logprobs: Optional[StrictBool] = False
    max_completion_tokens: Optional[StrictInt] = None
    max_tokens: Optional[StrictInt] = None
    n: Optional[StrictInt] = 1
    presence_penalty: Optional[Number] = 0
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Number] = None
    top_logprobs: Optional[StrictInt] = None
    top_p: Optional[Number] = None
    user: Optional[StrictStr] = None
    # --- mlxcel extensions (vLLM spells them the same) ---
    top_k: Optional[StrictInt] = None  # sample from the k most likely tokens; 0 = off
    ignore_eos: Optional[StrictBool] = False  # keep generating past EOS (benchmarks: fixed lengths)


class CompletionRequest(_Request):
    model: StrictStr
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    best_of: Optional[StrictInt] = None
    echo: Optional[StrictBool] = False
    frequency_penalty: Optional[Number] = 0
    logit_bias: Optional[dict[str, Number]] = None
    logprobs: Optional[StrictInt] = None  # number of alternatives per token, 0-20
    max_tokens: Optional[StrictInt] = None
    n: Optional[StrictInt] = 1
    presence_penalty: Optional[Number] = 0
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    suffix: Optional[StrictStr] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    user: Optional[StrictStr] = None
    # --- mlxcel extensions ---
    top_k: Optional[StrictInt] = None
    ignore_eos: Optional[StrictBool] = False


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


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


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None

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
