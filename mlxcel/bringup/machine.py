"""Sans-I/O assignment protocol, version 2 (docs/bringup.md §3-4): the peer's machine and the
coordinator's per-peer session. Bytes in, events (and the bytes to send) out; no sockets.

Rules of the state machines (h11 ``_state.py`` style; C = coordinator, P = peer):

Peer:     IDLE --recv QUERY / send INFO--> INFORMED
          INFORMED --recv OFFER, every check passed / send ACCEPTED--> ACCEPTED
          INFORMED --recv OFFER, a check failed / send REFUSED--> REFUSED          (close)
          ACCEPTED --recv COMMIT--> COMMITTING --committed()--> COMMITTED
                                               --commit_failed()--> FAILED      (close)
          COMMITTED --recv ACTIVATE--> ACTIVATED                                (close, start the stage)
          IDLE | INFORMED | ACCEPTED | COMMITTED --recv ABORT--> ABORTED        (close)
          INFORMED --recv STANDBY--> STANDBY                                    (close, wait as a spare)
          any --a message of another protocol version / send REFUSED(fatal)--> REFUSED
Session:  START --query()--> QUERIED --recv INFO--> INFORMED --offer()--> OFFERED
          OFFERED --recv ACCEPTED--> ACCEPTED --commit()--> COMMITTING
          COMMITTING --recv COMMITTED--> COMMITTED --activate()--> ACTIVATED
          QUERIED | OFFERED --recv REFUSED--> REFUSED;  COMMITTING --recv COMMIT_FAILED--> FAILED
          INFORMED --standby()--> STANDBY (a spare: the bring-up succeeded without it)
          any state but a final one --abort()--> ABORTED

A message the current state does not expect raises ``AssignmentProtocolError`` and moves the
machine to ERROR; calling a method in the wrong state raises ``LocalProtocolError``.
``wait_s`` is how long the driver waits for the next frame in the current state.

The peer's checks of an offer run in the reference's order (``judge_offer``): protocol version,
mlxcel version, cluster name, model identity, the stage's layer range recomputed from this peer's
own checkpoint, the node id ``stage-<i>``, the offered cluster TOML (placing this peer at its
listener), and the coordinator's control address and node against the identity the handshake
bound. Version, model and layer-range failures are fatal (the peer process ends with "stage
assignment refused"); the others send the peer back to waiting.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel.cluster.errors import LocalProtocolError
from mlxcel.cluster.identity import PeerId, canonical_ip
from mlxcel.topology.cluster_config import ClusterConfig, ClusterConfigError, parse_cluster_config
from mlxcel.topology.partition import PartitionError, StageCosts, format_range, plan_stages

from .errors import AssignmentProtocolError, ProtocolMismatch, Refusal
from .messages import Message, Msg, decode, encode
from .wire import ACTIVATE_WAIT_S, COMMIT_WAIT_S, FRAME_TIMEOUT_S, PUSH_WINDOW_S

# -- what a peer knows about itself ------------------------------------------------------------


@dataclass(frozen=True)
class PeerFacts:
    """What a peer compares an offer against: its versions, cluster, checkpoint and listener."""

    mlxcel: str
    cluster: str
    model_identity: str
    costs: StageCosts  # parameter bytes of its own checkpoint (safetensors headers)
    memory: int  # bytes this peer reports for its stage
    listener: PeerId  # its assignment listener's bound address (the IP may be unspecified)


@dataclass(frozen=True)
class Assignment:
    """An accepted offer: this peer is ``node_id`` (stage ``stage``) of ``cluster``."""

    node_id: str
    stage: int
    layers: tuple[int, int]
    coordinator: PeerId
    toml: str  # the cluster TOML body, as offered
    cluster: ClusterConfig


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Queried:
    """Peer: send ``reply`` (INFO)."""

    reply: bytes


@dataclass(frozen=True)
class OfferAccepted:
    """Peer: every check passed; send ``reply`` (ACCEPTED)."""

    assignment: Assignment
    reply: bytes


@dataclass(frozen=True)
class OfferRefused:
    """Peer: send ``reply`` (REFUSED) and close; ``refusal.fatal`` ends the peer process."""

    refusal: Refusal
    reply: bytes


@dataclass(frozen=True)
class CommitRequested:
    """Peer: stage the cluster TOML, then ``committed()`` or ``commit_failed(reason)``."""


@dataclass(frozen=True)
class Activated:
    """Peer: write the cluster TOML and start the stage."""

    assignment: Assignment


@dataclass(frozen=True)
class Aborted:
    """Either side learned that the bring-up was abandoned; ``reason`` is the failure summary."""

    reason: str


@dataclass(frozen=True)
class StoodBy:
    """Peer: the coordinator keeps this peer as a spare of its ``stages``-stage cluster."""

    stages: int


@dataclass(frozen=True)
class Informed:
    """Session: the peer's mlxcel version and the memory it reports for its stage."""

    mlxcel: str
    memory: int


