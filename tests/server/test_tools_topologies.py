"""Tool calls and reasoning through the pipeline coordinator, the disaggregated router and the TP server.

All serve through the same HTTP front as the single node, so a greedy forced call and its reasoning
split must equal the single node's (ids aside, which are fresh per answer).
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from mlxcel.models.random_checkpoint import make_random_checkpoint
from tests.disagg.cluster import DisaggCluster
from tests.pipeline.cluster import LocalCluster
from tests.server.test_tools_api import ASK, NAMED, WEATHER, reassemble, whole, without_ids
from tests.server.util import MODEL

pytestmark = [pytest.mark.timeout(300), pytest.mark.proc]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("tools-topo"), family="llama", layers=4,
                                  template="qwen3")


def answers(url: str) -> dict:
    """A forced call (whole and streamed), the round trip after it, and a reasoning answer; ids dropped."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as oa:
        kw = dict(model=MODEL, tools=[WEATHER], temperature=0, max_tokens=6)
        done = oa.chat.completions.create(messages=ASK, tool_choice=NAMED, **kw)
        streamed = reassemble(oa.chat.completions.create(messages=ASK, tool_choice=NAMED, stream=True, **kw))
        [call] = done.choices[0].message.tool_calls
        result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}
        after = oa.chat.completions.create(messages=[*ASK, done.choices[0].message, result], tool_choice="none",
                                           **kw)
        thought = oa.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=6)
    assert without_ids(streamed) == without_ids(whole(done))
    return {"call": without_ids(whole(done)), "after": whole(after), "thought": whole(thought),
            "responses": responses_round_trip(url), "messages": messages_round_trip(url)}


def _no_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def responses_round_trip(url: str) -> list:
    """A forced call through the Responses API, then its function_call_output round trip (ids dropped)."""
    tool = {"type": "function", **WEATHER["function"]}
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as oa:
        kw = dict(model=MODEL, tools=[tool], temperature=0, max_output_tokens=6)
        done = oa.responses.create(input="Weather in Paris?", tool_choice="required", **kw)
        [call] = [o for o in done.output if o.type == "function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
        after = oa.responses.create(input=[{"type": "function_call", "call_id": call.call_id, "name": call.name,
                                            "arguments": call.arguments}, result], tool_choice="none", **kw)
    return [_no_ids(r.model_dump()["output"]) for r in (done, after)]


def messages_round_trip(url: str) -> list:
    """A forced tool_use through the Messages API (streamed), then its tool_result round trip (ids dropped)."""
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as an:
        kw = dict(model=MODEL, tools=[tool], max_tokens=6, extra_body={"temperature": 0})
        with an.messages.stream(messages=ASK, tool_choice={"type": "any"}, **kw) as stream:
            done = stream.get_final_message()
        [use] = [b for b in done.content if b.type == "tool_use"]
        follow = [*ASK, {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
        after = an.messages.create(messages=follow, tool_choice={"type": "none"}, **kw)
    return [_no_ids(m.model_dump()["content"]) + [m.stop_reason] for m in (done, after)]


@pytest.fixture(scope="module")
def single(start_server, model) -> dict:
    got = answers(start_server(model).url)
    assert got["call"]["calls"][0]["name"] == "get_weather" and got["thought"]["reasoning"]
    assert [i["name"] for i in got["responses"][0] if i["type"] == "function_call"] == ["get_weather"]
    assert [b["name"] for b in got["messages"][0][:-1] if b["type"] == "tool_use"] == ["get_weather"]
    return got


def test_pipeline_coordinator_equals_single_node(tmp_path_factory, model, single):
    # one stage: the answers are shaped at the coordinator; stage-to-stage hops are tests/pipeline's
    c = LocalCluster(tmp_path_factory.mktemp("pp-tools"), model, stages=1).start()
    try:
        assert answers(c.url) == single
    finally:
        c.stop()


def test_disaggregated_router_equals_single_node(tmp_path_factory, model, single):
    c = DisaggCluster(tmp_path_factory.mktemp("disagg-tools"), model).start()
    try:
        assert answers(c.url) == single
    finally:
        c.stop()


def test_tensor_parallel_server_equals_single_node(start_server, model, single):
    """``mlxcel serve --tp-size 2``: rank 0 samples, the shared front shapes the same answers."""
    assert answers(start_server(model, "--tp-size", "2").url) == single
