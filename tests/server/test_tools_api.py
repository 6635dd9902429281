"""Tool calls and reasoning through a real ``mlxcel serve`` and the official ``openai`` client.

Random weights never choose to call a tool, so calls are forced with ``tool_choice`` (the assistant turn
is prefilled with the family's call opening); reasoning comes from a template that opens ``<think>``.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mlxcel.models.random_checkpoint import make_random_checkpoint
from tests.server.util import MODEL

pytestmark = [pytest.mark.timeout(120), pytest.mark.proc]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def qwen3_server(start_server, tmp_path_factory):
    model = make_random_checkpoint(tmp_path_factory.mktemp("tools-qwen3"), family="llama", layers=2,
                                   template="qwen3")
    return start_server(model)


@pytest.fixture(scope="module")
def glm_server(start_server, tmp_path_factory):
    model = make_random_checkpoint(tmp_path_factory.mktemp("tools-glm"), family="llama", layers=2,
                                   template="glm47")
    return start_server(model)


@pytest.fixture
def oa(qwen3_server):
    with openai.OpenAI(base_url=f"{qwen3_server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def reassemble(chunks) -> dict:
    """What a client builds from the stream: content, reasoning, tool calls by index, the finish reason."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        out["content"] += d.content or ""
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        for c in d.tool_calls or ():
            call = out["calls"].setdefault(c.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or c.id
            call["name"] += (c.function.name or "") if c.function else ""
            call["arguments"] += (c.function.arguments or "") if c.function else ""
        out["finish"] = ch.choices[0].finish_reason or out["finish"]
    return out


def whole(done) -> dict:
    m = done.choices[0].message
    calls = {i: {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for i, c in enumerate(m.tool_calls or ())}
    return {"content": m.content or "", "reasoning": (m.model_extra or {}).get("reasoning_content") or "",
            "calls": calls, "finish": done.choices[0].finish_reason}


def without_ids(out: dict) -> dict:
    return {**out, "calls": {i: {**c, "id": None} for i, c in out["calls"].items()}}


def test_forced_tool_round_trip(oa):
    """The model calls the named function; the client sends the result back; the model answers."""
    kw = dict(model=MODEL, tools=[WEATHER, TIME], temperature=0, max_tokens=8)
    done = oa.chat.completions.create(messages=ASK, tool_choice=NAMED, **kw)
    [call] = done.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert done.choices[0].message.content is None
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}
    answer = oa.chat.completions.create(messages=[*ASK, done.choices[0].message, result], tool_choice="none", **kw)
    assert answer.choices[0].message.tool_calls is None and answer.usage.completion_tokens >= 1
    assert answer.usage.prompt_tokens > done.usage.prompt_tokens  # the call and its result were rendered


def test_streamed_tool_calls_join_to_the_whole_answer(oa):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=8)
    for choice in (NAMED, "required"):
        streamed = reassemble(oa.chat.completions.create(stream=True, tool_choice=choice, **kw))
        done = whole(oa.chat.completions.create(tool_choice=choice, **kw))
        assert streamed["calls"][0]["name"] == "get_weather" and streamed["calls"][0]["id"]
        assert without_ids(streamed) == without_ids(done)


def test_stream_deltas_have_openai_shape(qwen3_server):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": NAMED, "max_tokens": 4,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{qwen3_server.url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    calls = [e["choices"][0]["delta"]["tool_calls"][0] for e in events if "tool_calls" in e["choices"][0]["delta"]]
    assert set(calls[0]) == {"index", "id", "type", "function"} and calls[0]["function"]["name"] == "get_weather"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert events[-1]["choices"][0]["finish_reason"] in ("tool_calls", "length")