@dataclass(frozen=True)
class PeerAccepted:
    """Session: the peer accepted the offer."""


@dataclass(frozen=True)
class PeerRefused:
    """Session: the peer refused (``refusal.fatal``: that peer process has ended)."""

    refusal: Refusal


@dataclass(frozen=True)
class PeerCommitted:
    """Session: the peer staged its cluster TOML."""


@dataclass(frozen=True)
class PeerCommitFailed:
    """Session: the peer could not prepare; ``reason`` says why."""

    reason: str


# -- the offer checks (pure) -------------------------------------------------------------------


def addresses_match(offered: PeerId, bound: PeerId) -> bool:
    """An offered control address names the handshake-bound identity: equal, or an unspecified
    IP on the same port (the stage's coordinator check reads it the same way)."""
    if offered.ip.is_unspecified:
        return offered.port == bound.port
    return offered == bound


def expected_range(costs: StageCosts, stages: int, memory: list[int], stage: int) -> tuple[int, int]:
    """The layers this checkpoint gives stage ``stage`` of ``stages`` with those memories: the
    partitioner ``mlxcel plan`` uses (``plan_stages``)."""
    planned = plan_stages(costs, stages, memory)[stage]
    return planned.start, planned.end


def _fatal(reason: str) -> Refusal:
    return Refusal(reason, fatal=True)


def _waiting(reason: str) -> Refusal:
    return Refusal(reason, fatal=False)


def judge_offer(offer: Message, facts: PeerFacts, bound: PeerId, local_ip: str) -> Refusal | Assignment:
    """Run the checks in the reference's order; the first failure is the refusal, else the assignment.

    ``bound`` is the identity the handshake bound to the connection (the coordinator's control
    address), ``local_ip`` the address this connection reached the peer at. (The protocol version
    was checked when the message was decoded.)
    """
    if offer["mlxcel"] != facts.mlxcel:
        return _fatal(f"mlxcel version mismatch: the coordinator runs mlxcel {offer['mlxcel']}, "
                      f"this peer runs {facts.mlxcel}")
    if offer["cluster"] != facts.cluster:
        return _waiting(f"cluster name mismatch: the coordinator forms cluster {offer['cluster']!r}, "
                        f"this peer belongs to {facts.cluster!r} (--cluster-name)")
    if offer["model_identity"] != facts.model_identity:
        return _fatal(f"model identity mismatch: the coordinator serves model {offer['model_identity'][:16]}..., "
                      f"this peer holds {facts.model_identity[:16]}... (the model directory must be the same "
                      "checkpoint on every host: compare `mlxcel models info` on both)")
    refusal = _check_layers(offer, facts)
    if refusal is not None:
        return refusal
    stage = offer["stage"]
    if offer["node_id"] != f"stage-{stage}":
        return _waiting(f"the offer names node {offer['node_id']!r} for stage {stage}, not 'stage-{stage}'")
    cluster = _offered_cluster(offer, facts)
    if isinstance(cluster, Refusal):
        return cluster
    node = cluster.stages[stage]
    refusal = _check_placement(node.address, facts.listener, local_ip, offer["node_id"])
    if refusal is not None:
        return refusal
    refusal = _check_coordinator(offer, cluster, bound)
    if refusal is not None:
        return refusal
    return Assignment(offer["node_id"], stage, tuple(offer["layers"]), bound, offer["toml"], cluster)  # type: ignore[arg-type]


