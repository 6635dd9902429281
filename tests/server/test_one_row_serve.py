"""``mlxcel serve`` of a family whose caches cannot merge (a tiny llama4: ChunkedKVCache), over real HTTP.

Three requests at once all complete with the text each gives alone; /health says the server batches one row at a
time and why, and the start-up log says it once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.util import MODEL

pytestmark = [pytest.mark.timeout(120), pytest.mark.proc]
WHY = "llama4's layer 0 keeps a ChunkedKVCache, which mlx-lm cannot merge into a batch: one sequence decodes at a time"


def complete(url: str, prompt: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_concurrent_requests_to_a_llama4_server_complete(start_server, tmp_path):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    server = start_server(make_random_checkpoint(tmp_path / "llama4", family="llama4", layers=4),
                          "--parallel", "3", "--max-queue", "4")
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {"status": "ready", "batching": "one row at a time (ChunkedKVCache has no merge)"}
    prompts = ["hello there", "abc", "one two three four"]
    alone = [complete(server.url, p) for p in prompts]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda p: complete(server.url, p), prompts))
    assert together == alone
    assert sum(WHY in line for line in server.lines) == 1, "".join(server.lines)
