"""The OpenAI endpoints over real HTTP: shapes, streaming, usage, stops, seeds, logprobs, the openai client."""

from __future__ import annotations

import openai
import pytest

from tests.server.util import MODEL, chat_body, sse_events

pytestmark = [pytest.mark.timeout(60), pytest.mark.proc]


def test_models_lists_the_served_name(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]


def test_health_is_ready(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ready"}


def test_chat_completion_shape_and_usage(client):
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=5, temperature=0, ignore_eos=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_max_completion_tokens_wins_over_max_tokens(client):
    body = chat_body(max_tokens=9, max_completion_tokens=3, temperature=0, ignore_eos=True)
    assert client.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] == 3


def test_chat_stream_chunks_finish_usage_and_done(client):
    body = chat_body(max_tokens=6, temperature=0, ignore_eos=True, stream=True,
                     stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    plain = client.post("/v1/chat/completions", json=chat_body(max_tokens=6, temperature=0, ignore_eos=True))
    assert text == plain.json()["choices"][0]["message"]["content"]


def test_stream_without_include_usage_has_no_usage_chunk(client):
    with client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=3, stream=True)) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all(c["choices"] for c in events[:-1])


def test_completions_with_text_and_token_prompts(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 4,
                                              "temperature": 0, "ignore_eos": True})
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len("Once upon")  # byte-level tokenizer: one token per byte
    ids = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 60, 61, 62], "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True}).json()
    assert ids["usage"]["prompt_tokens"] == 4


def test_completions_stream(client):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 5
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(e["choices"][0]["text"] for e in events[:-2])
    plain = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert streamed == plain["choices"][0]["text"]


def test_stop_string_truncates_and_finishes_with_stop(client):
    base = {"model": MODEL, "prompt": [1, 70, 71, 72], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    text = client.post("/v1/completions", json=base).json()["choices"][0]["text"]
    k = next(i for i, ch in enumerate(text) if i >= 2 and ch != "\ufffd")
    stop = text[k]
    r = client.post("/v1/completions", json={**base, "stop": [stop, "never-seen"]}).json()
    assert r["choices"][0]["text"] == text[: text.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_seed_reproduces_sampling(client):
    body = {"model": MODEL, "prompt": "xyz", "max_tokens": 12, "temperature": 1.5, "ignore_eos": True}
    a = client.post("/v1/completions", json={**body, "seed": 5}).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json={**body, "seed": 5}).json()["choices"][0]["text"]
    c = client.post("/v1/completions", json={**body, "seed": 6}).json()["choices"][0]["text"]
    assert a == b
    assert a != c


def test_chat_logprobs_with_top_alternatives(client):
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=4, temperature=0, ignore_eos=True,
                                                           logprobs=True, top_logprobs=3)).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry["logprob"] <= 0 and entry["logprob"] == pytest.approx(tops[0])  # greedy picks the top


def test_completion_logprobs(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "q", "max_tokens": 3, "temperature": 0,
                                              "ignore_eos": True, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(len(t) <= 2 for t in lp["top_logprobs"])


def test_openai_client_chat_plain_and_streaming(server):
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    try:
        done = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
        stream = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == done.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 5
        assert [m.id for m in oa.models.list()] == [MODEL]
        comp = oa.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0)
        assert comp.choices[0].finish_reason in ("length", "stop")
    finally:
        oa.close()


def test_openai_client_sees_errors_as_exceptions(server):
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError) as info:
            oa.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
        assert info.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as info:
            oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
        assert info.value.param == "n"
    finally:
        oa.close()


def test_penalties_and_logit_bias_equal_mlx_lm_s_processors(client, tiny_llama):
    from tests.engine.penalty_reference import PENALIZED, mlx_lm_reference
    from tests.server.test_batching import reference_text

    prompt, n = [1, 40, 41, 42, 43, 44], 24
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    got = client.post("/v1/completions", json={**body, **PENALIZED}).json()["choices"][0]["text"]
    assert got == mlx_lm_reference(tiny_llama, prompt, n)
    assert got != reference_text(tiny_llama, prompt, n)  # the penalties change the greedy output
    for field in ("presence_penalty", "frequency_penalty", "repetition_penalty"):  # each one alone, too
        one = {field: PENALIZED[field]}
        text = client.post("/v1/completions", json={**body, **one}).json()["choices"][0]["text"]
        assert text == mlx_lm_reference(tiny_llama, prompt, n, one), field


def test_logit_bias_plus_100_forces_a_token_in_chat_streamed_or_not(client, tiny_llama):
    from tests.engine.penalty_reference import mlx_lm_reference

    body = chat_body(max_tokens=6, temperature=0.7, seed=3, ignore_eos=True, logit_bias={"70": 100})
    text = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert text == mlx_lm_reference(tiny_llama, [1], 6, {"logit_bias": {"70": 100}})  # six times token 70
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == text


def test_min_p_one_samples_the_greedy_token(client):
    body = chat_body(max_tokens=8, ignore_eos=True)
    greedy = client.post("/v1/chat/completions", json={**body, "temperature": 0}).json()
    hot = client.post("/v1/chat/completions", json={**body, "temperature": 1.8, "seed": 9, "min_p": 1.0}).json()
    assert hot["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]
