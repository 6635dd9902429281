"""The reference's "Server / multi-host path" commands, run as written against
``examples/distributed/pipeline_remote_2node_tcp.toml``: two real server processes, a chat completion.

Substituted only: ``models/<checkpoint>`` (the default model), the secret file (made here, 0600) and
``--host 0.0.0.0`` (loopback only here). Ports are the reference's: 18080/18081 for HTTP, and the
example's cluster listeners 19000/19001.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.proc
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/distributed/pipeline_remote_2node_tcp.toml"
# verbatim from the reference (docs: "A minimal shape looks like this")
STAGE = """mlxcel-server -m models/<checkpoint> \\
    --distributed-config examples/distributed/pipeline_remote_2node_tcp.toml \\
    --cluster-secret-file /etc/mlxcel/cluster.secret \\
    --node-id stage-1 \\
    --host 0.0.0.0 --port 18081 --no-warmup"""
COORDINATOR = """mlxcel-server -m models/<checkpoint> \\
    --distributed-config examples/distributed/pipeline_remote_2node_tcp.toml \\
    --cluster-secret-file /etc/mlxcel/cluster.secret \\
    --node-id coordinator \\
    --host 0.0.0.0 --port 18080 \\
    --parallel 2 --max-batch-size 2 --pp-micro-batch-size 2"""
PORTS = (18080, 18081, 19000, 19001)


def as_run_here(command: str, model: Path, secret: Path) -> list[str]:
    """The reference's command with the three substitutions, the venv's ``mlxcel-server`` first."""
    argv = shlex.split(command.replace("\\\n", " ").replace("models/<checkpoint>", str(model))
                       .replace("/etc/mlxcel/cluster.secret", str(secret)).replace("0.0.0.0", "127.0.0.1"))
    return [str(Path(sys.executable).parent / "mlxcel-server"), *argv[1:]]


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_example_comments_the_reference_commands() -> None:
    text = (REPO / EXAMPLE).read_text()
    commented = "\n".join(line.removeprefix("#").removeprefix(" ") for line in text.splitlines() if line.startswith("#"))
    for command in (STAGE, COORDINATOR):
        assert "\n".join(line.strip() for line in command.splitlines()) in \
            "\n".join(line.strip() for line in commented.splitlines())


def test_reference_commands_serve_a_chat_completion(default_model: Path, tmp_path: Path) -> None:
    busy = [p for p in PORTS if not _free(p)]
    if busy:
        pytest.skip(f"the reference's ports {busy} are in use on 127.0.0.1 by another process")
    secret = tmp_path / "cluster.secret"
    secret.write_text("ab" * 32 + "\n")
    secret.chmod(0o600)
    procs = []
    try:
        for command in (STAGE, COORDINATOR):
            procs.append(subprocess.Popen(as_run_here(command, default_model, secret), cwd=REPO,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))

        def ready() -> bool:
            for p in procs:
                if p.poll() is not None:
                    raise AssertionError(f"{p.args[-8:]} exited {p.returncode}: {p.stderr.read()[-2000:]}")
            try:
                return httpx.get("http://127.0.0.1:18080/health", timeout=2).json().get("status") == "ready"
            except (httpx.TransportError, ValueError):
                return False

        assert wait_until(ready, timeout=180, every=0.5), "the coordinator never became ready"
        model = httpx.get("http://127.0.0.1:18080/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
        reply = httpx.post("http://127.0.0.1:18080/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        assert reply.json()["choices"][0]["message"]["content"]
        stage = httpx.get("http://127.0.0.1:18081/health", timeout=5).json()
        assert stage["node_id"] == "stage-1" and stage["status"] == "ready"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
