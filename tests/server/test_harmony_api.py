"""gpt-oss's Harmony format, qwen3_coder and minimax_m2 through a real ``mlxcel serve`` and the ``openai`` client.

Random weights never choose a channel or a call, so calls are forced (the answer is prefilled with the call
message's header) and reasoning comes from the tiny template's ``harmony_channel`` hook, which opens the
analysis channel in the generation prompt.
"""

from __future__ import annotations

import json

import openai
import pytest

from mlxcel.models.random_checkpoint import make_random_checkpoint
from tests.server.test_tools_api import ASK, NAMED, TIME, WEATHER, reassemble, whole, without_ids
from tests.server.util import MODEL

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]

ANALYSIS = {"chat_template_kwargs": {"harmony_channel": "analysis"}}


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("gpt-oss"), family="gpt_oss", layers=2, template="gpt_oss")


@pytest.fixture(scope="module")
def gpt_oss_url(start_server, gpt_oss_model) -> str:
    return start_server(gpt_oss_model).url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def harmony_answers(url: str) -> dict:
    """A forced call (whole and streamed), the round trip after it, and a reasoning answer (whole and streamed)."""
    with client(url) as oa:
        kw = dict(model=MODEL, tools=[WEATHER, TIME], temperature=0, max_tokens=6)
        done = oa.chat.completions.create(messages=ASK, tool_choice=NAMED, **kw)
        streamed = reassemble(oa.chat.completions.create(messages=ASK, tool_choice=NAMED, stream=True, **kw))
        assert without_ids(streamed) == without_ids(whole(done))
        [call] = done.choices[0].message.tool_calls
        result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}
        after = oa.chat.completions.create(messages=[*ASK, done.choices[0].message, result], tool_choice="none",
                                           **kw)
        assert after.usage.prompt_tokens > done.usage.prompt_tokens  # the call and its result were rendered
        think = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=6, extra_body=ANALYSIS)
        thought = whole(oa.chat.completions.create(**think))
        assert reassemble(oa.chat.completions.create(stream=True, **think)) == thought
    return {"call": without_ids(whole(done)), "after": whole(after), "thought": thought}


def test_gpt_oss_forced_round_trip_reasoning_and_streams(gpt_oss_url):
    got = harmony_answers(gpt_oss_url)
    [call] = got["call"]["calls"].values()
    assert call["name"] == "get_weather" and got["call"]["content"] == "" and got["call"]["reasoning"] == ""
    assert got["call"]["finish"] in ("tool_calls", "length")
    assert got["after"]["calls"] == {}
    assert got["thought"]["reasoning"] and "<|" not in got["thought"]["reasoning"] + got["thought"]["content"]
    with client(gpt_oss_url) as oa:  # "required" among two tools: the model names the function itself
        req = oa.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         temperature=0, max_tokens=4)
        assert req.choices[0].finish_reason in ("tool_calls", "length")


@pytest.mark.parametrize("template", ["qwen3_coder", "minimax_m2"])
def test_xml_families_forced_round_trip(start_server, tmp_path_factory, template):
    model = make_random_checkpoint(tmp_path_factory.mktemp(template), family="llama", layers=2, template=template)
    with client(start_server(model).url) as oa:
        kw = dict(model=MODEL, tools=[WEATHER], temperature=0, max_tokens=6)
        done = oa.chat.completions.create(messages=ASK, tool_choice="required", **kw)
        [call] = done.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        streamed = reassemble(oa.chat.completions.create(messages=ASK, tool_choice="required", stream=True, **kw))
        assert without_ids(streamed) == without_ids(whole(done))
        # random arguments are no object, which these templates iterate: the client sends back a valid call
        sent = {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.dumps({"city": "Paris"})}}]}
        result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
        answer = oa.chat.completions.create(messages=[*ASK, sent, result], **kw)
        assert answer.usage.prompt_tokens > done.usage.prompt_tokens


def test_gpt_oss_calls_through_the_responses_and_messages_apis(gpt_oss_url):
    """The other dialects build the same internal request, so Harmony calls reach them as their own items."""
    import anthropic

    fn = {"type": "function", **WEATHER["function"]}
    with client(gpt_oss_url) as oa:
        done = oa.responses.create(model=MODEL, input="Weather in Paris?", tools=[fn], max_output_tokens=6,
                                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
        assert [o.name for o in done.output if o.type == "function_call"] == ["get_weather"]
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    with anthropic.Anthropic(base_url=gpt_oss_url, api_key="unused", max_retries=0) as an:
        msg = an.messages.create(model=MODEL, max_tokens=6, messages=ASK, tools=[tool],
                                 tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
        assert [b.name for b in msg.content if b.type == "tool_use"] == ["get_weather"]


def test_gpt_oss_constrained_call_arguments_and_structured_answer(gpt_oss_url):
    """A forced Harmony call's arguments and a response_format answer (the final channel's body) are valid JSON."""
    import jsonschema

    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    with client(gpt_oss_url) as oa:
        done = oa.chat.completions.create(model=MODEL, messages=ASK, tools=[tool, TIME], tool_choice=NAMED,
                                          max_tokens=96, temperature=0)
        [call] = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), params)
        city = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}}, "required": ["name"],
                "additionalProperties": False}
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": city, "strict": True}}
        kw = dict(model=MODEL, messages=ASK, response_format=fmt, max_tokens=64, temperature=0)
        answer = oa.chat.completions.create(**kw).choices[0]
        assert answer.finish_reason == "stop" and not (answer.message.model_extra or {}).get("reasoning_content")
        jsonschema.validate(json.loads(answer.message.content), city)
        assert reassemble(oa.chat.completions.create(stream=True, **kw))["content"] == answer.message.content
