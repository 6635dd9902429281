"""A request in flight survives a pipeline stage that dies, restarts or freezes (docs/pipeline.md §5.6),
and a new request that arrives while a stage is down is held until the stage is back.

Real processes on 127.0.0.2-.4. The stage is killed with SIGKILL and started again by the test with
the same command line (a supervisor's job), or frozen with SIGSTOP and thawed with SIGCONT; the
coordinator resumes the request: the client gets its whole answer, streamed or not, with no error
and no token twice or missing; greedy text equals the single-device run, a seeded sampled one the
undisturbed cluster's, and /metrics counts the resume. A request sent while the stage is dead waits
(held) and is answered whole once it is back; past ``--resume-timeout`` it gets 503 + Retry-After.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.pipeline.cluster import LocalCluster
from tests.engine.fakes import held_of
from tests.pipeline.test_remote import reference_tokens
from tests.server.util import metrics

pytestmark = [pytest.mark.timeout(240), pytest.mark.proc]
PROMPT = [1, 50, 51, 52]
N = 40  # with 20 ms per stage step, about 2 s of answer: the stage breaks after 5 tokens, mid-answer


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
    # 20 ms per stage step: an answer of N tokens takes seconds, long enough to break it midway
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
    wait_health(cluster, lambda r: r.status_code == 200, timeout)


def wait_health(cluster: LocalCluster, ok, timeout: float = 60) -> None:
    """Until the coordinator's /health response satisfies ``ok``."""
    deadline = time.monotonic() + timeout
    while not ok(health := cluster.coordinator.health()):
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)


def kill_and_wait_degraded(cluster: LocalCluster, i: int) -> None:
    """SIGKILL stage ``i`` and wait until the coordinator's monitor marks it down."""
    cluster.stages[i].stop(signal.SIGKILL)
    wait_health(cluster, lambda r: r.status_code == 503 and r.json()["status"] == "degraded")


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
    steps = metrics(cluster.url).get("mlxcel_decode_steps_total", 0)
    t.start()
    deadline = time.monotonic() + 60
    while metrics(cluster.url).get("mlxcel_decode_steps_total", 0) < steps + 3:  # decoding, mid-answer
        assert time.monotonic() < deadline and t.is_alive(), "the request never started decoding"
        time.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(3.0)  # past two heartbeats: the coordinator marks it down and fails the step
    os.kill(pid, signal.SIGCONT)
    t.join(150)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == N
    assert r.json()["choices"][0]["text"] == reference_tokens(tiny_llama, PROMPT, N)


def test_requests_sent_while_a_stage_is_down_are_held_then_answered_whole_streamed_or_not(cluster, tiny_llama):
    wait_healthy(cluster)
    before = metrics(cluster.url)
    kill_and_wait_degraded(cluster, 1)
    out: dict = {}
    clients = [threading.Thread(target=lambda: out.update(
                   plain=httpx.post(f"{cluster.url}/v1/completions", json=body(max_tokens=8), timeout=120))),
               threading.Thread(target=lambda: out.update(
                   streamed=stream_text(cluster.url, threading.Event(), max_tokens=8)))]
    for t in clients:
        t.start()
    deadline = time.monotonic() + 30
    while metrics(cluster.url).get("mlxcel_held_requests", 0) < 2:
        assert time.monotonic() < deadline and not out, out
        time.sleep(0.2)
    time.sleep(1.0)
    assert not out and all(t.is_alive() for t in clients)  # held, not refused with 503
    cluster.start_stage(1)  # the same command line, as a supervisor would
    for t in clients:
        t.join(120)
    assert not any(t.is_alive() for t in clients), "a held request hung"
    expected = reference_tokens(tiny_llama, PROMPT, 8)
    assert out["plain"].status_code == 200, out["plain"].text
    assert out["plain"].json()["choices"][0]["text"] == expected
    assert out["streamed"][:2] == (expected, ["length"])
    after = metrics(cluster.url)
    assert after["mlxcel_requests_held_total"] == before.get("mlxcel_requests_held_total", 0) + 2
    assert after["mlxcel_hold_failed_requests_total"] == before.get("mlxcel_hold_failed_requests_total", 0)
    assert after["mlxcel_held_requests"] == 0


