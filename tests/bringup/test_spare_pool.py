"""Spares of a --pp-auto coordinator, and spares that misbehave when it hands them a stage (docs/bringup.md §5.6, §7).

A push with a spare leaves it standing by for that coordinator only. In-process, real sockets: the coordinator's real ``SparePool`` (the push over the assignment channel)
against real peer agents on 127.0.0.x whose answer to the offer is replaced. A spare holding another
secret, one that accepts another node than the one offered and one that replays an ``accepted`` frame
recorded on an earlier connection are each dropped from the pool with their reason; the next spare
takes the stage, or, with none left, nothing is written and ``replace`` says so (the stage stays down).
A stage's own address re-assigned (§5.7): nobody there is no error; a peer there holding another secret,
running another version or another checkpoint gets nothing; the honest peer gets the same stage back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel import __version__
from mlxcel.bringup.channel import dial
from mlxcel.bringup.machine import CoordinatorSession, Informed, PeerAccepted, PeerRefused
from mlxcel.bringup.plan import ClusterPlan, offer_fields, plan_cluster
from mlxcel.bringup.push import Push, PushConfig
from mlxcel.bringup.spares import SparePool, replacement_plan
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import load_secret
from mlxcel.models.identity import model_identity
from mlxcel.topology.partition import PartitionError, layer_costs
from tests.bringup.fake_peers import FakePeer, LyingPeer, ReplayingPeer
from tests.bringup.procs import COORDINATOR_HOST, free_port, write_secret
from tests.pipeline.members import wait_until  # a peer handles a message after our side returned

pytestmark = [pytest.mark.timeout(120)]
MEMORY = 1 << 34  # what a FakePeer reports


class Coordinator:
    """The parts of a running --pp-auto coordinator a ``SparePool`` needs, and the files it wrote."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.secret_path = write_secret(tmp / "cluster.secret")
        self.secret = load_secret(self.secret_path)
        self.control = PeerId.of(COORDINATOR_HOST, free_port(COORDINATOR_HOST))
        costs = layer_costs(model)
        self.config = PushConfig(control=self.control, cluster="mlxcel-cluster", mlxcel=__version__,
                                 model_identity=model_identity(model), costs=costs, secret_file=self.secret_path)
        stages = {PeerId.of(f"127.0.0.{i}", free_port(f"127.0.0.{i}")): MEMORY for i in (3, 4)}  # nobody listens
        self.plan = plan_cluster(costs, name="mlxcel-cluster", coordinator=self.control, memory=stages,
                                 secret_file=self.secret_path)
        self.written: list[ClusterPlan] = []

    def pool(self, *spares: FakePeer, **kwargs: float) -> SparePool:
        return SparePool(self.config, self.secret, self.plan, [s.address for s in spares], write_plan=self.written.append,
                         **kwargs)


@pytest.fixture
def coordinator(tmp_path, tiny_llama) -> Coordinator:
    return Coordinator(tmp_path, tiny_llama)


@pytest.fixture
def peers(tmp_path, tiny_llama, coordinator):
    made: list[FakePeer] = []

    def make(cls: type[FakePeer], host: str, secret: Path | None = None, **kwargs) -> FakePeer:  # noqa: ANN003
        peer = cls(tmp_path, host, kwargs.pop("model", tiny_llama), secret or coordinator.secret_path, **kwargs)
        made.append(peer)
        return peer

    yield make
    for peer in made:
        peer.close()


def _states(pool: SparePool) -> list[tuple[str, str]]:
    return [(s["address"], s["state"]) for s in pool.status()]


def test_a_push_with_a_spare_leaves_it_standing_by_for_that_coordinator_only(coordinator, peers):
    stage, spare = peers(FakePeer, "127.0.0.5"), peers(FakePeer, "127.0.0.6")
    attempt = Push(coordinator.config, coordinator.secret, [spare.address, stage.address],
                   write_plan=coordinator.written.append, stages=1)
    plan = attempt.run()
    assert [s.address for s in plan.stages] == [stage.address] and attempt.spares == [spare.address]
    assert wait_until(lambda: spare.state == "standby") and spare.standby_for == coordinator.control
    assert stage.wait(stage.release) is not None  # the stage was activated, the spare was not

    other = PeerId.of(COORDINATOR_HOST, free_port(COORDINATOR_HOST))  # another coordinator holding the secret
    session, chan = CoordinatorSession(spare.address), dial(spare.address, other, coordinator.secret)
    chan.send(session.query())
    refused = session.receive(chan.recv(5))
    chan.close()
    assert isinstance(refused, PeerRefused) and not refused.refusal.fatal
    assert refused.refusal.reason == f"this peer is a spare of the coordinator at {coordinator.control}"

    pool = SparePool(coordinator.config, coordinator.secret, plan, attempt.spares, write_plan=coordinator.written.append)
    assert pool.replace("stage-0") == spare.address
    assert spare.wait(spare.release).assignment.node_id == "stage-0"


