"""Readiness, timeouts and startup/shutdown of the server process."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.util import CLI, chat_body, sse_events

pytestmark = [pytest.mark.timeout(90), pytest.mark.proc]
LONG = {"max_tokens": 1900, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def slow(start_server, tiny_llama):
    """Warmup held for 2 s (test hook) and a 0.5 s request timeout."""
    return start_server(tiny_llama, "--request-timeout", "0.5", ready=False,
                        env={"MLXCEL_TEST_WARMUP_DELAY_S": "2"})


def test_health_is_503_until_warm_then_200(slow):
    r = httpx.get(f"{slow.url}/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] in ("loading", "warming")
    assert r.headers["retry-after"] == "1"
    early = httpx.post(f"{slow.url}/v1/chat/completions", json=chat_body(max_tokens=2), timeout=10)
    assert early.status_code == 503 and early.json()["error"]["type"] == "service_unavailable"
    slow.wait_ready()
    assert httpx.get(f"{slow.url}/health", timeout=10).json() == {"status": "ready"}


def test_request_timeout_non_streaming_is_504(slow):
    slow.wait_ready()
    r = httpx.post(f"{slow.url}/v1/chat/completions", json=chat_body(**LONG), timeout=30)
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "timeout_error"


def test_request_timeout_streaming_ends_with_error_event_then_done(slow):
    slow.wait_ready()
    with httpx.stream("POST", f"{slow.url}/v1/chat/completions", json=chat_body(stream=True, **LONG),
                      timeout=30) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "request_timeout"
    assert any(e.get("choices") for e in events[:-2])  # tokens came before the timeout


def test_sigint_shuts_down_cleanly(slow):
    assert slow.stop() == 0


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "serve", *args], capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mlxcel: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_missing_model_is_one_line(tmp_path):
    line = one_error_line(run_cli("-m", str(tmp_path / "absent"), "--port", "0"))
    assert "no such model directory" in line


def test_port_in_use_is_one_line_before_loading(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        start = time.monotonic()
        line = one_error_line(run_cli("-m", str(tiny_llama), "--port", str(port)))
    assert "address already in use" in line and str(port) in line
    assert time.monotonic() - start < 30


def test_batch_larger_than_parallel_is_refused(tiny_llama):
    line = one_error_line(run_cli("-m", str(tiny_llama), "--parallel", "2", "--max-batch-size", "4"))
    assert "--max-batch-size" in line


def test_bad_flag_values_are_usage_errors(tiny_llama):
    proc = run_cli("-m", str(tiny_llama), "--parallel", "0")
    assert proc.returncode == 2 and "--parallel" in proc.stderr


def test_unloadable_checkpoint_exits_non_zero_after_binding(tiny_llama, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(tiny_llama).iterdir():
        (broken / f.name).write_bytes(b"not safetensors" if f.suffix == ".safetensors" else f.read_bytes())
    line = one_error_line(run_cli("-m", str(broken), "--port", "0"))
    assert "broken" in line


def test_mlxcel_server_entry_point_help():
    exe = Path(sys.executable).with_name("mlxcel-server")
    if not exe.exists():
        pytest.skip("mlxcel-server script not installed in this environment")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--max-batch-size" in out.stdout
