"""Failed bring-ups through the real CLI: every one starts no stage anywhere.

A wrong checkpoint is refused and that peer exits; a wrong secret or cluster name leaves the peer
waiting (and a right coordinator assigns it afterwards); a peer that cannot commit aborts the others;
version 1 is refused with "assignment protocol mismatch"; --dry-run plans reproducibly.
"""

from __future__ import annotations

import json
import tomllib

import httpx
import pytest

from mlxcel.bringup.channel import dial
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from tests.bringup.procs import COORDINATOR_HOST, free_port, write_secret

pytestmark = [pytest.mark.timeout(240), pytest.mark.proc]


def _complete(url: str) -> dict:
    body = {"model": "tiny", "prompt": [1, 40, 41], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_wrong_checkpoint_is_refused_and_that_peer_exits(bringup, tmp_path):
    from mlxcel.models.random_checkpoint import make_random_checkpoint

    other = make_random_checkpoint(tmp_path / "other", family="llama", layers=2)
    good = bringup.peer("good", "127.0.0.3")
    wrong = bringup.peer("wrong", "127.0.0.4", model=other)
    coord = bringup.coordinator("coord", 2, "--cluster-peers", f"{good.listener},{wrong.listener}")
    assert wrong.wait_exit() == 1
    assert "mlxcel: error: stage assignment refused: model identity mismatch" in wrong.text
    assert coord.wait_exit() == 1
    assert (f"mlxcel: error: stage assignment failed and no stage was started: {wrong.listener} (stage-1) did not "
            "commit: it refused the offer (that peer exits): model identity mismatch") in coord.text
    good.wait_for(r"aborted the assignment: stage assignment failed .*model identity mismatch.*; waiting again")
    assert good.alive and "activated" not in good.text
    assert not (coord.cwd / ".mlxcel").exists() and not (good.cwd / ".mlxcel").exists()


def test_a_wrong_secret_or_cluster_name_leaves_the_peer_waiting(bringup, tmp_path):
    peer = bringup.peer("peer", "127.0.0.3")
    wrong_secret = bringup.coordinator("secret", 1, "--cluster-peers", peer.listener,
                                       secret=write_secret(tmp_path / "other.secret"))
    assert wrong_secret.wait_exit() == 1
    assert f"{peer.listener} did not commit: the handshake failed: its authenticator does not verify" in wrong_secret.text
    assert "retrying" not in wrong_secret.text  # a secret mismatch is not retried
    peer.wait_for("most likely holds a different cluster secret")

    wrong_name = bringup.coordinator("name", 1, "--cluster-peers", peer.listener, "--cluster-name", "other-cluster")
    assert wrong_name.wait_exit() == 1
    assert "it refused the offer: cluster name mismatch" in wrong_name.text
    peer.wait_for(r"refused the offer of the coordinator at \S+: cluster name mismatch.*waiting again")

    assert peer.alive and "activated" not in peer.text
    right = bringup.coordinator("right", 1, "--cluster-peers", peer.listener)
    right.wait_for(r"model tiny ready")
    assert _complete(right.url)["usage"]["completion_tokens"] == 4
    peer.wait_for(r"activated as stage-0 \(layers 0-3\)")


def test_a_peer_failing_the_commit_aborts_the_others_and_nothing_starts(bringup, tmp_path):
    not_a_dir = tmp_path / "not-a-dir"
    not_a_dir.write_text("")
    good = bringup.peer("good", "127.0.0.3")
    bad = bringup.peer("bad", "127.0.0.4", "--cluster-config-out", str(not_a_dir / "cluster.toml"))
    coord = bringup.coordinator("coord", 2, "--cluster-peers", f"{good.listener},{bad.listener}")
    assert coord.wait_exit() == 1
    assert (f"{bad.listener} (stage-1) did not commit: it could not prepare: cannot write the cluster TOML "
            f"{not_a_dir / 'cluster.toml'}") in coord.text
    assert f"(aborted: {good.listener} (stage-0))" in coord.text
    good.wait_for("committed stage-0")
    summary = good.wait_for(r"aborted the assignment: (stage assignment failed .*); waiting again").group(1)
    assert f"{bad.listener} (stage-1) did not commit" in summary  # Abort carries the failure summary
    bad.wait_for("cannot commit stage-1")
    for proc in (good, bad):
        assert proc.alive and "activated" not in proc.text and "serving layers" not in proc.text
    assert list((good.cwd / ".mlxcel").iterdir()) == []  # the staged TOML was removed, none published
    assert not (coord.cwd / ".mlxcel").exists()
    health = httpx.get(f"{good.url}/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "waiting"


def test_version_1_is_refused_with_assignment_protocol_mismatch(bringup):
    peer = bringup.peer("peer", "127.0.0.3")
    control = PeerId.of(COORDINATOR_HOST, free_port(COORDINATOR_HOST))
    chan = dial(PeerId.parse(peer.listener), control, load_secret(bringup.secret))
    try:
        chan.send(json.dumps({"protocol": 1, "msg": "query"}).encode())
        reply = json.loads(chan.recv(10))
    finally:
        chan.close()
    assert reply["msg"] == "refused" and reply["fatal"] is True
    assert peer.wait_exit() == 1
    assert ("mlxcel: error: stage assignment refused: assignment protocol mismatch: the other side speaks "
            "version 1, this node speaks 2") in peer.text


def test_dry_run_is_reproduced_byte_for_byte_and_assigns_nothing(bringup):
    # 127.0.0.10 sorts before 127.0.0.9 as text: it is stage-0 although it is listed second
    a, b = bringup.peer("a", "127.0.0.9"), bringup.peer("b", "127.0.0.10")
    peers, control = f"{a.listener},{b.listener}", free_port(COORDINATOR_HOST)
    plans = []
    for name in ("dry-1", "dry-2"):
        coord = bringup.coordinator(name, 2, "--cluster-peers", peers, "--dry-run", control_port=control)
        assert coord.wait_exit() == 0, coord.text
        assert "dry run: planned stage-0 = " in coord.text
        plans.append((coord.cwd / ".mlxcel" / "cluster.toml").read_bytes())
    assert plans[0] == plans[1]
    doc = tomllib.loads(plans[0].decode())
    assert [(n["id"], n["address"]) for n in doc["nodes"][1:]] == [("stage-0", b.listener), ("stage-1", a.listener)]
    for peer in (a, b):
        peer.wait_for("aborted the assignment: dry run")
        assert peer.alive and "activated" not in peer.text
    real = bringup.coordinator("real", 2, "--cluster-peers", peers, control_port=control)
    real.wait_for(r"model tiny ready")
    assert (real.cwd / ".mlxcel" / "cluster.toml").read_bytes() == plans[0]
