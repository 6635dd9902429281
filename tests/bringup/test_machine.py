"""The assignment protocol v2 as sans-I/O machines: a full exchange, the peer's checks in the
reference's order (fatal or back to waiting), version 1, aborts, call order and malformed messages."""

from __future__ import annotations

import json
import tomllib

import pytest

from mlxcel.bringup.errors import AssignmentProtocolError, ProtocolMismatch
from mlxcel.bringup.machine import (
    Aborted,
    Activated,
    CommitRequested,
    CoordinatorSession,
    Informed,
    OfferAccepted,
    OfferRefused,
    PeerAccepted,
    PeerCommitFailed,
    PeerCommitted,
    PeerFacts,
    PeerMachine,
    PeerRefused,
    Queried,
    StoodBy,
)
from mlxcel.bringup.messages import Msg, decode, encode
from mlxcel.bringup.plan import offer_fields, plan_cluster
from mlxcel.cluster.errors import LocalProtocolError
from mlxcel.cluster.identity import PeerId
from mlxcel.topology.partition import StageCosts

COSTS = StageCosts(model="m", layers=(100, 100, 100, 100, 100, 100), embed=300, norm=1, head=300, tied=True)
COORD = PeerId.of("127.0.0.2", 19000)
PEERS = [PeerId.of("127.0.0.4", 19001), PeerId.of("127.0.0.3", 19001)]
MEMORY = 1 << 30
IDENTITY = "ab" * 32


def facts(**kw) -> PeerFacts:
    base = dict(mlxcel="0.1.0", cluster="mlxcel-cluster", model_identity=IDENTITY, costs=COSTS, memory=MEMORY,
                listener=PeerId.of("127.0.0.3", 19001))
    return PeerFacts(**{**base, **kw})


def plan(**kw):
    args = dict(name="mlxcel-cluster", coordinator=COORD, memory={p: MEMORY for p in PEERS},
                secret_file=None)
    return plan_cluster(COSTS, **{**args, **kw})


def offer_for(index: int = 0, **changes) -> dict:
    fields = offer_fields(plan(), index, mlxcel="0.1.0", model_identity=IDENTITY)
    return {**fields, **changes}


def informed_pair(peer_facts: PeerFacts | None = None, bound: PeerId = COORD, local_ip: str = "127.0.0.3"):
    session, machine = CoordinatorSession(PEERS[1]), PeerMachine(peer_facts or facts(), bound, local_ip)
    event = machine.receive(session.query())
    assert isinstance(event, Queried)
    assert isinstance(session.receive(event.reply), Informed)
    return session, machine


def test_a_whole_exchange_activates_the_planned_stage():
    session, machine = informed_pair()
    assert machine.wait_s == 60  # the coordinator may still be reaching other peers
    accepted = machine.receive(session.offer(**offer_for(0)))
    assert isinstance(accepted, OfferAccepted) and machine.state == "ACCEPTED" and machine.wait_s == 60
    assert isinstance(session.receive(accepted.reply), PeerAccepted)
    assert isinstance(machine.receive(session.commit()), CommitRequested)
    assert isinstance(session.receive(machine.committed()), PeerCommitted) and machine.wait_s == 60
    activated = machine.receive(session.activate())
    assert isinstance(activated, Activated) and machine.state == "ACTIVATED" == session.state
    a = activated.assignment
    assert (a.node_id, a.stage, a.layers, a.coordinator) == ("stage-0", 0, (0, 3), COORD)
    assert [n.address for n in a.cluster.stages] == sorted(PEERS, key=str)  # stage ids in address order
    assert tomllib.loads(a.toml)["cluster"]["pipeline_parallel_size"] == 2


def test_info_reports_version_and_memory():
    machine = PeerMachine(facts(memory=12345), COORD, "127.0.0.3")
    assert machine.wait_s == 10  # the first frame: one frame window
    reply = machine.receive(CoordinatorSession(PEERS[0]).query()).reply
    assert decode(reply).fields == {"mlxcel": "0.1.0", "memory": 12345}