def test_reasoning_is_split_streamed_and_whole(oa):
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=6)
    done = whole(oa.chat.completions.create(**kw))
    assert done["reasoning"] and done["content"] == ""  # the template opened <think>; random text never closes it
    assert reassemble(oa.chat.completions.create(stream=True, **kw)) == {**done, "finish": done["finish"]}
    raw = oa.chat.completions.create(**kw).choices[0].message.model_extra
    assert raw["reasoning"] == raw["reasoning_content"]
    off = whole(oa.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw))
    assert off["reasoning"] == "" and off["content"]


def test_glm_family_forced_round_trip(glm_server):
    with openai.OpenAI(base_url=f"{glm_server.url}/v1", api_key="unused", max_retries=0) as oa:
        kw = dict(model=MODEL, tools=[WEATHER], temperature=0, max_tokens=6)
        done = oa.chat.completions.create(messages=ASK, tool_choice="required", **kw)
        [call] = done.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
        answer = oa.chat.completions.create(messages=[*ASK, done.choices[0].message, result], **kw)
        assert answer.usage.completion_tokens >= 1
        streamed = reassemble(oa.chat.completions.create(messages=ASK, tool_choice="required", stream=True, **kw))
        assert without_ids(streamed) == without_ids(whole(done))


def bad(url: str, param: str, **body) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 1, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error


def test_bad_tool_input_is_a_400_naming_the_field(qwen3_server, server):
    url = qwen3_server.url
    bad(url, "tools[0].function.name", tools=[{"type": "function", "function": {"name": "has space"}}])
    bad(url, "tools[0].type", tools=[{"type": "custom", "function": {"name": "f"}}])
    bad(url, "tools[0].function", tools=[{"type": "function"}])
    bad(url, "tools[1].function.name", tools=[WEATHER, WEATHER])
    assert "not in tools" in bad(url, "tool_choice", tools=[WEATHER],
                                 tool_choice={"type": "function", "function": {"name": "nope"}})["message"]
    bad(url, "tool_choice", tool_choice="sometimes", tools=[WEATHER])
    bad(url, "tool_choice", tool_choice="required")
    bad(url, "tools[0].function.strict", tools=[{**WEATHER, "function": {**WEATHER["function"], "strict": True}}])
    stray = [*ASK, {"role": "tool", "tool_call_id": "call_never", "content": "x"}]
    assert "no tool call issued" in bad(url, "messages[1].tool_call_id", messages=stray)["message"]
    bad(url, "messages[1].tool_call_id", messages=[*ASK, {"role": "tool", "content": "x"}])
    bad(url, "messages[1].tool_calls[0].function.arguments", messages=[*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}])
    assert "16384" in bad(url, "chat_template_kwargs", chat_template_kwargs={"x": "y" * 17000})["message"]
    bad(url, "chat_template_kwargs", chat_template_kwargs={"tools": []})
    bad(url, "reasoning_effort", reasoning_effort="high")  # this template takes none
    bad(url, "reasoning_effort", reasoning_effort="extreme")
    # the plain template knows no tools
    assert "knows no tools" in bad(server.url, "tools", tools=[WEATHER])["message"]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    bad(server.url, "messages[1].tool_calls", messages=[*ASK, {"role": "assistant", "tool_calls": calls}])


def test_reasoning_effort_reaches_a_template_that_reads_it(start_server, tmp_path_factory):
    model = make_random_checkpoint(tmp_path_factory.mktemp("effort"), family="llama", layers=1)
    config = model / "tokenizer_config.json"
    cfg = json.loads(config.read_text())
    cfg["chat_template"] = "{{ messages[0]['content'] }} effort={{ reasoning_effort | default('none') }}<|im_end|>"
    config.write_text(json.dumps(cfg))
    srv = start_server(model)
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1}
    usage = [httpx.post(f"{srv.url}/v1/chat/completions", json={**body, **extra}, timeout=30).json()["usage"]
             for extra in ({}, {"reasoning_effort": "medium"})]
    assert usage[1]["prompt_tokens"] == usage[0]["prompt_tokens"] + len("medium") - len("none")
