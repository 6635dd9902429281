"""The OpenAI surface refuses what it does not implement: a 400 naming the field, never a silent ignore.

Fields the official client sends by default, and values that ask for nothing (``tools: []``), still work.
"""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import completion_create_params as chat_params
from openai.types import completion_create_params as text_params

from mlxcel.server import protocol as p
from tests.server.util import MODEL, chat_body, sse_events

pytestmark = [pytest.mark.timeout(60), pytest.mark.proc]

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
# field -> a value that asks for something this server does not do
REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "best_of": 2,
    "echo": True,
    "function_call": "auto",
    "functions": [TOOL["function"]],
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "moderation": {"policy": {"input": {"mode": "block"}}},
    "n": 2,
    "prediction": {"type": "content", "content": "x"},
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "service_tier": "flex",
    "store": True,
    "suffix": "the end",
    "verbosity": "low",
    "web_search_options": {},
    # not OpenAI's at all (typos)
    "max_token": 5,
}
# chat-only nested fields: body changes -> the param the error must name
NESTED = {
    "message name": ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    "tool calls on a template without tools": (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
        "messages[1].tool_calls"),
    "tool result on a template without tools": (
        {"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, "messages[0].tool_call_id"),
    "strict tool": ({"tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}]},
                    "tools[0].function.strict"),
    "unknown message key": ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages[0].mood"),
    "text part key": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}]}]},
                      "messages[0].content[0].prompt_cache_breakpoint"),
    "obfuscation": ({"stream": True, "stream_options": {"include_obfuscation": True}},
                    "stream_options.include_obfuscation"),
    "unknown stream option": ({"stream": True, "stream_options": {"include_usage": True, "chunked": 1}},
                              "stream_options.chunked"),
}
ENDPOINTS = {"chat": ("/v1/chat/completions", chat_body()),
             "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi"})}


def refusal_of(r, param: str) -> dict:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_parameter"
    assert error["param"] == param and f"{param}" in error["message"]
    return error


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("field", REFUSED)
def test_every_unimplemented_field_is_refused_by_name(client, endpoint, field):
    path, body = ENDPOINTS[endpoint]
    refusal_of(client.post(path, json={**body, "max_tokens": 1, field: REFUSED[field]}), field)


@pytest.mark.parametrize("case", NESTED)
def test_nested_fields_are_refused_by_path(client, case):
    changes, param = NESTED[case]
    refusal_of(client.post("/v1/chat/completions", json={**chat_body(max_tokens=1), **changes}), param)


def test_messages_say_why(client):
    error = refusal_of(client.post("/v1/chat/completions", json=chat_body(tools=[TOOL])), "tools")
    assert "chat template knows no tools" in error["message"]  # tools themselves: tests/server/test_tools_api.py
    error = refusal_of(client.post("/v1/chat/completions", json=chat_body(reasoning_effort="low")), "reasoning_effort")
    assert error["message"] == "this checkpoint's chat template takes no reasoning_effort; leave it out"
    error = refusal_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "tools": [TOOL]}), "tools")
    assert error["message"] == "Unrecognized request argument supplied: tools"


def test_a_stream_is_refused_before_it_starts(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True, "echo": True})
    refusal_of(r, "echo")


NOOP_CHAT = {"tools": [], "tool_choice": "none", "functions": None, "function_call": "none", "logit_bias": {},
             "frequency_penalty": 0, "presence_penalty": 0.0, "n": 1, "response_format": {"type": "text"},
             "modalities": ["text"], "store": False, "metadata": {}, "parallel_tool_calls": True,
             "service_tier": "auto", "audio": None, "reasoning_effort": None, "web_search_options": None,
             "prompt_cache_retention": "in_memory", "user": "u1", "safety_identifier": "s1", "prompt_cache_key": "k"}
NOOP_TEXT = {"best_of": 1, "echo": False, "suffix": "", "logit_bias": None, "n": 1, "frequency_penalty": 0.0,
             "presence_penalty": 0, "user": "u1"}


def test_values_that_ask_for_nothing_are_accepted(client):
    messages = [{"role": "user", "content": "hi", "name": None},
                {"role": "assistant", "content": "yo", "refusal": None, "annotations": [], "tool_calls": [],
                 "audio": None, "function_call": None},
                {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    r = client.post("/v1/chat/completions", json={**chat_body(max_tokens=2), **NOOP_CHAT, "messages": messages})
    assert r.status_code == 200, r.text
    body = {**chat_body(max_tokens=2), **NOOP_CHAT, "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert sse_events(r)[-1] == "[DONE]"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **NOOP_TEXT})
    assert r.status_code == 200, r.text


def test_every_openai_parameter_is_classified():
    """Each parameter the official client can send is implemented or in a table: none is 'unrecognized'."""
    for request, params in ((p.ChatCompletionRequest, chat_params.CompletionCreateParamsStreaming),
                            (p.CompletionRequest, text_params.CompletionCreateParamsStreaming)):
        known = set(request.model_fields) | set(request.UNSUPPORTED)
        assert not (params.__required_keys__ | params.__optional_keys__) - known, request.__name__
        assert not set(request.model_fields) & set(request.UNSUPPORTED)


def test_official_client_works_and_sees_refusals(server):
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    try:
        past_eos = {"ignore_eos": True}  # the random tiny model may sample EOS first: a count of 0 is not a failure
        done = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, extra_body=past_eos)
        assert done.usage.completion_tokens >= 1
        again = oa.chat.completions.create(model=MODEL, max_tokens=3,  # the reply goes back as the client built it
                                           messages=[*messages, done.choices[0].message, {"role": "user", "content": "?"}])
        assert again.choices[0].finish_reason in ("length", "stop")
        chunks = list(oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=past_eos))
        assert chunks[-1].usage.completion_tokens >= 1
        assert list(oa.completions.create(model=MODEL, prompt="ab", max_tokens=2, stream=True))
        assert oa.completions.create(model=MODEL, prompt="ab", max_tokens=2,
                                     extra_body=past_eos).usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], stream=True)
        assert info.value.code == "unsupported_parameter" and info.value.param == "tools"
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(model=MODEL, messages=messages, response_format={"type": "json_schema"})
        assert info.value.param == "response_format"  # structured output is implemented; its bad input is a 400
    finally:
        oa.close()