# Every check broken at once, then repaired one at a time in the reference's order: each refusal
# names the first check still failing, and says whether the peer exits or waits again.
CHECKS = [
    ("mlxcel", {"mlxcel": "0.0.9"}, "mlxcel version mismatch", True),
    ("cluster", {"cluster": "other"}, "cluster name mismatch", False),
    ("model", {"model_identity": "cd" * 32}, "model identity mismatch", True),
    ("layers", {"layers": [0, 2]}, "layer range mismatch", True),
    ("node id", {"node_id": "stage-7"}, "not 'stage-0'", False),
    ("toml", {"toml": "[cluster]\nname = 'x'\n"}, "the offered cluster TOML is not usable", False),
]


def test_offer_checks_run_in_the_reference_order():
    broken: dict = {}
    for _, change, _, _ in CHECKS:
        broken.update(change)
    for name, change, reason, fatal in CHECKS:
        _, machine = informed_pair()
        event = machine.receive(encode(Msg.OFFER, **offer_for(0, **broken)))
        assert isinstance(event, OfferRefused), name
        assert reason in event.refusal.reason and event.refusal.fatal is fatal, (name, event.refusal)
        assert decode(event.reply).fields == {"reason": event.refusal.reason, "fatal": fatal}
        for key in change:
            del broken[key]
    _, machine = informed_pair()
    assert isinstance(machine.receive(encode(Msg.OFFER, **offer_for(0, **broken))), OfferAccepted)


def test_the_peer_recomputes_its_range_with_the_offered_memories():
    """A memory cap moves the split; the peer derives the same range from its own checkpoint."""
    capped = plan(memory={PEERS[0]: MEMORY, PEERS[1]: 550})  # 127.0.0.3 (stage-0) holds at most 550 bytes
    assert [(s.start, s.end) for s in capped.stages] == [(0, 2), (2, 6)]
    _, machine = informed_pair()
    fields = offer_fields(capped, 0, mlxcel="0.1.0", model_identity=IDENTITY)
    assert isinstance(machine.receive(encode(Msg.OFFER, **fields)), OfferAccepted)
    _, machine = informed_pair()
    uncapped_range = offer_for(0)["layers"]
    event = machine.receive(encode(Msg.OFFER, **{**fields, "layers": uncapped_range}))
    assert isinstance(event, OfferRefused) and event.refusal.fatal and "gives 0-1" in event.refusal.reason


def test_placement_and_coordinator_identity_send_the_peer_back_to_waiting():
    # this peer listens on 127.0.0.3:19002, the cluster places stage-0 on port 19001
    _, machine = informed_pair(facts(listener=PeerId.of("127.0.0.3", 19002)))
    event = machine.receive(encode(Msg.OFFER, **offer_for(0)))
    assert not event.refusal.fatal and "places stage-0 at 127.0.0.3:19001" in event.refusal.reason
    # an unspecified listener IP: the address this connection reached it at must be the offered one
    _, machine = informed_pair(facts(listener=PeerId.of("0.0.0.0", 19001)), local_ip="127.0.0.9")
    event = machine.receive(encode(Msg.OFFER, **offer_for(0)))
    assert not event.refusal.fatal and "listens on 127.0.0.9:19001" in event.refusal.reason
    _, machine = informed_pair(facts(listener=PeerId.of("0.0.0.0", 19001)), local_ip="127.0.0.3")
    assert isinstance(machine.receive(encode(Msg.OFFER, **offer_for(0))), OfferAccepted)
    # the handshake bound another identity than the offer's control address and coordinator node
    _, machine = informed_pair(bound=PeerId.of("127.0.0.2", 19999))
    event = machine.receive(encode(Msg.OFFER, **offer_for(0)))
    assert not event.refusal.fatal and "control address 127.0.0.2:19000 is not the identity" in event.refusal.reason
    # the control address matches, the TOML's coordinator node does not
    other = plan(coordinator=PeerId.of("127.0.0.2", 19999)).body()
    _, machine = informed_pair()
    event = machine.receive(encode(Msg.OFFER, **offer_for(0, toml=other)))
    assert not event.refusal.fatal and "coordinator node 127.0.0.2:19999" in event.refusal.reason


