"""The peer agent and the coordinator's push in this process, over real loopback sockets (no model):
a whole assignment, a peer busy with another coordinator, a model that fits no peer, the wait bound."""

from __future__ import annotations

import threading
import time
import tomllib
from pathlib import Path

import pytest

from mlxcel import __version__
from mlxcel.bringup.agent import PeerAgent
from mlxcel.bringup.channel import dial
from mlxcel.bringup.errors import AssignmentTimeout, BringupFailed
from mlxcel.bringup.flags import BringupSettings
from mlxcel.bringup.machine import CoordinatorSession, Informed, PeerFacts, PeerRefused
from mlxcel.bringup.plan import coordinator_header, write_file
from mlxcel.bringup.push import Push, PushConfig, _Peer
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.topology.partition import StageCosts
from tests.bringup.procs import free_port

pytestmark = pytest.mark.proc  # starts processes (tests/proc_marker.py)

SECRET = ClusterSecret(b"in-process bring-up test secret!")
COSTS = StageCosts(model="m", layers=(100,) * 6, embed=300, norm=1, head=300, tied=True)
IDENTITY = "ab" * 32


def agent(tmp: Path, host: str, *, memory: int = 1 << 30, wait_s: float = 600) -> PeerAgent:
    settings = BringupSettings(stages=None, cluster="mlxcel-cluster", discovery="static", control=PeerId.of(host, 0),
                               peers=(), discovery_target="127.0.0.1", discovery_port=0,
                               config_out=str(tmp / host / "cluster-{node_id}.toml"), dry_run=False)
    facts = PeerFacts(mlxcel=__version__, cluster="mlxcel-cluster", model_identity=IDENTITY, costs=COSTS,
                      memory=memory, listener=settings.control)
    a = PeerAgent(settings, facts, SECRET, wait_s=wait_s)
    a.start()
    return a


def push(tmp: Path, peers: list[PeerAgent], **kw) -> Push:
    control = PeerId.of("127.0.0.2", free_port("127.0.0.2"))
    config = PushConfig(control=control, cluster="mlxcel-cluster", mlxcel=__version__, model_identity=IDENTITY,
                        costs=COSTS, secret_file=None)
    out = tmp / "coordinator.toml"
    return Push(config, SECRET, [p.address for p in peers],
                write_plan=lambda plan: write_file(out, coordinator_header(plan, __version__) + plan.body()), **kw)


def waiting(a: PeerAgent) -> tuple[threading.Thread, list]:
    result: list = []

    def run() -> None:
        try:
            result.append(a.wait(threading.Event()))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            result.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def test_a_push_activates_both_agents(tmp_path):
    peers = [agent(tmp_path, "127.0.0.3"), agent(tmp_path, "127.0.0.4")]
    try:
        waits = [waiting(p) for p in peers]
        plan = push(tmp_path, peers).run()
        for t, _ in waits:
            t.join(10)
        activations = [result[0] for _, result in waits]
        assert [a.assignment.node_id for a in activations] == ["stage-0", "stage-1"]
        assert [a.assignment.layers for a in activations] == [(s.start, s.end) for s in plan.stages]
        for a in activations:
            assert a.path.read_text().endswith(plan.body())
        assert tomllib.loads((tmp_path / "coordinator.toml").read_text())["cluster"]["pipeline_parallel_size"] == 2
    finally:
        for p in peers:
            p.close()


def test_a_second_coordinator_is_refused_while_the_peer_is_busy(tmp_path):
    peer = agent(tmp_path, "127.0.0.3")
    first = second = None
    try:
        first = dial(peer.address, PeerId.of("127.0.0.2", free_port("127.0.0.2")), SECRET)
        s1 = CoordinatorSession(peer.address)
        first.send(s1.query())
        assert isinstance(s1.receive(first.recv(5)), Informed)  # the first session holds the peer
        second = dial(peer.address, PeerId.of("127.0.0.5", free_port("127.0.0.5")), SECRET)
        s2 = CoordinatorSession(peer.address)
        second.send(s2.query())
        event = s2.receive(second.recv(5))
        assert isinstance(event, PeerRefused) and not event.refusal.fatal and "busy" in event.refusal.reason
    finally:
        for chan in (first, second):
            if chan is not None:
                chan.close()
        peer.close()