def _check_layers(offer: Message, facts: PeerFacts) -> Refusal | None:
    stages, stage, memory = offer["stages"], offer["stage"], offer["memory"]
    if not 1 <= stages or stage >= stages or len(memory) != stages:
        return _waiting(f"malformed offer: stage {stage} of {stages} with {len(memory)} memory values")
    try:
        mine = expected_range(facts.costs, stages, memory, stage)
    except PartitionError as exc:
        return _fatal(f"layer range mismatch: this peer's checkpoint cannot be split into {stages} stages "
                      f"that way: {exc}")
    offered = tuple(offer["layers"])
    if offered != mine:
        return _fatal(f"layer range mismatch: the coordinator offers layers {format_range(*offered)} for stage "
                      f"{stage}, this peer's checkpoint gives {format_range(*mine)}")
    return None


def _offered_cluster(offer: Message, facts: PeerFacts) -> ClusterConfig | Refusal:
    """The offered TOML, parsed by the cluster config loader and consistent with the offer."""
    where = Path("<offered cluster TOML>")
    try:
        cluster = parse_cluster_config(tomllib.loads(offer["toml"]), where)
        cluster.check_layers(facts.costs.num_layers)
    except (tomllib.TOMLDecodeError, ClusterConfigError) as exc:
        return _waiting(f"the offered cluster TOML is not usable: {exc}")
    stage = offer["stage"]
    problems = []
    if cluster.name != offer["cluster"]:
        problems.append(f"its cluster name is {cluster.name!r}")
    if len(cluster.stages) != offer["stages"]:
        problems.append(f"it lists {len(cluster.stages)} stages, the offer {offer['stages']}")
    elif cluster.stages[stage].id != offer["node_id"] or cluster.stages[stage].layers != tuple(offer["layers"]):
        node = cluster.stages[stage]
        problems.append(f"its stage {stage} is {node.id!r} with layers {node.layers}")
    if problems:
        return _waiting("the offered cluster TOML does not match the offer: " + "; ".join(problems))
    return cluster


def _check_placement(address: PeerId, listener: PeerId, local_ip: str, node_id: str) -> Refusal | None:
    ip = canonical_ip(local_ip) if listener.ip.is_unspecified else listener.ip
    if address.port != listener.port or address.ip != ip:
        return _waiting(f"the offered cluster places {node_id} at {address}, but this peer listens on "
                        f"{PeerId(str(ip), listener.port)}")
    return None


def _check_coordinator(offer: Message, cluster: ClusterConfig, bound: PeerId) -> Refusal | None:
    try:
        control = PeerId.parse(offer["coordinator"])
    except ValueError:
        return _waiting(f"the offer's coordinator address {offer['coordinator']!r} is not ip:port")
    for what, address in (("control address", control), ("coordinator node", cluster.coordinator.address)):
        if not addresses_match(address, bound):
            return _waiting(f"the offer's {what} {address} is not the identity this connection "
                            f"authenticated ({bound}): the coordinator's --cluster-control-addr must be the address it "
                            "connects from")
    return None


# -- the peer's machine --------------------------------------------------------------------------

