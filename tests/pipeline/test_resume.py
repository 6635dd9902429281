"""A request in flight survives a pipeline stage that dies, restarts or freezes (docs/pipeline.md §5.6).

Real processes on 127.0.0.2-.4. The stage is killed with SIGKILL and started again by the test with
the same command line (a supervisor's job), or frozen with SIGSTOP and thawed with SIGCONT; the
coordinator resumes the request: the client gets its whole answer, streamed or not, with no error
and no token twice or missing; greedy text equals the single-device run, a seeded sampled one the
undisturbed cluster's, and /metrics counts the resume.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.pipeline.cluster import LocalCluster
from tests.pipeline.test_remote import reference_tokens
from tests.server.util import metrics

pytestmark = [pytest.mark.timeout(240), pytest.mark.proc]
PROMPT = [1, 50, 51, 52]
N = 80


def body(**kw) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True, **kw}


def stream_text(url: str, started: threading.Event, **kw) -> tuple[str, list[str], int]:
    """(text, finish reasons, token events) of a streamed completion; ``started`` is set after 5 tokens."""
    text, reasons, events = "", [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body(stream=True, **kw), timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            text += choice["text"]
            events += 1
            if choice.get("finish_reason"):
                reasons.append(choice["finish_reason"])
            if events == 5:
                started.set()
    return text, reasons, events


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama):
    # 20 ms per stage step: an 80-token answer takes a few seconds, long enough to break it midway
    c = LocalCluster(tmp_path_factory.mktemp("resume"), tiny_llama, stage_delay=0.02).start()
    yield c
    c.stop()


def disturbed(cluster: LocalCluster, disturb, **kw) -> str:
    """The streamed text of one request while ``disturb()`` runs once 5 tokens arrived."""
    started = threading.Event()
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(result=stream_text(cluster.url, started, **kw)))
    t.start()
    assert started.wait(60)
    disturb()
    t.join(150)
    assert not t.is_alive(), "the stream hung"
    text, reasons, _ = out["result"]
    assert reasons == ["length"]
    return text


def wait_healthy(cluster: LocalCluster, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while cluster.coordinator.health().status_code != 200:
        assert time.monotonic() < deadline, cluster.coordinator.health().text
        time.sleep(0.2)


def test_a_stage_killed_and_restarted_mid_stream_the_stream_goes_on_greedy_identical(cluster, tiny_llama):
    before = metrics(cluster.url).get("mlxcel_resumed_requests_total", 0)

    def kill_and_restart() -> None:
        cluster.stages[1].stop(signal.SIGKILL)
        cluster.start_stage(1)  # the same command line, as a supervisor would

    text = disturbed(cluster, kill_and_restart)
    assert text == reference_tokens(tiny_llama, PROMPT, N)
    assert metrics(cluster.url)["mlxcel_resumed_requests_total"] >= before + 1
    wait_healthy(cluster)


def test_a_frozen_stage_thawed_mid_request_the_answer_is_whole_non_streamed(cluster, tiny_llama):
    wait_healthy(cluster)
    pid = cluster.stages[0].proc.pid
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(
        r=httpx.post(f"{cluster.url}/v1/completions", json=body(), timeout=120)))
    t.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(3.0)  # past two heartbeats: the coordinator marks it down and fails the step
    os.kill(pid, signal.SIGCONT)
    t.join(150)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == N
    assert r.json()["choices"][0]["text"] == reference_tokens(tiny_llama, PROMPT, N)


def test_a_seeded_sampled_stream_resumed_continues_its_random_sequence(cluster):
    wait_healthy(cluster)
    seeded = {"temperature": 1.0, "seed": 4242}
    undisturbed = httpx.post(f"{cluster.url}/v1/completions", json=body(**seeded), timeout=120).json()
    expected = undisturbed["choices"][0]["text"]

    def kill_and_restart() -> None:
        cluster.stages[1].stop(signal.SIGKILL)
        cluster.start_stage(1)

    assert disturbed(cluster, kill_and_restart, **seeded) == expected
    wait_healthy(cluster)