def test_checks_report_a_spare_that_stops_answering_and_a_takeover_tries_it_last(coordinator, peers):
    gone, honest = peers(FakePeer, "127.0.0.5"), peers(FakePeer, "127.0.0.6")
    pool = coordinator.pool(gone, honest)
    pool.check_all()
    assert _states(pool) == [(str(gone.address), "standby"), (str(honest.address), "standby")]
    assert wait_until(lambda: gone.standby_for == honest.standby_for == coordinator.control)  # a standby session
    gone.close()
    pool.check_all()
    assert _states(pool) == [(str(gone.address), "unreachable"), (str(honest.address), "standby")]
    assert pool.status()[0]["reason"] == "Connection refused"
    assert pool.standbys() == [honest.address, gone.address]
    assert pool.replace("stage-1") == honest.address  # at once: the unreachable one comes last


def test_a_spare_holding_another_secret_is_skipped_and_the_next_one_takes_the_stage(coordinator, peers, tmp_path):
    impostor = peers(FakePeer, "127.0.0.5", secret=write_secret(tmp_path / "other.secret"))
    honest = peers(FakePeer, "127.0.0.6")
    pool = coordinator.pool(impostor, honest)
    assert _states(pool) == [(str(impostor.address), "standby"), (str(honest.address), "standby")]

    assert pool.replace("stage-1") == honest.address
    assert _states(pool) == [(str(impostor.address), "failed"), (str(honest.address), "stage-1"),
                             (str(coordinator.plan.stages[1].address), "replaced")]  # the stage's old address
    assert "secret mismatch" in pool.status()[0]["reason"]
    activated = honest.wait(honest.release)
    assert activated is not None and activated.assignment.node_id == "stage-1"
    assert activated.assignment.layers == (coordinator.plan.stages[1].start, coordinator.plan.stages[1].end)
    assert activated.assignment.cluster.stages[1].address == honest.address  # its TOML places it there
    assert activated.assignment.cluster.stages[0].address == coordinator.plan.stages[0].address  # the others stay
    [plan] = coordinator.written  # the coordinator's file is rewritten once, with the spare in the stage's place
    assert [s.address for s in plan.stages] == [coordinator.plan.stages[0].address, honest.address]
    assert impostor.state == "waiting"  # it learnt nothing and was assigned nothing


def test_a_spare_accepting_another_node_than_the_offered_is_refused(coordinator, peers):
    liar = peers(LyingPeer, "127.0.0.5")
    pool = coordinator.pool(liar)
    assert pool.replace("stage-1") is None  # no spare left: the stage stays down
    [status] = pool.status()
    assert status["state"] == "failed" and "accepted node 'stage-0', not the offered 'stage-1'" in status["reason"]
    assert coordinator.written == [] and pool.standbys() == []
    assert pool.replace("stage-1") is None  # a failed spare is never tried again


def test_a_replayed_accept_is_refused_and_the_next_spare_takes_the_stage(coordinator, peers):
    replayer = peers(ReplayingPeer, "127.0.0.5")
    honest = peers(FakePeer, "127.0.0.6")
    # an earlier, genuine session with the replayer: it accepts, the coordinator aborts
    session = CoordinatorSession(replayer.address)
    chan = dial(replayer.address, coordinator.control, coordinator.secret)
    chan.send(session.query())
    assert isinstance(session.receive(chan.recv(5)), Informed)
    moved = replacement_plan(coordinator.plan, "stage-1", replayer.address, MEMORY, coordinator.config.costs)
    chan.send(session.offer(**offer_fields(moved, 1, mlxcel=__version__, model_identity=coordinator.config.model_identity)))
    assert isinstance(session.receive(chan.recv(5)), PeerAccepted)
    chan.send(session.abort("test: the recorded session ends here"))
    chan.close()
    assert replayer.recorded is not None
    assert wait_until(lambda: replayer.state != "assigning", timeout=20)  # it has seen the recorded session end

    pool = coordinator.pool(replayer, honest)
    assert pool.replace("stage-1") == honest.address
    failed = pool.status()[0]
    assert failed["state"] == "failed" and "failed authentication (altered, replayed" in failed["reason"], failed
    assert [s.address for s in coordinator.written[-1].stages][1] == honest.address


