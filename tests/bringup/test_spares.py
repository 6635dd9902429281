"""Spare peers (docs/bringup.md §5.6): --pp-auto 2 --pp-spare 1 over three real --pp-peer processes.

The third peer in address order waits as a standby and both its /health and the coordinator's report
it. A stage killed with SIGKILL (and not restarted) while a greedy stream runs is assigned to the spare
after --pp-spare-after; the client gets the whole answer, equal to the single-device run. With the
spare used up, the next stage that dies mid-stream leaves the cluster degraded: a new request is held
(it would get a clean 503 past --resume-timeout, tests/pipeline/test_resume.py) and is dropped when its
client gives up. Its peer's command started again (as a supervisor does) comes back waiting at the same
address, and the same coordinator process re-assigns it the stage (§5.7): the stream in flight resumes
and ends with the whole answer.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest

from tests.pipeline.test_remote import reference_tokens
from tests.pipeline.test_resume import PROMPT, stream_text
from tests.server.util import metrics

pytestmark = [pytest.mark.timeout(240), pytest.mark.proc]
N = 30
SLOW = {"MLXCEL_TEST_STAGE_STEP_DELAY_S": "0.03"}  # an answer of N tokens lasts long enough to break it after 5


def _health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=5)


def _wait_health(url: str, ok, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = _health(url).json()
        if ok(body):
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.2)


def test_a_spare_stands_by_then_takes_over_a_killed_stage_mid_stream(bringup, tiny_llama):
    peers = [bringup.peer(f"peer-{i}", f"127.0.0.{i}", env=SLOW) for i in (3, 4, 5)]
    coord = bringup.coordinator("coord", 2, "--pp-spare", "1", "--pp-spare-after", "1",
                                "--cluster-peers", ",".join(p.listener for p in peers))
    coord.wait_for(r"model tiny ready")
    stage0, stage1, spare = peers  # address order: 127.0.0.3 and .4 are the stages, .5 the spare
    spare.wait_for(r"standing by as a spare of the 2-stage cluster of the coordinator at 127\.0\.0\.2:\d+")
    waiting = _health(spare.url)
    assert waiting.status_code == 503 and waiting.json()["status"] == "standby"
    health = _health(coord.url).json()
    assert health["status"] == "ready"
    assert health["spares"] == [{"address": spare.listener, "state": "standby"}]

    started, out = threading.Event(), {}
    t = threading.Thread(target=lambda: out.update(r=stream_text(coord.url, started, max_tokens=N)))
    t.start()
    assert started.wait(60)
    killed = time.monotonic()
    stage1.stop(signal.SIGKILL)  # not restarted: only the spare can bring the cluster back
    t.join(150)
    assert not t.is_alive(), "the stream hung"
    text, reasons, _ = out["r"]
    assert reasons == ["length"] and text == reference_tokens(tiny_llama, PROMPT, N)
    took = time.monotonic() - killed

    spare.wait_for(r"activated as stage-1 \(layers 2-3\)")
    health = _wait_health(coord.url, lambda b: b["status"] == "ready")
    assert [(s["id"], s["address"]) for s in health["stages"]] == [("stage-0", stage0.listener),
                                                                   ("stage-1", spare.listener)]
    assert health["spares"] == [{"address": spare.listener, "state": "stage-1"},
                                {"address": stage1.listener, "state": "replaced",  # where stage-1's old peer was
                                 "reason": f"stage-1 was taken over by {spare.listener}; a peer started again here "
                                           "joins as a spare"}]
    assert spare.listener in (coord.cwd / ".mlxcel" / "cluster.toml").read_text()  # the coordinator's file follows
    print(f"kill -> whole answer: {took:.1f}s")

    # the spare is used up: the next stage that dies stays down; a new request is held, as without spares
    pid = coord.proc.pid
    started, out = threading.Event(), {}
    t = threading.Thread(target=lambda: out.update(r=stream_text(coord.url, started, max_tokens=N)))
    t.start()
    assert started.wait(60)
    spare.stop(signal.SIGKILL)
    _wait_health(coord.url, lambda b: b["status"] == "degraded")
    with pytest.raises(httpx.ReadTimeout):  # held, not refused; the client gives up after 3 s
        httpx.post(f"{coord.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
                   timeout=httpx.Timeout(3.0, connect=10.0))
    coord.wait_for(r"no spare left to take over stage-1")
    deadline = time.monotonic() + 20
    while (m := metrics(coord.url))["mlxcel_held_requests"] != 0:  # the client went away: dropped
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["mlxcel_requests_held_total"] == 1 and m["mlxcel_hold_failed_requests_total"] == 0
    assert coord.alive

    # a supervisor starts the same --pp-peer command again: it waits at the same address and gets stage-1 back
    killed = time.monotonic()
    again = bringup.restart(spare)
    assert again.listener == spare.listener
    again.wait_for(r"activated as stage-1 \(layers 2-3\)")
    coord.wait_for(rf"re-assigned stage-1 \(layers 2-3\) to its restarted peer at {re.escape(spare.listener)}")
    t.join(150)
    assert not t.is_alive(), "the stream hung"
    text, reasons, _ = out["r"]
    assert reasons == ["length"] and text == reference_tokens(tiny_llama, PROMPT, N)
    print(f"restart -> whole answer: {time.monotonic() - killed:.1f}s")
    health = _wait_health(coord.url, lambda b: b["status"] == "ready")
    assert health["reassigned"] == {"stage-1": 1}
    assert [(s["id"], s["address"]) for s in health["stages"]] == [("stage-0", stage0.listener),
                                                                   ("stage-1", spare.listener)]
    assert coord.alive and coord.proc.pid == pid  # healed without restarting the coordinator
