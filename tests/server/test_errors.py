"""Every error case answers OpenAI's error shape with the right status, and the server keeps serving."""

from __future__ import annotations

import pytest

from tests.server.util import MODEL, chat_body

pytestmark = [pytest.mark.timeout(60), pytest.mark.proc]
CONTEXT = 2048  # the random checkpoint's max_position_embeddings


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def post_raw(client, content: bytes):
    return client.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})


def test_malformed_json(client):
    err = error_of(post_raw(client, b'{"model": "tiny", "messages": ['), 400)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"


def test_body_not_an_object(client):
    assert error_of(post_raw(client, b"[1, 2]"), 400)["type"] == "invalid_request_error"


@pytest.mark.parametrize("field,value,param", [
    ("max_tokens", "5", "max_tokens"),
    ("temperature", "hot", "temperature"),
    ("messages", "hi", "messages"),
    ("stream", "yes", "stream"),
    ("stop", 7, "stop"),
    ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
])
def test_wrong_types_name_the_param(client, field, value, param):
    err = error_of(client.post("/v1/chat/completions", json={**chat_body(), field: value}), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_missing_required_fields(client):
    err = error_of(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400)
    assert err["param"] == "model"
    err = error_of(client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
    assert err["param"] == "messages"


def test_unknown_model_is_404(client):
    err = error_of(client.post("/v1/chat/completions", json={**chat_body(), "model": "gpt-9"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    err = error_of(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"


def test_prompt_longer_than_context(client):
    err = error_of(client.post("/v1/chat/completions", json=chat_body("a" * (CONTEXT + 10))), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    err = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "b" * (CONTEXT + 1)}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


def test_prompt_plus_max_tokens_beyond_context(client):
    err = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": "c" * 2000, "max_tokens": 100}),
                   400)
    assert err["code"] == "context_length_exceeded"
    assert "2100" in err["message"]


@pytest.mark.parametrize("key,value", [("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 10**7),
                                       ("max_completion_tokens", 0)])
def test_max_tokens_out_of_range(client, key, value):
    err = error_of(client.post("/v1/chat/completions", json=chat_body(**{key: value})), 400)
    assert err["param"] == key and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra,param", [
    ({"n": 2}, "n"),
    ({"temperature": 3.0}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"presence_penalty": "1"}, "presence_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
])
def test_invalid_or_unsupported_parameters(client, extra, param):
    err = error_of(client.post("/v1/chat/completions", json=chat_body(**extra)), 400)
    assert err["param"] == param


def test_bad_completion_prompts(client):
    assert error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": ""}), 400)
    err = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 99999]}), 400)
    assert err["param"] == "prompt"
    err = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}), 400)
    assert err["param"] == "prompt"


def test_unknown_route_and_wrong_method_use_the_error_shape(client):
    assert error_of(client.get("/v1/nothing"), 404)["type"] == "invalid_request_error"
    assert error_of(client.get("/v1/chat/completions"), 405)


def test_server_keeps_serving_after_errors(client):
    post_raw(client, b"{{{")
    client.post("/v1/chat/completions", json=chat_body(max_tokens=0))
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=2, temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
