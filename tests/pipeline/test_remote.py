"""Multi-process pipeline through the real CLI: stages and a coordinator on 127.0.0.2-.5.

Greedy output equals the single-device engine's, streaming works with the official openai client,
micro-batches overlap, a cancelled request frees its KV cache on every stage, and a stage that dies
mid-generation fails its requests within the deadline, marks /health degraded, and is used again
once it is back.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.pipeline.cluster import LocalCluster
from tests.server.util import chat_reference, metrics

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 80, 81, 82, 83]]


def reference_tokens(model_dir, prompt: list[int], n: int) -> str:
    """Single-device greedy text (no EOS stop) from the whole model, in this process."""
    from tests.server.test_batching import reference_text

    return reference_text(model_dir, prompt, n)


def remote_tokens(url: str, prompt: list[int], n: int) -> str:
    """Greedy text of ``n`` tokens through the coordinator (byte-level: equal text means equal tokens here)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == n
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    # 10 ms per stage step: slow enough that a long request is still running when a test looks at it
    # micro-batches spread over the stages (a CPU coordinator would fill one first): they overlap
    c = LocalCluster(tmp_path_factory.mktemp("pp"), tiny_llama, stage_delay=0.01,
                     pipeline="micro_batch_fill = false").start()
    yield c
    c.stop()


def test_concurrent_greedy_equals_single_device(cluster, tiny_llama):
    n = 24
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: remote_tokens(cluster.url, p, n), PROMPTS))
    for prompt, tokens in zip(PROMPTS, got):
        assert tokens == reference_tokens(tiny_llama, prompt, n)
    m = metrics(cluster.url)
    assert m["mlxcel_overlapped_steps_total"] > 0  # two micro-batches were in flight at once
    assert m["mlxcel_decode_shared_steps_total"] > 0


def test_openai_streaming_chat_through_the_coordinator(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage.completion_tokens >= 1


def test_cancelled_request_frees_kv_on_every_stage(cluster):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
            "stream": True}
    cancelled = [s.health().json()["cancelled"] for s in cluster.stages]
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept open: closing the iterator would close the stream
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        held = [s.health().json()["sequences"] for s in cluster.stages]
        assert held == [1, 1], (held, seen)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(s.health().json()["sequences"] == 0 for s in cluster.stages):
            # freed by CANCEL (each stage acknowledges it), not by a plain RELEASE
            assert [s.health().json()["cancelled"] for s in cluster.stages] == [n + 1 for n in cancelled]
            return
        time.sleep(0.1)
    pytest.fail(f"stages still hold sequences: {[s.health().json() for s in cluster.stages]}")


@pytest.fixture(scope="module")
def logits_cluster(tmp_path_factory, tiny_qwen3):
    """Three stages with explicit ranges; the last stage returns full logits and the coordinator samples."""
    c = LocalCluster(tmp_path_factory.mktemp("pp-logits"), tiny_qwen3, stages=3, layers=["0-0", "1-2", "3-3"],
                     coordinator_flags=("--pp-return-logits",)).start()
    yield c
    c.stop()


def test_three_stages_of_qwen3_equal_single_device(logits_cluster, tiny_qwen3):
    """Concurrent requests on this CPU coordinator fill micro-batches in order (3 rows, then 1; §3.9)."""
    c = logits_cluster
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: remote_tokens(c.url, p, 16), PROMPTS))
    assert got == [reference_tokens(tiny_qwen3, p, 16) for p in PROMPTS]
    assert [s.health().json()["layers"] for s in c.stages] == [[0, 1], [1, 3], [3, 4]]
    # the coordinator applies the penalties and logit_bias to the returned logits, as one node does
    from tests.engine.penalty_reference import PENALIZED, mlx_lm_reference

    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{c.url}/v1/completions", json={**body, **PENALIZED}, timeout=60)
    assert r.json()["choices"][0]["text"] == mlx_lm_reference(tiny_qwen3, PROMPTS[0], 16), r.text