_PEER_RECEIVES: dict[str, frozenset[Msg]] = {
    "IDLE": frozenset({Msg.QUERY, Msg.ABORT}),
    "INFORMED": frozenset({Msg.OFFER, Msg.ABORT, Msg.STANDBY}),
    "ACCEPTED": frozenset({Msg.COMMIT, Msg.ABORT}),
    "COMMITTED": frozenset({Msg.ACTIVATE, Msg.ABORT}),
}
_PEER_WAIT_S = {"IDLE": FRAME_TIMEOUT_S, "INFORMED": PUSH_WINDOW_S, "ACCEPTED": COMMIT_WAIT_S,
                "COMMITTED": ACTIVATE_WAIT_S}


class _Machine:
    state: str

    def _expect(self, *states: str) -> None:
        if self.state not in states:
            raise LocalProtocolError(f"{type(self).__name__}: not allowed in state {self.state}")

    def _decode(self, payload: bytes, allowed: frozenset[Msg]) -> Message:
        try:
            msg = decode(payload)
        except AssignmentProtocolError:
            self.state = "ERROR"
            raise
        if msg.kind not in allowed:
            error = AssignmentProtocolError(f"unexpected {msg.kind.value} message in state {self.state}")
            self.state = "ERROR"
            raise error
        return msg


class PeerMachine(_Machine):
    """One assignment connection, seen from the peer."""

    def __init__(self, facts: PeerFacts, bound: PeerId, local_ip: str) -> None:
        self.facts = facts
        self.bound = bound  # the coordinator's control address, as the handshake bound it
        self.local_ip = local_ip
        self.state = "IDLE"
        self.assignment: Assignment | None = None

    def __repr__(self) -> str:
        return f"PeerMachine(state={self.state}, coordinator={self.bound})"

    @property
    def wait_s(self) -> float:
        """Seconds to wait for the next frame in this state (0: expect none)."""
        return _PEER_WAIT_S.get(self.state, 0.0)

    def receive(self, payload: bytes) -> object:
        """One message from the coordinator -> an event; raises ``AssignmentProtocolError``
        (the connection closes) except for another version, which is a fatal refusal."""
        allowed = _PEER_RECEIVES.get(self.state)
        if allowed is None:
            raise LocalProtocolError(f"PeerMachine: no message expected in state {self.state}")
        try:
            msg = self._decode(payload, allowed)
        except ProtocolMismatch as exc:
            return self._refuse(_fatal(str(exc)))
        if msg.kind is Msg.ABORT:
            self.state = "ABORTED"
            return Aborted(msg["reason"])
        if msg.kind is Msg.STANDBY:
            self.state = "STANDBY"
            return StoodBy(msg["stages"])
        if msg.kind is Msg.QUERY:
            self.state = "INFORMED"
            return Queried(encode(Msg.INFO, mlxcel=self.facts.mlxcel, memory=self.facts.memory))
        if msg.kind is Msg.OFFER:
            verdict = judge_offer(msg, self.facts, self.bound, self.local_ip)
            if isinstance(verdict, Refusal):
                return self._refuse(verdict)
            self.assignment = verdict
            self.state = "ACCEPTED"
            return OfferAccepted(verdict, encode(Msg.ACCEPTED, node_id=verdict.node_id))
        if msg.kind is Msg.COMMIT:
            self.state = "COMMITTING"
            return CommitRequested()
        assert msg.kind is Msg.ACTIVATE and self.assignment is not None
        self.state = "ACTIVATED"
        return Activated(self.assignment)

    def _refuse(self, refusal: Refusal) -> OfferRefused:
        self.state = "REFUSED"
        return OfferRefused(refusal, encode(Msg.REFUSED, reason=refusal.reason, fatal=refusal.fatal))

    def refuse(self, reason: str) -> bytes:
        """Refuse without judging (this peer is busy with another coordinator): not fatal."""
        self._expect("IDLE", "INFORMED")
        return self._refuse(_waiting(reason)).reply

    def committed(self) -> bytes:
        """COMMITTING -> COMMITTED: the COMMITTED message."""
        self._expect("COMMITTING")
        self.state = "COMMITTED"
        return encode(Msg.COMMITTED)

    def commit_failed(self, reason: str) -> bytes:
        """COMMITTING -> FAILED: the COMMIT_FAILED message."""
        self._expect("COMMITTING")
        self.state = "FAILED"
        return encode(Msg.COMMIT_FAILED, reason=reason)