def test_a_coordinator_on_an_unspecified_ip_matches_any_source_on_its_port():
    fields = offer_fields(plan(coordinator=PeerId.of("0.0.0.0", 19000)), 0, mlxcel="0.1.0", model_identity=IDENTITY)
    _, machine = informed_pair(bound=PeerId.of("127.0.0.2", 19000))
    assert isinstance(machine.receive(encode(Msg.OFFER, **fields)), OfferAccepted)


def test_version_1_is_refused_with_assignment_protocol_mismatch():
    machine = PeerMachine(facts(), COORD, "127.0.0.3")
    v1 = json.dumps({"protocol": 1, "msg": "offer", "stage": 0}).encode()
    event = machine.receive(v1)
    assert isinstance(event, OfferRefused) and event.refusal.fatal
    assert event.refusal.reason.startswith("assignment protocol mismatch: the other side speaks version 1")
    session = CoordinatorSession(PEERS[0])
    session.query()
    with pytest.raises(ProtocolMismatch, match="^assignment protocol mismatch"):
        session.receive(json.dumps({"protocol": 1, "msg": "info"}).encode())
    assert session.state == "ERROR"


@pytest.mark.parametrize("stage", ["IDLE", "INFORMED", "ACCEPTED", "COMMITTED"])
def test_abort_in_any_waiting_state_goes_back_to_waiting(stage):
    session, machine = CoordinatorSession(PEERS[1]), PeerMachine(facts(), COORD, "127.0.0.3")
    steps = {"IDLE": 0, "INFORMED": 1, "ACCEPTED": 2, "COMMITTED": 3}[stage]
    if steps >= 1:
        session.receive(machine.receive(session.query()).reply)
    if steps >= 2:
        session.receive(machine.receive(session.offer(**offer_for(0))).reply)
    if steps >= 3:
        machine.receive(session.commit())
        session.receive(machine.committed())
    if steps == 0:
        session.query()
    assert machine.state == stage
    event = machine.receive(session.abort("127.0.0.4:19001 (stage-1) did not commit: it could not prepare"))
    assert isinstance(event, Aborted) and "(stage-1) did not commit" in event.reason and machine.state == "ABORTED"


def test_refusals_and_commit_failures_reach_the_session():
    session, machine = informed_pair(facts(cluster="other"))
    refused = machine.receive(session.offer(**offer_for(0)))
    event = session.receive(refused.reply)
    assert isinstance(event, PeerRefused) and not event.refusal.fatal and session.state == "REFUSED"
    session, machine = informed_pair()
    session.receive(machine.receive(session.offer(**offer_for(0))).reply)
    machine.receive(session.commit())
    event = session.receive(machine.commit_failed("cannot write /x: Permission denied"))
    assert isinstance(event, PeerCommitFailed) and "Permission denied" in event.reason
    assert (session.state, machine.state) == ("FAILED", "FAILED")


def test_standby_after_info_makes_the_peer_a_spare():
    session, machine = informed_pair()
    event = machine.receive(session.standby(2))
    assert isinstance(event, StoodBy) and event.stages == 2
    assert machine.state == "STANDBY" == session.state and machine.wait_s == 0 and session.finished
    with pytest.raises(LocalProtocolError):
        session.abort("x")  # STANDBY is final: the connection closes
    with pytest.raises(AssignmentProtocolError, match="unexpected standby message in state IDLE"):
        PeerMachine(facts(), COORD, "127.0.0.3").receive(encode(Msg.STANDBY, stages=2))
    accepted_pair, accepted = informed_pair()
    accepted.receive(accepted_pair.offer(**offer_for(0)))
    with pytest.raises(AssignmentProtocolError, match="unexpected standby message in state ACCEPTED"):
        accepted.receive(encode(Msg.STANDBY, stages=2))  # only before an offer
    with pytest.raises(LocalProtocolError):
        CoordinatorSession(PEERS[0]).standby(2)  # not queried yet