def test_a_request_held_past_the_resume_timeout_gets_503_with_retry_after(tmp_path, tiny_llama):
    c = LocalCluster(tmp_path, tiny_llama, stages=1, coordinator_flags=("--resume-timeout", "2")).start()
    try:
        kill_and_wait_degraded(c, 0)  # never started again

        def sse_events() -> list[dict]:
            with httpx.stream("POST", f"{c.url}/v1/completions", json=body(max_tokens=4, stream=True),
                              timeout=60) as s:
                return [json.loads(line[6:]) for line in s.iter_lines()
                        if line.startswith("data: ") and line != "data: [DONE]"]

        streamed: dict = {}  # the streamed request is held at the same time, on its own connection
        sse = threading.Thread(target=lambda: streamed.update(events=sse_events()))
        sse.start()
        start = time.monotonic()
        r = httpx.post(f"{c.url}/v1/completions", json=body(max_tokens=4), timeout=60)
        waited = time.monotonic() - start
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", (r.status_code, r.headers, r.text)
        message = r.json()["error"]["message"]
        assert "stage-0" in message and 2.0 <= held_of(message) < 3 and "--resume-timeout" in message, message
        assert 2.0 <= waited < 10, waited  # held for the bound, not refused at once, not hung
        sse.join(60)
        events = streamed["events"]
        assert len(events) == 1 and 2.0 <= held_of(events[0]["error"]["message"]) < 3, events  # the SSE error event
        m = metrics(c.url)
        assert (m["mlxcel_requests_held_total"], m["mlxcel_hold_failed_requests_total"]) == (2, 2)
    finally:
        c.stop()


SEEDED = {"temperature": 1.0, "seed": 4242}
SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 300}}, "required": ["s"],
          "additionalProperties": False}
CONSTRAINED = {"response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}},
               "ignore_eos": False}


def test_seeded_penalized_and_constrained_streams_resumed_at_once_equal_their_uninterrupted_answers(
        cluster, tiny_llama):
    """One restart of the last stage under three streams at once (one restart, not one a stream):

    - seeded sampling continues its random sequence;
    - penalties depend on the tokens so far: the resume rebuilds their window from prompt + generated, and the
      uninterrupted text equals mlx-lm's (the last stage samples as one node does);
    - the grammar's matcher is rebuilt on the restarted last stage by replaying the tokens generated so far
      (PREPARE params.replay): the resumed JSON equals the uninterrupted one, and it is valid."""
    from tests.engine.penalty_reference import PENALIZED, mlx_lm_reference

    wait_healthy(cluster)
    kinds = {"seeded": SEEDED, "penalized": PENALIZED, "constrained": CONSTRAINED}
    with ThreadPoolExecutor(len(kinds)) as pool:  # the uninterrupted answers, side by side
        answers = pool.map(lambda kw: httpx.post(f"{cluster.url}/v1/completions", json=body(**kw), timeout=120),
                           kinds.values())
        expected = {name: r.json() for name, r in zip(kinds, answers)}
    assert expected["penalized"]["choices"][0]["text"] == mlx_lm_reference(tiny_llama, PROMPT, N)
    constrained = expected["constrained"]["choices"][0]
    assert constrained["text"].startswith('{"s": "')
    if constrained["finish_reason"] == "stop":
        assert set(json.loads(constrained["text"])) == {"s"}
    before = metrics(cluster.url).get("mlxcel_resumed_requests_total", 0)
    started = {name: threading.Event() for name in kinds}
    out: dict = {}
    def run(name: str, kw: dict) -> None:
        out[name] = stream_text(cluster.url, started[name], **kw)

    threads = [threading.Thread(target=run, args=item) for item in kinds.items()]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started.values())  # every stream is mid-answer
    assert not out, f"a stream ended before the kill: {list(out)}"
    cluster.stages[1].stop(signal.SIGKILL)
    cluster.start_stage(1)  # the same command line, as a supervisor would
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    for name, whole in expected.items():
        text, reasons, _ = out[name]
        assert text == whole["choices"][0]["text"], name
        assert reasons == ["length"] == [whole["choices"][0]["finish_reason"]], (name, reasons)
    assert metrics(cluster.url)["mlxcel_resumed_requests_total"] >= before + len(kinds)
    wait_healthy(cluster)
