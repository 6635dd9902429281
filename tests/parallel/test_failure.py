"""A rank that dies or hangs ends the whole group within a bounded time, with one clear line and 503s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.parallel.util import alive, followers, wait_gone
from tests.server.util import MODEL, ServerProcess

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]
CLI = [sys.executable, "-m", "mlxcel"]
LONG = {"model": MODEL, "prompt": [1, 40, 41], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


def start(model, *flags: str) -> tuple[ServerProcess, dict[int, int]]:
    server = ServerProcess(model, "--parallel", "2", "--tp-size", "3", "--no-warmup", "--log-level", "warning", *flags)
    server.wait_ready(120)
    return server, followers(server.proc.pid, 2)


def post_in_background(url: str) -> dict:
    """A long non-streaming request; its status code and body land in the dict."""
    out: dict = {}

    def run() -> None:
        try:
            r = httpx.post(f"{url}/v1/completions", json=LONG, timeout=120)
            out.update(status=r.status_code, body=r.json(), retry_after=r.headers.get("retry-after"))
        except httpx.HTTPError as exc:
            out.update(error=exc)

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def wait_decoding(url: str, timeout: float = 30) -> None:
    from tests.server.util import metrics

    deadline = time.monotonic() + timeout
    while metrics(url).get("mlxcel_decode_steps_total", 0) < 3:
        assert time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.05)


def test_killed_rank_ends_every_rank_with_503_and_one_line(tiny_6_3):
    server, ranks = start(tiny_6_3)
    try:
        inflight = post_in_background(server.url)
        wait_decoding(server.url)
        os.kill(ranks[1], signal.SIGKILL)
        took = wait_gone([server.proc.pid, ranks[2]], timeout=30)
        assert server.proc.wait(5) == 1 and took < 30
        inflight["thread"].join(10)
        assert inflight.get("status") == 503 and inflight["retry_after"] == "1", inflight
        assert "tensor-parallel group" in inflight["body"]["error"]["message"]
        errors = [line for line in server.lines if "stopping (requests get 503" in line]
        # whichever notices first: rank 0's next collective (the ring) or the liveness probe (control channel);
        # on a loaded box it is mostly the probe
        cause = ("tensor-parallel group failed: [ring] connection to a peer was lost",
                 "tensor-parallel rank 1 stopped answering (")
        assert len(errors) == 1, server.lines
        # MLX's ring writes to the same stderr, so its text may precede ours on the line
        assert f"mlxcel: error: tensor-parallel rank 1 (pid {ranks[1]}) was killed by signal 9: " in errors[0], errors
        assert any(c in errors[0] for c in cause), errors
        assert errors[0].endswith("; stopping (requests get 503 until the server is gone)\n")
    finally:
        server.stop()
        for pid in ranks.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_hung_rank_ends_the_group_after_the_timeout(tiny_6_3):
    server, ranks = start(tiny_6_3, "--tp-timeout", "3")
    try:
        inflight = post_in_background(server.url)
        wait_decoding(server.url)
        os.kill(ranks[2], signal.SIGSTOP)  # alive but silent: no collective, no answer to the probe
        took = wait_gone([server.proc.pid, ranks[1]], timeout=30)
        assert server.proc.wait(5) == 1 and took < 20
        inflight["thread"].join(10)
        assert inflight.get("status") == 503, inflight
        errors = [line for line in server.lines if "stopping (requests get 503" in line]
        assert len(errors) == 1 and ("rank 2 stopped answering" in errors[0] or "took longer than 3s" in errors[0]), errors
    finally:
        server.stop()
        for pid in ranks.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_generate_with_a_killed_rank_exits_1(tiny_6_3):
    proc = subprocess.Popen([*CLI, "generate", "-m", str(tiny_6_3), "-p", "x", "-n", "100000", "--raw",
                             "--tp-size", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ranks = followers(proc.pid, 2)
        assert proc.stdout.read(20)  # generating
        os.kill(ranks[2], signal.SIGKILL)
        assert proc.wait(30) == 1
        wait_gone([ranks[1]], timeout=15)
        err = proc.stderr.read().decode()
        assert "mlxcel: error: tensor-parallel group failed" in err or "tensor-parallel rank" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_followers_leave_when_rank_0_is_killed(tiny_6_3):
    proc = subprocess.Popen([*CLI, "generate", "-m", str(tiny_6_3), "-p", "x", "-n", "100000", "--raw",
                             "--tp-size", "3"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ranks: dict[int, int] = {}
    try:
        ranks = followers(proc.pid, 2)
        assert proc.stdout.read(20)
        proc.kill()
        proc.wait(10)
        assert wait_gone(list(ranks.values()), timeout=10) < 10  # they watch their parent and rank 0's silence
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in ranks.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
