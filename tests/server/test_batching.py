"""Continuous batching seen from outside: shared decode steps, late joins, cancel on disconnect, queue limits."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.util import MODEL, chat_body, metrics

pytestmark = [pytest.mark.timeout(90), pytest.mark.proc]
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66, 67], [1, 80, 81, 82, 83]]
LONG = {"max_tokens": 1900, "temperature": 0, "ignore_eos": True}


def reference_text(model_dir, prompt: list[int], n: int) -> str:
    """Single-sequence greedy text (no EOS stop) from the engine core, in this process's main thread."""
    from mlxcel.engine.generate import generate_tokens, make_cache
    from mlxcel.engine.sampling import SamplingParams, make_sampler
    from mlxcel.models.loading import load_checkpoint

    loaded = load_checkpoint(model_dir)
    model = loaded.model
    sampler = make_sampler(SamplingParams())
    tokens = [t for t, _ in generate_tokens(lambda x, c: model(x, cache=c), prompt, make_cache(model), sampler, n)]
    detok = loaded.tokenizer.detokenizer
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    return detok.text


def complete(url: str, prompt: list[int], **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()


def wait_metric(url: str, name: str, value: float, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics(url).get(name) == value:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} never became {value}: {metrics(url).get(name)}")


def first_chunks(lines, n: int) -> None:
    """Read from a chat stream's line iterator until n more content chunks arrived."""
    seen = 0
    for line in lines:
        if line.startswith("data: ") and '"content"' in line:
            seen += 1
            if seen >= n:
                return


def test_concurrent_greedy_equals_single_sequence_and_shares_steps(server, tiny_llama):
    n = 40
    before = metrics(server.url)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: complete(server.url, p, max_tokens=n), PROMPTS))
    after = metrics(server.url)
    for prompt, result in zip(PROMPTS, results):
        assert result["usage"]["completion_tokens"] == n
        assert result["choices"][0]["text"] == reference_text(tiny_llama, prompt, n)
    steps = after["mlxcel_decode_steps_total"] - before["mlxcel_decode_steps_total"]
    rows = after["mlxcel_decode_rows_total"] - before["mlxcel_decode_rows_total"]
    assert after["mlxcel_decode_shared_steps_total"] > before["mlxcel_decode_shared_steps_total"]
    assert rows >= len(PROMPTS) * (n - 1)
    assert steps < rows  # fewer forward passes than tokens: steps were shared


def test_late_request_joins_the_running_batch(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG)) as long_stream:
            lines = long_stream.iter_lines()
            first_chunks(lines, 3)
            before = metrics(server.url)
            short = complete(server.url, [1, 90, 91], max_tokens=8)
            after = metrics(server.url)
            assert short["usage"]["completion_tokens"] == 8
            first_chunks(lines, 1)  # the long request is still generating
            assert after["mlxcel_decode_shared_steps_total"] - before["mlxcel_decode_shared_steps_total"] >= 6
        # leaving the block closes the connection: the long request is cancelled and its slot freed
        wait_metric(server.url, "mlxcel_running_sequences", 0)


@pytest.fixture(scope="module")
def small(start_server, tiny_llama):
    """One slot and no queue: the second concurrent request is refused."""
    return start_server(tiny_llama, "--parallel", "1", "--max-queue", "0")


def test_queue_full_is_503_with_retry_after_and_cancel_frees_the_slot(small):
    with httpx.Client(base_url=small.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, **LONG)) as long_stream:
            lines = long_stream.iter_lines()  # keep a reference: a collected iterator closes the response
            first_chunks(lines, 2)
            r = c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            assert r.status_code == 503
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "server_overloaded"
            assert metrics(small.url)["mlxcel_running_sequences"] == 1
        wait_metric(small.url, "mlxcel_running_sequences", 0)
        assert c.post("/v1/chat/completions", json=chat_body(max_tokens=2)).status_code == 200


def test_non_streaming_disconnect_cancels_generation(small):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small.url}/v1/chat/completions", json=chat_body(**LONG), timeout=httpx.Timeout(60, read=0.5))
    wait_metric(small.url, "mlxcel_running_sequences", 0)
    r = httpx.post(f"{small.url}/v1/chat/completions", json=chat_body(max_tokens=2), timeout=30)
    assert r.status_code == 200
    assert metrics(small.url).get('mlxcel_requests_total{endpoint="/v1/chat/completions",status="499"}') == 1


def test_first_token_comes_from_the_prefill(small, tiny_llama):
    """A one-token request needs no decode step: its token is sampled from the prefill's last logits."""
    before = metrics(small.url)
    result = complete(small.url, PROMPTS[2], max_tokens=1)
    after = metrics(small.url)
    assert result["choices"][0]["text"] == reference_text(tiny_llama, PROMPTS[2], 1)
    assert after["mlxcel_decode_steps_total"] == before["mlxcel_decode_steps_total"]