def test_a_spare_too_small_for_the_stage_is_refused(coordinator):
    spare = PeerId.of("127.0.0.5", 1)
    with pytest.raises(PartitionError, match="stage 1 needs at least .* but has 9.8 KiB of memory"):
        replacement_plan(coordinator.plan, "stage-1", spare, 10_000, coordinator.config.costs)


def test_a_stage_restarted_at_its_address_gets_it_back_and_impostors_there_get_nothing(coordinator, peers, tmp_path,
                                                                                      tiny_qwen3, caplog):
    stage = coordinator.plan.stages[1]
    host, port = stage.address.host, stage.address.port
    pool = coordinator.pool(reassign_backoff_s=30)
    assert pool.reassign("stage-1") is False and not caplog.records  # nothing listens there yet: not an error
    assert not pool.has_spares

    impostor = peers(FakePeer, host, secret=write_secret(tmp_path / "other.secret"), port=port)
    assert pool.reassign("stage-1") is False
    assert "did not get stage-1 back" in caplog.text and "secret mismatch" in caplog.text
    impostor.close()
    honest = peers(FakePeer, host, port=port)
    assert pool.reassign("stage-1") is False  # within the backoff nothing is dialled
    assert honest.state == "waiting" and coordinator.written == []
    pool.reassign_backoff_s = 0
    honest.close()

    for liar in ({"mlxcel": "0.0.1"}, {"model": tiny_qwen3}):  # another version; another checkpoint (it exits)
        caplog.clear()
        peer = peers(FakePeer, host, port=port, **liar)
        assert pool.reassign("stage-1") is False and coordinator.written == []
        assert ("mlxcel version mismatch" if "mlxcel" in liar else "model identity mismatch") in caplog.text
        peer.close()

    honest = peers(FakePeer, host, port=port)
    assert pool.reassign("stage-1") is True
    activated = honest.wait(honest.release)
    assert activated is not None and activated.assignment.node_id == "stage-1"
    assert activated.assignment.layers == (stage.start, stage.end)
    assert [s.address for s in coordinator.written[-1].stages] == [s.address for s in coordinator.plan.stages]
    assert pool.reassigned == {"stage-1": 1} and pool.status() == []


def test_a_stage_host_returning_after_a_takeover_joins_as_a_spare(coordinator, peers, caplog):
    """§5.6 "Replaced": the address a spare took a stage from is checked like a spare; a peer waiting there (the old
    stage host started again) is told to stand by and becomes a standby the next takeover may use."""
    spare = peers(FakePeer, "127.0.0.6")
    pool = coordinator.pool(spare)
    old = coordinator.plan.stages[1].address
    assert pool.replace("stage-1") == spare.address
    assert spare.wait(spare.release).assignment.node_id == "stage-1"
    assert _states(pool) == [(str(spare.address), "stage-1"), (str(old), "replaced")]
    assert pool.status()[1]["reason"] == (f"stage-1 was taken over by {spare.address}; a peer started again here "
                                          "joins as a spare")
    assert pool.standbys() == []  # never tried in a takeover while nothing waits there
    caplog.clear()
    pool.check_all()  # nothing listens there yet: not an error, nothing logged
    assert _states(pool)[1] == (str(old), "replaced") and not caplog.records

    returning = peers(FakePeer, old.host, port=old.port)  # the old stage host, started again as a --pp-peer
    pool.check_all()
    assert _states(pool)[1] == (str(old), "standby")
    assert wait_until(lambda: returning.state == "standby") and returning.standby_for == coordinator.control
    assert f"the peer at {old} joins as a spare (stage-1 is served by {spare.address})" in caplog.text
    assert pool.standbys() == [old]
    assert pool.replace("stage-1") == old  # the spare that took stage-1 died in turn: the old host takes it back
    assert returning.wait(returning.release).assignment.node_id == "stage-1"
    assert _states(pool) == [(str(spare.address), "replaced"), (str(old), "stage-1")]
