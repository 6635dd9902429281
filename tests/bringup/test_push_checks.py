"""What the coordinator's push checks and reports, against in-process ``FakePeer`` agents through the
real CLI, and the order in which an activated peer frees its address (docs/bringup.md §5.3, §7)."""

from __future__ import annotations

import socket

import pytest

from mlxcel import __version__
from tests.bringup.fake_peers import FakePeer
from tests.bringup.test_agent import agent, push

pytestmark = [pytest.mark.timeout(180), pytest.mark.proc]


@pytest.fixture
def fake(bringup):
    made: list[FakePeer] = []

    def make(host: str, **kw) -> FakePeer:
        made.append(FakePeer(bringup.tmp, host, bringup.model, bringup.secret, **kw))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def test_a_peer_silent_in_the_commit_phase_is_named_with_the_documented_text(bringup, fake):
    peer = fake("127.0.0.3", stall="commit")
    coord = bringup.coordinator("coord", 1, "--cluster-peers", str(peer.address))
    assert coord.wait_exit(120) == 1
    assert (f"mlxcel: error: stage assignment failed and no stage was started: {peer.address} (stage-0) did not "
            f"commit: no assignment frame from {peer.address} within 10s\n") in coord.text
    assert "AssignmentTimeout" not in coord.text and "connection failed" not in coord.text
    assert not (coord.cwd / ".mlxcel").exists()


def test_a_peer_of_another_mlxcel_version_is_refused_before_any_offer(bringup, fake):
    other = fake("127.0.0.3", mlxcel="0.0.9")
    good = fake("127.0.0.4")
    coord = bringup.coordinator("coord", 2, "--cluster-peers", f"{other.address},{good.address}")
    assert coord.wait_exit(120) == 1
    refused = (f"mlxcel: error: stage assignment failed and no stage was started: {other.address} did not commit: "
               f"mlxcel version mismatch: the peer runs mlxcel 0.0.9, this coordinator runs {__version__} (every node "
               f"of a cluster runs the same mlxcel version)")
    # the good peer was reached first (aborted) or not yet when the other's info failed (never dialled): both end it
    assert (f"{refused} (aborted: {good.address})\n" in coord.text or
            f"{refused}; {good.address} did not commit: not reached before another peer failed" in coord.text), coord.text
    assert "refused the offer" not in coord.text  # the coordinator decided on the info, no offer was sent
    for peer in (other, good):
        assert peer._outcome is None  # aborted: both keep waiting


def _listening(address) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(address.address) == 0


def test_an_activated_peer_has_closed_its_listener_when_the_push_returns(tmp_path):
    peers = [agent(tmp_path, "127.0.0.3"), agent(tmp_path, "127.0.0.4")]
    try:
        assert all(_listening(p.address) for p in peers)
        push(tmp_path, peers).run()
        # the coordinator dials the stage addresses next: the assignment listeners must be gone
        assert not any(_listening(p.address) for p in peers)
        assert all(p.state == "activated" for p in peers)
    finally:
        for p in peers:
            p.close()
