"""Static bring-up through the real CLI: peers started before and after the coordinator, a streamed
chat equal to a single node, the generated TOML files, and those files in a later manual run."""

from __future__ import annotations

import signal
import tomllib

import httpx
import pytest

from tests.bringup.conftest import chat_text
from tests.bringup.procs import COORDINATOR_HOST, free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.proc]


def _body(path) -> str:
    """The TOML without its header comments (the lines before [cluster])."""
    text = path.read_text()
    return text[text.index("[cluster]"):]


def test_static_bring_up_then_the_generated_files_run_by_hand(bringup, single_node_chat):
    early = bringup.peer("early", "127.0.0.4")  # before the coordinator
    health = httpx.get(f"{early.url}/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "waiting"
    late_addr = f"127.0.0.3:{free_port('127.0.0.3')}"
    coord = bringup.coordinator("coord", 2, "--cluster-peers", f"{early.listener},{late_addr}",
                                "--cluster-config-out", "out/plan.toml")
    coord.wait_for(r"waiting for peer 127\.0\.0\.3:\d+ .*retrying every 0\.5s")  # the late one is not there yet
    late = bringup.peer("late", "127.0.0.3", port=int(late_addr.rsplit(":", 1)[1]))  # after the coordinator
    coord.wait_for(r"model tiny ready")
    assert chat_text(coord.url, stream=True) == single_node_chat

    # stage ids follow the address order: 127.0.0.3 (started last) is stage-0
    late.wait_for(r"activated as stage-0 \(layers 0-1\)")
    early.wait_for(r"activated as stage-1 \(layers 2-3\)")
    plan = coord.cwd / "out" / "plan.toml"
    files = {"stage-0": late.cwd / ".mlxcel" / "cluster-stage-0.toml",
             "stage-1": early.cwd / ".mlxcel" / "cluster-stage-1.toml"}
    assert _body(plan) == _body(files["stage-0"]) == _body(files["stage-1"])
    assert plan.read_text() != files["stage-0"].read_text() != files["stage-1"].read_text()  # headers differ
    doc = tomllib.loads(plan.read_text())
    assert doc["cluster"] == {"name": "mlxcel-cluster", "pipeline_parallel_size": 2,
                              "secret_file": str(bringup.secret.resolve())}  # absolute: works from anywhere
    assert [(n["id"], n["address"], n.get("layers")) for n in doc["nodes"]] == [
        ("coordinator", coord.wait_for(r"control address (\S+)").group(1), None),
        ("stage-0", late_addr, "0-1"), ("stage-1", early.listener, "2-3")]

    # the files work for a later manual run (no secret flag: the TOML names the secret file)
    for proc in (coord, late, early):
        assert proc.stop() == 0
    stage0 = bringup.node("manual-0", files["stage-0"], "stage-0", "127.0.0.3")
    stage1 = bringup.node("manual-1", files["stage-1"], "stage-1", "127.0.0.4", "--pp-peer")  # skips the wait
    for stage in (stage0, stage1):
        stage.wait_for(r"serving layers")
    assert "waiting for a stage assignment" not in stage1.text
    manual = bringup.node("manual-coord", plan, "coordinator", COORDINATOR_HOST)
    manual.wait_for(r"model tiny ready")
    assert chat_text(manual.url, stream=True) == single_node_chat
    assert httpx.get(f"{stage1.url}/health", timeout=5).json()["layers"] == [2, 4]


def test_a_waiting_peer_stops_cleanly(bringup):
    peer = bringup.peer("peer", "127.0.0.3")
    assert peer.stop(signal.SIGTERM) == 0  # what a service manager sends
    assert "stopped while waiting for an assignment" in peer.text


@pytest.mark.slow
def test_default_model_served_by_pp_auto_and_two_peers(tmp_path, default_model):
    """The issue's 'done when': --pp-auto 2 plus two --pp-peer serve the default model, greedy == one node
    (the engine's single-device answer, computed in this process)."""
    from openai import OpenAI

    from tests.bringup.procs import Bringup
    from tests.server.util import chat_reference

    b = Bringup(tmp_path, default_model)
    try:
        peers = [b.peer("p0", "127.0.0.3"), b.peer("p1", "127.0.0.4")]
        coord = b.coordinator("coord", 2, "--cluster-peers", ",".join(p.listener for p in peers))
        coord.wait_for(r"model tiny ready", timeout=180)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        client = OpenAI(base_url=f"{coord.url}/v1", api_key="unused")
        stream = client.chat.completions.create(model="tiny", messages=question, max_tokens=12, temperature=0,
                                                stream=True)
        answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert answer == chat_reference(default_model, question, 12) and "Paris" in answer
    finally:
        b.stop()
