"""Stopping a pipeline: the coordinator drains on SIGTERM (a request in flight finishes, new connections are
refused) and, with --pp-stop-stages, shuts every stage down through the stage protocol (SHUTDOWN; each
stage exits 0)."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.pipeline.cluster import LocalCluster

pytestmark = [pytest.mark.timeout(120), pytest.mark.proc]


def _stream(url: str, n: int, out: dict) -> None:
    body = {"model": "tiny", "prompt": [1, 40, 41], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens, done = 0, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
                out.setdefault("errors", []).extend([event["error"]] if "error" in event else [])
                out["started"].set()
    out.update(tokens=tokens, done=done)


def test_sigterm_drains_the_request_in_flight_then_stops_every_stage(tmp_path, tiny_llama):
    c = LocalCluster(tmp_path, tiny_llama, stage_delay=0.02,
                     coordinator_flags=("--pp-stop-stages", "--drain-timeout", "30")).start()
    try:
        out: dict = {"started": threading.Event()}
        client = threading.Thread(target=_stream, args=(c.url, 40, out))
        client.start()
        assert out["started"].wait(30)
        assert c.coordinator is not None
        c.coordinator.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # draining: no new connection is accepted
            httpx.get(f"{c.url}/health", timeout=2)
        client.join(60)
        assert out.get("done") and out["tokens"] == 40 and not out["errors"], out  # the request in flight finished
        assert c.coordinator.proc.wait(30) == 0
        for stage in c.stages:  # SHUTDOWN through the stage protocol: each stage exits 0 by itself
            assert stage.proc.wait(15) == 0, "".join(stage.lines)
        assert any("stopped pipeline stages: stage-0, stage-1" in line for line in c.coordinator.lines)
    finally:
        c.stop()


def test_without_the_flag_the_stages_outlive_the_coordinator(tmp_path, tiny_llama):
    c = LocalCluster(tmp_path, tiny_llama, stages=1).start()  # one stage proves it; each one more is a process
    try:
        assert c.coordinator is not None and c.coordinator.stop(signal.SIGTERM) == 0
        time.sleep(1)
        assert all(s.proc.poll() is None and s.health().status_code == 200 for s in c.stages)
    finally:
        c.stop()