# -- the coordinator's session with one peer ------------------------------------------------------

_SESSION_RECEIVES: dict[str, frozenset[Msg]] = {
    "QUERIED": frozenset({Msg.INFO, Msg.REFUSED}),
    "OFFERED": frozenset({Msg.ACCEPTED, Msg.REFUSED}),
    "COMMITTING": frozenset({Msg.COMMITTED, Msg.COMMIT_FAILED}),
}
_TERMINAL = ("ACTIVATED", "ABORTED", "REFUSED", "FAILED", "ERROR", "STANDBY")


class CoordinatorSession(_Machine):
    """One assignment connection, seen from the coordinator."""

    def __init__(self, peer: PeerId) -> None:
        self.peer = peer
        self.state = "START"
        self.node_id: str | None = None

    def __repr__(self) -> str:
        return f"CoordinatorSession(peer={self.peer}, state={self.state})"

    @property
    def finished(self) -> bool:
        """In a final state: nothing more is sent on this session."""
        return self.state in _TERMINAL

    def query(self) -> bytes:
        self._expect("START")
        self.state = "QUERIED"
        return encode(Msg.QUERY)

    def offer(self, **fields: Any) -> bytes:
        """INFORMED -> OFFERED: the OFFER message (fields as in ``messages.FIELDS``)."""
        self._expect("INFORMED")
        data = encode(Msg.OFFER, **fields)
        self.node_id = fields["node_id"]
        self.state = "OFFERED"
        return data

    def commit(self) -> bytes:
        self._expect("ACCEPTED")
        self.state = "COMMITTING"
        return encode(Msg.COMMIT)

    def activate(self) -> bytes:
        self._expect("COMMITTED")
        self.state = "ACTIVATED"
        return encode(Msg.ACTIVATE)

    def standby(self, stages: int) -> bytes:
        """INFORMED -> STANDBY: the STANDBY message (this peer is a spare of a ``stages``-stage cluster)."""
        self._expect("INFORMED")
        self.state = "STANDBY"
        return encode(Msg.STANDBY, stages=stages)

    def abort(self, reason: str) -> bytes:
        """Any live state -> ABORTED: the ABORT message carrying the failure summary."""
        if self.state in _TERMINAL:
            raise LocalProtocolError(f"CoordinatorSession: cannot abort in state {self.state}")
        self.state = "ABORTED"
        return encode(Msg.ABORT, reason=reason)

    def receive(self, payload: bytes) -> object:
        """One message from the peer -> an event; raises ``AssignmentProtocolError``
        (``ProtocolMismatch`` for another version)."""
        allowed = _SESSION_RECEIVES.get(self.state)
        if allowed is None:
            raise LocalProtocolError(f"CoordinatorSession: no message expected in state {self.state}")
        msg = self._decode(payload, allowed)
        if msg.kind is Msg.REFUSED:
            self.state = "REFUSED"
            return PeerRefused(Refusal(msg["reason"], msg["fatal"]))
        if msg.kind is Msg.INFO:
            self.state = "INFORMED"
            return Informed(msg["mlxcel"], msg["memory"])
        if msg.kind is Msg.ACCEPTED:
            if msg["node_id"] != self.node_id:
                self.state = "ERROR"
                raise AssignmentProtocolError(f"the peer accepted node {msg['node_id']!r}, not the offered {self.node_id!r}")
            self.state = "ACCEPTED"
            return PeerAccepted()
        if msg.kind is Msg.COMMITTED:
            self.state = "COMMITTED"
            return PeerCommitted()
        self.state = "FAILED"
        return PeerCommitFailed(msg["reason"])
