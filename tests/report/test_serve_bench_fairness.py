"""serve_bench side by side: identical prompts for every server, ABBA order at every level.

Two small streaming OpenAI-style servers on real loopback sockets record what they receive and when.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from bench import serve_bench


class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[float, str]] = []


def _handler(rec: _Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # /v1/models
            body = json.dumps({"data": [{"id": "fake"}]}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with rec.lock:
                rec.seen.append((time.monotonic(), req["messages"][0]["content"]))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for word in ("a", "b", "c"):
                chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"choices": [], "usage": {"completion_tokens": 3}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    return Handler


@pytest.fixture()
def two_servers() -> Iterator[dict[str, tuple[str, _Recorder]]]:
    servers, out = [], {}
    for label in ("alpha", "beta"):
        rec = _Recorder()
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(rec))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        out[label] = (f"http://127.0.0.1:{httpd.server_address[1]}", rec)
    yield out
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def test_same_prompts_and_abba_order(two_servers):
    args = serve_bench.parse_args(["--concurrency", "1,2", "--requests", "2", "--max-tokens", "4", "--rounds", "2"])
    rows = serve_bench.run_side_by_side({k: (url, "fake") for k, (url, _) in two_servers.items()}, args)

    assert len(rows) == 2 * 2 * 2 and all(r["errors"] == 0 for r in rows)
    assert all(isinstance(r["load_1m"], float) and r["load_1m"] >= 0 for r in rows)  # the shared box's load
    first = {(r["round"], r["concurrency"]): r["server"] for r in rows if r["order"] == 0}
    # ABBA: the first server flips at every level and every round
    assert [first[(0, 1)], first[(0, 2)], first[(1, 1)], first[(1, 2)]] == ["alpha", "beta", "beta", "alpha"]
    for key in first:
        pair = [r for r in rows if (r["round"], r["concurrency"]) == key]
        assert {r["server"] for r in pair} == {"alpha", "beta"}
        assert pair[0]["prompts_sha256"] == pair[1]["prompts_sha256"]

    texts = {label: Counter(t for _, t in rec.seen) for label, (_, rec) in two_servers.items()}
    assert texts["alpha"] == texts["beta"]  # identical prompts, same count each
    assert max(texts["alpha"].values()) == 1  # and unique within a server: nothing answered from a cache
    # the recorded order is the real one: the level's first server got all its requests before the second
    for (rnd, n), label in first.items():
        tag = f"[r{rnd}-c{n}-"
        other = "beta" if label == "alpha" else "alpha"
        last_first = max(t for t, text in two_servers[label][1].seen if text.startswith(tag))
        first_second = min(t for t, text in two_servers[other][1].seen if text.startswith(tag))
        assert last_first < first_second


def test_request_texts_do_not_depend_on_time_or_server():
    a = serve_bench.prompts_sha256("r0-c4", 4, 3)
    time.sleep(0.01)
    assert serve_bench.prompts_sha256("r0-c4", 4, 3) == a
    assert serve_bench.prompts_sha256("r1-c4", 4, 3) != a