def test_a_json_schema_sampled_by_the_coordinator_equals_a_single_node(logits_cluster, tiny_qwen3):
    """With --pp-return-logits the coordinator holds the grammar's matcher and masks the returned logits:
    the greedy document equals the single node's, token for token, and is valid against the schema."""
    import json

    import jsonschema

    from tests.server.util import ServerProcess

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}, "tag": {"enum": ["x", "yz"]}},
              "required": ["n", "ok", "tag"], "additionalProperties": False}
    body = {"model": "tiny", "max_tokens": 48, "temperature": 0,  # a byte-level tokenizer: a token a byte
            "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}}
    single = ServerProcess(tiny_qwen3)
    try:
        single.wait_ready()
        got = [[httpx.post(f"{url}/v1/completions", json={**body, "prompt": p}, timeout=60).json()
                for url in (single.url, logits_cluster.url)] for p in PROMPTS[:2]]
    finally:
        single.stop()
    for ref, remote in got:
        assert remote["choices"][0]["text"] == ref["choices"][0]["text"], (ref, remote)
        assert remote["choices"][0]["finish_reason"] == "stop", remote["choices"][0]
        jsonschema.validate(json.loads(remote["choices"][0]["text"]), schema)


def test_stage_killed_mid_generation_then_restarted(tmp_path, tiny_llama):
    """With resuming off (--max-resumes 0) the request fails at once (tests/pipeline/test_resume.py: resumed).
    One stage: what is proved (fail fast, degraded, refused naming the stage, used again) needs no second."""
    c = LocalCluster(tmp_path, tiny_llama, stages=1, stage_delay=0.01,
                     coordinator_flags=("--max-resumes", "0")).start()
    try:
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 1900, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{c.url}/v1/completions", json=body, timeout=60)
            time.sleep(1.0)
            killed_at = time.monotonic()
            c.stages[0].stop(signal.SIGKILL)
            r = pending.result()
        assert r.status_code >= 500 or r.json()["choices"][0]["finish_reason"] == "error" or "error" in r.json()
        assert time.monotonic() - killed_at < 10  # within the exchange deadline
        assert "unreachable" in r.text or "no answer" in r.text or "cannot reach" in r.text
        health = c.coordinator.health()
        assert health.status_code == 503 and health.json()["status"] == "degraded"
        sent = time.monotonic()
        refused = httpx.post(f"{c.url}/v1/completions", json={**body, "max_tokens": 3}, timeout=30)
        assert refused.status_code == 503 and "stage-0" in refused.text  # the backend's fault: retry later
        assert refused.headers.get("retry-after")
        assert time.monotonic() - sent < 3  # refused at once: with resuming off a new request is not held
        c.start_stage(0)
        deadline = time.monotonic() + 30
        while c.coordinator.health().status_code != 200:
            assert time.monotonic() < deadline, c.coordinator.health().text
            time.sleep(0.2)
        assert remote_tokens(c.url, PROMPTS[1], 8) == reference_tokens(tiny_llama, PROMPTS[1], 8)
    finally:
        c.stop()



@pytest.mark.slow
def test_default_model_remote_two_stages_equal_single_device(tmp_path, default_model):
    """The issue's 'done when': two stage processes and a coordinator serve the default model, greedy == one
    node (the engine's single-device answer, computed in this process: no second server to start)."""
    from openai import OpenAI

    c = LocalCluster(tmp_path, default_model).start()
    try:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        client = OpenAI(base_url=f"{c.url}/v1", api_key="unused")
        reply = client.chat.completions.create(model="tiny", messages=question, max_tokens=16, temperature=0)
        answer = reply.choices[0].message.content
        assert answer == chat_reference(default_model, question, 16)
        assert "Paris" in answer
        prompt = [1, 504, 3458, 282, 4649, 314]
        assert remote_tokens(c.url, prompt, 16) == reference_tokens(default_model, prompt, 16)
    finally:
        c.stop()