def test_a_model_that_fits_no_peer_aborts_everyone(tmp_path):
    peers = [agent(tmp_path, "127.0.0.3", memory=1000), agent(tmp_path, "127.0.0.4", memory=250)]
    try:
        with pytest.raises(BringupFailed, match=r"cannot plan 2 stages: stage 1 needs at least 401 B .* but has 250 B"):
            push(tmp_path, peers).run()
        assert not (tmp_path / "coordinator.toml").exists()
        time.sleep(0.3)
        for p in peers:
            assert p._active is None and p._outcome is None  # back to waiting, nothing assigned
    finally:
        for p in peers:
            p.close()


def test_an_unreachable_peer_fails_within_the_window(tmp_path):
    live = agent(tmp_path, "127.0.0.3")
    absent = PeerId.of("127.0.0.4", free_port("127.0.0.4"))
    try:
        p = push(tmp_path, [live], window_s=11.5)
        p.peers.append(_Peer(absent, CoordinatorSession(absent)))
        started = time.monotonic()
        with pytest.raises(BringupFailed, match=rf"{absent} did not commit: unreachable within the push window"):
            p.run()
        assert 1 < time.monotonic() - started < 4  # redialled every 0.5 s until the offer deadline (window - 10 s)
    finally:
        live.close()


def test_a_peer_gives_up_after_its_wait(tmp_path):
    peer = agent(tmp_path, "127.0.0.3", wait_s=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(AssignmentTimeout, match="no stage assignment within 0.3s"):
            peer.wait(threading.Event())
        assert time.monotonic() - started < 2
        stop = threading.Event()
        stop.set()
        peer._deadline = time.monotonic() + 60
        assert peer.wait(stop) is None  # SIGINT/SIGTERM while waiting
    finally:
        peer.close()


def test_a_stage_listener_is_not_a_waiting_peer(tmp_path):
    """A --pp-auto coordinator restarted after its bring-up dials stages: refused at once, not retried."""
    from mlxcel.cluster.transport import Transport

    stage = Transport(PeerId.of("127.0.0.3", 0), SECRET)
    stage.serve()
    try:
        p = push(tmp_path, [])
        p.peers = [_Peer(stage.identity, CoordinatorSession(stage.identity))]
        started = time.monotonic()
        with pytest.raises(BringupFailed, match="server serves the transport channel, this node dialled it for the "
                                                "assignment channel"):
            p.run()
        assert time.monotonic() - started < 3
    finally:
        stage.close()


def _pushed(tmp: Path, hosts: list[str]) -> Push:
    peers = [agent(tmp / str(len(hosts)), h) for h in hosts]
    try:
        waits = [waiting(p) for p in peers]
        attempt = push(tmp / str(len(hosts)), peers)
        (tmp / str(len(hosts))).mkdir(exist_ok=True)
        attempt.run()
        for t, _ in waits:
            t.join(10)
        return attempt
    finally:
        for p in peers:
            p.close()


def test_a_push_counts_its_assignment_bytes_per_peer(tmp_path):
    """Every peer costs the coordinator one handshake and query/offer/commit/activate out, info/accept/commit
    back (the scaling bench reads these counts). Replies grow linearly with the peers; each offer carries the
    whole plan (every stage's line), so what the coordinator sends grows faster than linearly."""
    one = _pushed(tmp_path, ["127.0.0.3"]).wire()
    two = _pushed(tmp_path, ["127.0.0.3", "127.0.0.4"]).wire()
    assert (one.sent_frames, one.received_frames) == (4, 3)
    assert (two.sent_frames, two.received_frames) == (8, 6)
    assert one.sent_bytes > 0 and one.received_bytes > 0
    assert two.sent_bytes > 2 * one.sent_bytes + 100  # two offers, each naming both stages
    assert abs(two.received_bytes - 2 * one.received_bytes) < 0.1 * one.received_bytes
