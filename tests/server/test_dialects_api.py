"""The Responses and Messages dialects through a real ``mlxcel serve`` and the official clients.

One server with an API key and a qwen3-style template (tools, ``<think>`` opened by the prompt). Random
weights never choose a tool, so calls are forced (tool_choice); reasoning comes from the opened think block.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from mlxcel.models.random_checkpoint import make_random_checkpoint
from tests.server.util import MODEL

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]

KEY = "dialects-test-key-0123456789abcdef"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
A_WEATHER = {"name": "get_weather", "description": "Weather of a city",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def srv(start_server, tmp_path_factory):
    model = make_random_checkpoint(tmp_path_factory.mktemp("dialects"), family="llama", layers=2, template="qwen3")
    return start_server(model, env={"MLXCEL_API_KEY": KEY})


@pytest.fixture
def oa(srv):
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture
def an(srv):
    with anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0) as c:
        yield c


# ------------------------------------------------------------------------------ Responses API


def reassemble_response(events) -> dict:
    """What a client rebuilds from the typed events: the final response, checked against the deltas."""
    events = list(events)
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(len(seqs)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    items: dict[int, dict] = {}
    for e in events:
        if e.type == "response.output_item.added":
            items[e.output_index] = {"type": e.item.type, "text": "", "arguments": ""}
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e.output_index]["text"] += e.delta
        elif e.type == "response.function_call_arguments.delta":
            items[e.output_index]["arguments"] += e.delta
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    for i, item in enumerate(final.response.output):
        got = items[i]
        if item.type == "function_call":
            assert got["arguments"] == item.arguments
        else:
            assert got["text"] == item.content[0].text
    return final.response.model_dump(exclude={"id", "created_at"})


def strip_ids(response: dict) -> dict:
    for item in response["output"]:
        item.pop("id", None)
        item.pop("call_id", None)
    return response


def test_responses_string_input_and_items(oa):
    done = oa.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=6, **GREEDY)
    assert done.object == "response" and done.id.startswith("resp_") and done.status == "incomplete"
    assert done.incomplete_details.reason == "max_output_tokens"
    [reasoning] = done.output  # the template opened <think>; random text never closes it
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert done.usage.output_tokens == 6 and done.usage.input_tokens > 0
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    same = oa.responses.create(model=MODEL, input=items, max_output_tokens=6, **GREEDY)
    assert same.output[0].content[0].text == reasoning.content[0].text
    off = oa.responses.create(model=MODEL, input="Weather in Paris?", max_output_tokens=4, **GREEDY,
                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [o.type for o in off.output] == ["message"] and off.output_text
    instructed = oa.responses.create(model=MODEL, input="Weather in Paris?", instructions="Be brief.",
                                     max_output_tokens=1, **GREEDY)
    assert instructed.usage.input_tokens > done.usage.input_tokens


def test_responses_forced_call_round_trip(oa):
    kw = dict(model=MODEL, tools=[WEATHER], max_output_tokens=8, **GREEDY)
    done = oa.responses.create(input="Weather in Paris?", tool_choice={"type": "function", "name": "get_weather"},
                               **kw)
    [call] = [o for o in done.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp_c": 21})}]
    answer = oa.responses.create(input=follow, tool_choice="none", **kw)
    assert not [o for o in answer.output if o.type == "function_call"]
    assert answer.usage.input_tokens > done.usage.input_tokens  # the call and its result were rendered
    required = oa.responses.create(input="Weather in Paris?", tool_choice="required", **kw)
    assert [o.name for o in required.output if o.type == "function_call"] == ["get_weather"]


def test_responses_stream_reassembles_to_the_whole_response(oa):
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "required"},
                  {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
        kw = dict(model=MODEL, input="Weather in Paris?", max_output_tokens=6, **GREEDY, **extra)
        streamed = reassemble_response(oa.responses.create(stream=True, **kw))
        whole = oa.responses.create(**kw).model_dump(exclude={"id", "created_at"})
        assert strip_ids(streamed) == strip_ids(whole)


def test_responses_store_and_previous_response_id(oa, srv):
    kw = dict(model=MODEL, max_output_tokens=2, **GREEDY)
    first = oa.responses.create(input="Weather in Paris?", **kw)
    assert oa.responses.retrieve(first.id).id == first.id
    second = oa.responses.create(input="And in Rome?", previous_response_id=first.id, **kw)
    alone = oa.responses.create(input="And in Rome?", **kw)
    assert second.usage.input_tokens > alone.usage.input_tokens  # the first turn was rendered before it
    assert second.previous_response_id == first.id
    unstored = oa.responses.create(input="Hi", store=False, **kw)
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(input="x", previous_response_id=unstored.id, **kw)
    assert err.value.body["param"] == "previous_response_id" and "not found" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve(unstored.id)
    oa.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError):
        oa.responses.create(input="x", previous_response_id=first.id, **kw)


def responses_bad(srv, param: str, status: int = 400, **body) -> dict:
    r = httpx.post(f"{srv.url}/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error


def test_responses_errors_name_the_field(srv):
    assert "bogus" in responses_bad(srv, "bogus", bogus=1)["message"]
    responses_bad(srv, "background", background=True)
    responses_bad(srv, "truncation", truncation="auto")
    responses_bad(srv, "tools[0].strict", tools=[{**WEATHER, "strict": True}])
    responses_bad(srv, "tools[0].type", tools=[{"type": "web_search"}])
    responses_bad(srv, "text.verbosity", text={"verbosity": "low"})
    responses_bad(srv, "reasoning.effort", reasoning={"effort": "high"})  # this template takes none
    responses_bad(srv, "max_output_tokens", max_output_tokens=0)
    assert "no item" in responses_bad(srv, "input", input=[])["message"]  # nothing to answer: a 400, not a 500
    stray = [{"type": "function_call_output", "call_id": "call_never", "output": "x"}]
    assert "no function_call" in responses_bad(srv, "input[0].call_id", input=stray)["message"]
    responses_bad(srv, "tool_choice", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"})
    responses_bad(srv, "model", status=404, model="other")
    # json_schema travels to the internal request's constraint: the grammar guarantees the output
    fmt = {"type": "json_schema", "name": "w", "strict": True,
           "schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
                      "required": ["city"], "additionalProperties": False}}
    r = httpx.post(f"{srv.url}/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 24, "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    message = [item for item in r.json()["output"] if item["type"] == "message"][0]
    assert set(json.loads(message["content"][0]["text"])) == {"city"}
    bad = dict(fmt, schema={"type": "array", "uniqueItems": True})
    error = responses_bad(srv, "text.format.schema", input="hi", text={"format": bad})
    assert error["message"].startswith("text.format.schema does not compile") and "uniqueItems" in error["message"]


# ------------------------------------------------------------------------------ Anthropic Messages API

ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_messages_forced_tool_round_trip(an):
    kw = dict(model=MODEL, max_tokens=8, tools=[A_WEATHER], extra_body=GREEDY)
    done = an.messages.create(messages=ASK, tool_choice={"type": "tool", "name": "get_weather"}, **kw)
    assert done.type == "message" and done.role == "assistant" and done.stop_reason in ("tool_use", "max_tokens")
    [use] = [b for b in done.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict)
    follow = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in done.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                                           {"type": "text", "text": "Thanks"}]}]
    answer = an.messages.create(messages=follow, tool_choice={"type": "none"}, **kw)
    assert not [b for b in answer.content if b.type == "tool_use"]
    assert answer.usage.input_tokens > done.usage.input_tokens
    anyone = an.messages.create(messages=ASK, tool_choice={"type": "any"}, **kw)
    assert [b.name for b in anyone.content if b.type == "tool_use"] == ["get_weather"]


def without_ids(message) -> dict:
    out = message.model_dump(exclude={"id"})
    for block in out["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    return out


def test_messages_stream_equals_whole_and_thinking_blocks(an):
    for extra in ({}, {"tools": [A_WEATHER], "tool_choice": {"type": "any"}},
                  {"thinking": {"type": "disabled"}}, {"system": [{"type": "text", "text": "Be brief.",
                                                                   "cache_control": {"type": "ephemeral"}}]}):
        kw = dict(model=MODEL, max_tokens=6, messages=ASK, extra_body=GREEDY, **extra)
        with an.messages.stream(**kw) as stream:
            streamed = stream.get_final_message()
        whole = an.messages.create(**kw)
        assert without_ids(streamed) == without_ids(whole)
    thought = an.messages.create(model=MODEL, max_tokens=6, messages=ASK, extra_body=GREEDY,
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert thought.content[0].type == "thinking" and thought.content[0].thinking
    assert thought.stop_reason == "max_tokens" and thought.usage.output_tokens == 6
    off = an.messages.create(model=MODEL, max_tokens=4, messages=ASK, extra_body=GREEDY,
                             thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]


def test_messages_stop_sequence_is_named(an):
    off = {"type": "disabled"}
    text = an.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY, thinking=off)
    word = text.content[0].text[2:5]
    assert word.strip(), text.content[0].text
    stopped = an.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY, thinking=off,
                                 stop_sequences=["zzzz-never", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text.content[0].text[:text.content[0].text.index(word)]


def test_count_tokens_matches_usage(an):
    counted = an.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.", tools=[A_WEATHER])
    used = an.messages.create(model=MODEL, max_tokens=1, messages=ASK, system="Be brief.", tools=[A_WEATHER],
                              extra_body=GREEDY)
    assert counted.input_tokens == used.usage.input_tokens > 0


def messages_bad(srv, status: int = 400, headers: dict | None = None, **body) -> dict:
    r = httpx.post(f"{srv.url}/v1/messages", json={"model": MODEL, "messages": ASK, "max_tokens": 1, **body},
                   headers={"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})}, timeout=30)
    assert r.status_code == status, r.text
    out = r.json()
    assert out["type"] == "error" and set(out["error"]) == {"type", "message"}, out
    return out["error"]


def test_messages_errors_in_anthropic_shape(srv):
    err = messages_bad(srv, bogus=1)
    assert err["type"] == "invalid_request_error" and "bogus" in err["message"]
    r = httpx.post(f"{srv.url}/v1/messages", json={"model": MODEL, "messages": ASK},
                   headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert "stray" in messages_bad(srv, messages=[*ASK, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "stray", "content": "x"}]}])["message"]
    assert "tool_choice" in messages_bad(srv, tools=[A_WEATHER], tool_choice={"type": "tool", "name": "no"})["message"]
    assert "service_tier" in messages_bad(srv, service_tier="priority")["message"]
    assert "messages" in messages_bad(srv, messages=[])["message"]  # nothing to answer: a 400, not a 500
    assert "messages" in messages_bad(srv, system="be brief", messages=[])["message"]
    assert messages_bad(srv, 404, model="claude-x")["type"] == "not_found_error"
    for headers in ({"x-api-key": "wrong"}, {"x-api-key": ""}):
        assert messages_bad(srv, 401, headers=headers)["type"] == "authentication_error"
    r = httpx.post(f"{srv.url}/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in messages_bad(srv, 401, headers={"x-api-key": ""})["message"]
    bearer = httpx.post(f"{srv.url}/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    # the OpenAI routes keep OpenAI's shape and take the key only as Authorization: Bearer
    r = httpx.post(f"{srv.url}/v1/responses", json={"model": MODEL, "input": "x"}, headers={"x-api-key": KEY},
                   timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_client_auth_errors(srv):
    with anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model=MODEL, max_tokens=1, messages=ASK)
    with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.responses.create(model=MODEL, input="x", max_output_tokens=1)


def test_max_tokens_beyond_the_context_is_a_ceiling_in_both_dialects(an, oa):
    """Claude Code asks for max_tokens 32000 and Codex for large max_output_tokens whatever the model: both are
    upper bounds in their APIs, so one beyond what the context leaves after the prompt is lowered to it (chat
    completions keep OpenAI's 400)."""
    long = [{"role": "user", "content": "x " * 1000}]  # about 2,000 of the model's 2,048 tokens
    counted = an.messages.count_tokens(model=MODEL, messages=long, thinking={"type": "disabled"}).input_tokens
    left = 2048 - counted
    assert 0 < left < 64, counted
    done = an.with_options(timeout=60).messages.create(model=MODEL, max_tokens=32000, messages=long, extra_body={**GREEDY, "ignore_eos": True},
                              thinking={"type": "disabled"})
    assert done.usage.input_tokens == counted and done.usage.output_tokens == left
    assert done.stop_reason == "max_tokens"
    reply = oa.responses.create(model=MODEL, input="x " * 1000, max_output_tokens=32000,
                                extra_body={**GREEDY, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert reply.status == "incomplete" and reply.usage.output_tokens == 2048 - reply.usage.input_tokens
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model=MODEL, messages=long, max_tokens=32000)
