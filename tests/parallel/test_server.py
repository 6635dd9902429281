"""``mlxcel serve --tp-size 2`` through the official ``openai`` client: batched, greedy text of one node."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.parallel.util import alive, followers
from tests.server.util import MODEL, ServerProcess, metrics

pytestmark = [pytest.mark.timeout(240), pytest.mark.proc]
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 80, 81, 82, 83]]


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """A single-node server and a tp-2 server of the same checkpoint, both with 4 slots."""
    started = []
    try:
        for flags in ([], ["--tp-size", "2"]):
            started.append(ServerProcess(tiny_llama, "--parallel", "4", "--log-level", "info", *flags))
        for s in started:
            s.wait_ready(120)
        yield started
    finally:
        codes = [s.stop() for s in started]
        assert codes[-1] == 0, "".join(started[-1].lines)
        if len(started) == 2:
            assert not any(alive(p) for p in started[1].ranks)


@pytest.fixture(scope="module")
def single(servers):
    return servers[0]


@pytest.fixture(scope="module")
def tp(servers):
    server = servers[1]
    server.ranks = list(followers(server.proc.pid, 1).values())
    return server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(server, prompt, **kw) -> openai.types.Completion:
    kw.setdefault("max_tokens", 24)
    return client(server).completions.create(model=MODEL, prompt=prompt, temperature=0,
                                             extra_body={"ignore_eos": True}, **kw)


def chat_stream(server, content: str, **kw) -> tuple[str, str]:
    stream = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                    temperature=0, max_tokens=24, stream=True, **kw)
    text, finish = "", ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_startup_names_the_decode_path(tp):
    assert any("decode path: native batched forward" in line for line in tp.lines)
    assert any("as rank 0 of 2 tensor-parallel ranks" in line for line in tp.lines)


def test_concurrent_requests_batch_and_equal_one_node(single, tp):
    before = metrics(tp.url)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        sharded = list(pool.map(lambda p: complete(tp, p), PROMPTS))
    after = metrics(tp.url)
    for prompt, result in zip(PROMPTS, sharded):
        assert result.choices[0].text == complete(single, prompt).choices[0].text
        assert result.usage.completion_tokens == 24
    assert after["mlxcel_decode_shared_steps_total"] > before["mlxcel_decode_shared_steps_total"]


def test_streaming_chat_equals_one_node(single, tp):
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda c: chat_stream(tp, c), ["hello", "tell me more", "a b c"]))
    assert got == [chat_stream(single, c) for c in ["hello", "tell me more", "a b c"]]
    assert all(finish in ("stop", "length") and text for text, finish in got)


def test_stop_strings_as_on_one_node(single, tp):
    full, _ = chat_stream(single, "stop here")
    stop = full[5:8]
    assert stop and chat_stream(tp, "stop here", stop=[stop]) == chat_stream(single, "stop here", stop=[stop])
    assert chat_stream(tp, "stop here", stop=[stop]) == (full[: full.index(stop)], "stop")


def test_cancelled_stream_leaves_the_ranks_in_step(single, tp):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{tp.url}/v1/chat/completions", json=body, timeout=60) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n > 6:
                break  # the client goes away mid-stream
    result = complete(tp, PROMPTS[2])  # the followers dropped the cancelled row too
    assert result.choices[0].text == complete(single, PROMPTS[2]).choices[0].text


def test_bad_input_is_the_same_error(single, tp):
    for server in (single, tp):
        with pytest.raises(openai.BadRequestError):
            complete(server, [1, 2, 3], max_tokens=10**9)
    assert httpx.get(f"{tp.url}/health").json() == {"status": "ready"}


def test_penalties_and_logit_bias_on_rank_0_equal_a_single_node(single, tp):
    from tests.engine.penalty_reference import PENALIZED

    extra = {k: v for k, v in PENALIZED.items() if k != "repetition_penalty"}
    body = {"ignore_eos": True, "repetition_penalty": PENALIZED["repetition_penalty"]}
    got = [client(s).completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=16,
                                        extra_body=body, **extra).choices[0].text for s in (single, tp)]
    assert got[0] == got[1]
    assert got[0] != complete(single, PROMPTS[0], max_tokens=16).choices[0].text


def test_a_json_schema_on_rank_0_equals_a_single_node(single, tp):
    import json

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}}
    got = [client(s).completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=16,
                                        extra_body=body) for s in (single, tp)]
    assert got[0].choices[0].text == got[1].choices[0].text and got[0].choices[0].finish_reason == "stop"
    assert set(json.loads(got[0].choices[0].text)) == {"n"}
