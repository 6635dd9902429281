"""The peer's side of the bring-up: the assignment listener, one session at a time, beacons, the wait.

``PeerAgent.start()`` binds the assignment listener (the cluster ``Listener`` with the assignment
channel's options: its own keys, a pending pool of 8 in all and 4 per source) and starts beaconing
under mdns discovery. Each authenticated connection runs one ``PeerMachine`` on its handshake thread
(``_Session.read_loop``); ``wait()`` returns the activated assignment, raises ``AssignmentRefused``
(fatal) or ``AssignmentTimeout`` (600 s without an assignment), or returns None when stopped.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from mlxcel.cluster.errors import ClusterError
from mlxcel.cluster.handshake import Established
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.listener import Listener
from mlxcel.cluster.options import TransportOptions
from mlxcel.cluster.ratelimit import RateLimitedLog, WarnClass, cluster_warnings
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.topology.cluster_config import ClusterConfigError, load_cluster_config
from mlxcel.topology.partition import format_range

from .beacon import BeaconSender
from .channel import FrameChannel
from .errors import AssignmentRefused, AssignmentTimeout, BringupError
from .flags import BringupSettings
from .machine import (
    Aborted,
    Activated,
    Assignment,
    CommitRequested,
    OfferAccepted,
    OfferRefused,
    PeerFacts,
    PeerMachine,
    Queried,
    StoodBy,
)
from .plan import peer_header, publish, stage_file
from .wire import ASSIGNMENT_WAIT_S

log = logging.getLogger("mlxcel.entrypoints.pp_peer")


@dataclass(frozen=True)
class Activation:
    """What an activated peer runs: its assignment and where its cluster TOML was written."""

    assignment: Assignment
    path: Path


class _Session:
    """One authenticated assignment connection; duck-types what ``Listener`` expects of a
    ``Connection`` (``read_loop``, ``close``, ``thread``, ``peer``)."""

    def __init__(self, agent: "PeerAgent", sock: socket.socket, peer: PeerId, est: Established) -> None:
        self.agent, self.peer = agent, peer
        self.channel = FrameChannel(sock, peer, est)
        self.thread: threading.Thread | None = None

    def read_loop(self) -> None:
        try:
            self.agent.serve_session(self)
        finally:
            self.channel.close()
            self.agent.forget(self)

    def close(self) -> None:
        self.channel.close()


class PeerAgent:
    """Waits for a stage assignment; accepts at most one coordinator session at a time."""

    def __init__(self, settings: BringupSettings, facts: PeerFacts, secret: ClusterSecret, *,
                 warnings: RateLimitedLog | None = None, wait_s: float = ASSIGNMENT_WAIT_S) -> None:
        self.settings, self.facts, self.secret = settings, facts, secret
        self.warnings = warnings or cluster_warnings
        self.wait_s = wait_s
        self._closing = threading.Event()
        options = TransportOptions.for_assignment(max_connections=4)
        self._listener = Listener(secret, options, self.warnings, self._closing, self._make_session)  # type: ignore[arg-type]
        self._beacons: BeaconSender | None = None
        self._cond = threading.Condition()
        self._active: _Session | None = None
        self._outcome: Activation | AssignmentRefused | None = None
        self._deadline = time.monotonic() + wait_s
        self.standby_for: PeerId | None = None  # a spare: the coordinator that keeps it (no wait limit)
        self.address: PeerId | None = None

    # -- starting and stopping --

    def start(self) -> PeerId:
        """Bind the assignment listener (``OSError`` if taken) and start beaconing (mdns)."""
        port = self._listener.start(self.settings.control, "assignment")
        self.address = PeerId(self.settings.control.host, port)
        self.facts = replace(self.facts, listener=self.address)
        if self.settings.discovery == "mdns":
            self._beacons = BeaconSender(self.secret, mlxcel=self.facts.mlxcel, cluster=self.facts.cluster,
                                         address=self.address, target=self.settings.discovery_target,
                                         port=self.settings.discovery_port)
            self._beacons.start()
        return self.address

    def close(self) -> None:
        """Stop beaconing and listening; close any session (the port is free afterwards)."""
        if self._beacons is not None:
            self._beacons.close()
        self._closing.set()
        me = threading.current_thread()
        for t in self._listener.stop():
            if t is not me:
                t.join(5.0)
        self._listener.close_socket()

    @property
    def state(self) -> str:
        """``waiting``, ``standby`` (a spare), ``assigning`` (a coordinator's session is open) or ``activated``."""
        if self._outcome is not None:
            return "activated" if isinstance(self._outcome, Activation) else "refused"
        if self._active is not None:
            return "assigning"
        return "standby" if self.standby_for is not None else "waiting"

    @property
    def pending_handshakes(self) -> int:
        return self._listener.pending

    # -- the wait --

    def wait(self, stop: threading.Event) -> Activation | None:
        """Block until activated (the assignment), stopped (None), refused fatally or timed out."""
        with self._cond:
            while self._outcome is None:
                if stop.is_set():
                    return None
                if self._active is None and self.standby_for is None and time.monotonic() >= self._deadline:
                    raise AssignmentTimeout(f"no stage assignment within {self.wait_s:g}s")
                self._cond.wait(0.2)
            outcome = self._outcome
        if isinstance(outcome, AssignmentRefused):
            raise outcome
        return outcome

    def _finish(self, outcome: Activation | AssignmentRefused) -> None:
        with self._cond:
            self._outcome = outcome
            self._cond.notify_all()

    def _back_to_waiting(self) -> None:
        with self._cond:
            self._deadline = time.monotonic() + self.wait_s
        if self._beacons is not None and self.standby_for is None:  # a standby's coordinator knows it
            self._beacons.resume()

    # -- sessions (listener threads) --

    def _make_session(self, sock: socket.socket, peer: PeerId, est: Established) -> _Session:
        return _Session(self, sock, peer, est)

    def forget(self, session: _Session) -> None:
        self._listener.discard(session)  # type: ignore[arg-type]

    def serve_session(self, session: _Session) -> None:
        with self._cond:
            keeper = self.standby_for
            busy = self._active is not None or self._outcome is not None
            foreign = keeper is not None and session.peer != keeper  # a spare serves only its coordinator
            if not busy and not foreign:
                self._active = session
        machine = PeerMachine(self.facts, session.peer, session.channel.local_ip)
        if busy or foreign:
            self._refuse_busy(session, machine, "this peer is busy with another coordinator's assignment" if busy
                              else f"this peer is a spare of the coordinator at {keeper}")
            return
        staged: list[Path] = []
        try:
            self._drive(session, machine, staged)
        except (BringupError, ClusterError, OSError) as exc:
            self.warnings.warning(WarnClass.DIAGNOSTIC, "assignment session with %s ended: %s; waiting again",
                                  session.peer, exc)
        finally:
            for path in staged:
                if path.exists():
                    path.unlink()
            with self._cond:
                self._active = None
            if self._outcome is None:
                self._back_to_waiting()

    def _refuse_busy(self, session: _Session, machine: PeerMachine, reason: str) -> None:
        try:
            event = machine.receive(session.channel.recv(machine.wait_s))
            if isinstance(event, Queried):
                session.channel.send(machine.refuse(reason))
        except (BringupError, ClusterError, OSError) as exc:
            log.debug("second assignment session from %s ended: %s", session.peer, exc)

    def _drive(self, session: _Session, machine: PeerMachine, staged: list[Path]) -> None:
        chan = session.channel
        while True:
            event = machine.receive(chan.recv(machine.wait_s))
            if isinstance(event, Queried):
                checked = self.standby_for == session.peer  # a spare's periodic check: not worth a line
                (log.debug if checked else log.info)("queried by the coordinator at %s", session.peer)
                chan.send(event.reply)
            elif isinstance(event, OfferAccepted):
                a = event.assignment
                log.info("accepted %s (layers %s) from the coordinator at %s", a.node_id, format_range(*a.layers),
                         session.peer)
                chan.send(event.reply)
            elif isinstance(event, OfferRefused):
                self._refused(session, event)
                return
            elif isinstance(event, CommitRequested):
                assert machine.assignment is not None
                reply = self._prepare(machine, staged)
                chan.send(reply)
                if machine.state != "COMMITTED":
                    return
                if self._beacons is not None:
                    self._beacons.pause()
            elif isinstance(event, Activated):
                self._activate(event.assignment, staged)
                return
            elif isinstance(event, StoodBy):
                self._stand_by(session.peer, event.stages)
                return
            elif isinstance(event, Aborted):
                log.warning("the coordinator at %s aborted the assignment: %s; waiting again", session.peer, event.reason)
                return

    def _stand_by(self, coordinator: PeerId, stages: int) -> None:
        """A spare: wait (with no time limit, beacons stopped) for this coordinator to assign a stage."""
        again = self.standby_for == coordinator  # the coordinator's periodic check
        self.standby_for = coordinator
        if self._beacons is not None:
            self._beacons.pause()
        if not again:
            log.info("standing by as a spare of the %d-stage cluster of the coordinator at %s", stages,
                     coordinator)

    def _refused(self, session: _Session, event: OfferRefused) -> None:
        try:
            session.channel.send(event.reply)
        except (BringupError, OSError):
            pass
        if event.refusal.fatal:
            self._finish(AssignmentRefused(event.refusal.reason))
        else:
            log.warning("refused the offer of the coordinator at %s: %s; waiting again", session.peer, event.refusal.reason)

    def _prepare(self, machine: PeerMachine, staged: list[Path]) -> bytes:
        """Stage the cluster TOML next to its final path and read it back: COMMITTED or COMMIT_FAILED."""
        a = machine.assignment
        assert a is not None
        path = self.settings.config_path(a.node_id)
        try:
            tmp = stage_file(path, peer_header(a.node_id, a.coordinator) + a.toml)
            staged.append(tmp)
            load_cluster_config(tmp).node(a.node_id)
        except OSError as exc:
            reason = f"cannot write the cluster TOML {path}: {exc.strerror or type(exc).__name__}"
        except ClusterConfigError as exc:
            reason = f"the staged cluster TOML does not load: {exc}"
        else:
            log.info("committed %s; cluster TOML staged for %s", a.node_id, path)
            return machine.committed()
        log.error("cannot commit %s: %s", a.node_id, reason)
        return machine.commit_failed(reason)

    def _activate(self, assignment: Assignment, staged: list[Path]) -> None:
        """Close the assignment listener (its port becomes the stage's), then publish the TOML; the
        session's connection closes after this, which tells the coordinator it may dial the stage."""
        self._listener.stop_accepting()
        path = self.settings.config_path(assignment.node_id)
        try:
            publish(staged.pop(), path)
        except OSError as exc:
            self._finish(AssignmentRefused(f"activated but cannot write the cluster TOML {path}: "
                                           f"{exc.strerror or type(exc).__name__}"))
            return
        self._finish(Activation(assignment, path.resolve()))


def physical_memory() -> int:
    """Bytes of physical memory this host reports (the bound a peer offers its stage)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 62  # unknown: no bound
