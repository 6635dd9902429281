"""Requests that name no sampling parameters use the checkpoint's generation_config.json values."""

import json
import shutil

import httpx
import pytest

from tests.server.util import chat_body

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)


@pytest.fixture(scope="module")
def greedy_by_default(start_server, tiny_llama, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("greedy-default") / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "eos_token_id": 2}))
    return start_server(ckpt, "--parallel", "2")


def content(url: str, **kw) -> str:
    body = chat_body("tell me", max_tokens=12, **kw)
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_checkpoint_temperature_applies_when_request_names_none(greedy_by_default):
    greedy = content(greedy_by_default.url, temperature=0)
    assert content(greedy_by_default.url, seed=1) == greedy
    assert content(greedy_by_default.url, seed=2) == greedy


def test_request_value_overrides_the_checkpoint(greedy_by_default):
    hot = [content(greedy_by_default.url, temperature=2.0, seed=s) for s in (1, 2, 3)]
    assert len(set(hot)) > 1