def test_busy_peer_refuses_without_judging():
    session, machine = CoordinatorSession(PEERS[0]), PeerMachine(facts(), COORD, "127.0.0.3")
    machine.receive(session.query())
    event = session.receive(machine.refuse("this peer is busy"))
    assert isinstance(event, PeerRefused) and not event.refusal.fatal


def test_unexpected_messages_and_calls_out_of_order():
    session, machine = CoordinatorSession(PEERS[0]), PeerMachine(facts(), COORD, "127.0.0.3")
    with pytest.raises(AssignmentProtocolError, match="unexpected commit message in state IDLE"):
        machine.receive(encode(Msg.COMMIT))
    assert machine.state == "ERROR"
    with pytest.raises(LocalProtocolError):
        machine.receive(encode(Msg.QUERY))
    with pytest.raises(LocalProtocolError):
        session.commit()
    with pytest.raises(LocalProtocolError):
        session.receive(encode(Msg.INFO, mlxcel="0.1.0", memory=1))  # nothing asked yet
    session.query()
    with pytest.raises(AssignmentProtocolError, match="unexpected accepted"):
        session.receive(encode(Msg.ACCEPTED, node_id="stage-0"))
    with pytest.raises(LocalProtocolError):
        session.abort("x")  # ERROR is terminal


@pytest.mark.parametrize("payload,match", [
    (b"\xff\xfe", "not a UTF-8 JSON object"),
    (b"[2]", "not a JSON object"),
    (b'{"protocol": 2, "msg": "hello"}', "unknown assignment message kind 'hello'"),
    (b'{"protocol": 2, "msg": "query", "x": 1}', r"unknown \['x'\]"),
    (b'{"protocol": 2, "msg": "info", "mlxcel": "0.1.0"}', r"missing \['memory'\]"),
    (b'{"protocol": 2, "msg": "info", "mlxcel": "0.1.0", "memory": -1}', "bad value for memory"),
    (b'{"protocol": 2, "msg": "info", "mlxcel": "0.1.0", "memory": true}', "bad value for memory"),
    (b'{"protocol": 2, "msg": "refused", "reason": "x", "fatal": 1}', "bad value for fatal"),
    (b'{"protocol": "2", "msg": "query"}', "assignment protocol mismatch"),
    (b'{"msg": "query"}', "assignment protocol mismatch: the other side speaks version None"),
    (b'{"protocol": 2, "msg": "query", "pad": "' + b"x" * 70000 + b'"}', "exceeds 65536"),
])
def test_malformed_messages_are_refused(payload, match):
    with pytest.raises(AssignmentProtocolError, match=match):
        decode(payload)


def test_offer_layers_and_memory_are_bounded():
    for bad in ({"layers": [3, 3]}, {"layers": [0]}, {"memory": []}, {"memory": [0, 1]}):
        raw = json.dumps({"protocol": 2, "msg": "offer", **offer_for(0, **bad)}).encode()
        with pytest.raises(AssignmentProtocolError, match="bad value"):
            decode(raw)
    with pytest.raises(ValueError):
        encode(Msg.OFFER, **offer_for(0, stage=True))


def test_the_documented_messages_are_what_mlxcel_sends():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "bringup.md").read_text()
    block = re.search(r"```assignment-vector\n(.*?)```", doc, re.S)
    assert block, "docs/bringup.md lost its assignment-vector block"
    vectors = dict(line.split(" = ", 1) for line in block.group(1).splitlines() if line.strip())
    for name, text in vectors.items():
        msg = decode(text.encode())
        assert msg.kind.value == name and encode(msg.kind, **msg.fields) == text.encode(), name
