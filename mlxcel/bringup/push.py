"""The coordinator's side of the bring-up: reach every peer, plan, offer, commit, activate (docs/bringup.md §4).

``Push.run()`` is transactional: it commits only after every peer accepted and activates only after
every peer committed. Any failure sends ABORT (with the failure summary) to every peer still in the
session and raises ``BringupFailed`` naming each peer that did not commit, so a failed bring-up
starts no stage anywhere.

Bounds: the push window is 60 s from the start of the push; reaching the peers and the offer phase
end 10 s before it, so the commit phase keeps a full 10 s frame window; every reply is awaited at
most 10 s. A static peer that is not there yet is redialled every 500 ms; a handshake failure that a
retry cannot cure (a secret or identity mismatch, another protocol version) ends the push at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mlxcel.cluster.errors import ChannelMismatch, ClusterError, HandshakeError
from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.topology.partition import PartitionError, StageCosts

from .channel import FrameChannel, WireCount, dial
from .errors import BringupError, BringupFailed, ChannelClosed
from .machine import CoordinatorSession, Informed, PeerAccepted, PeerCommitFailed, PeerCommitted, PeerRefused
from .plan import ClusterPlan, offer_fields, order_peers, plan_cluster
from .wire import FRAME_TIMEOUT_S, OFFER_MARGIN_S, PUSH_WINDOW_S, STATIC_RETRY_S

#: a replacement push: the plan for the peers reached (address -> reported memory); ``PartitionError``
Planner = Callable[[dict[PeerId, int]], ClusterPlan]

log = logging.getLogger("mlxcel.entrypoints.pp_auto")


class _PeerFailed(Exception):
    """One peer's step failed; the text says how (it goes into the summary)."""


@dataclass
class _Peer:
    """The coordinator's state for one peer."""

    address: PeerId
    session: CoordinatorSession
    channel: FrameChannel | None = None
    memory: int | None = None
    node_id: str = ""
    failure: str | None = None
    absent: bool = False  # a single-dial push found no waiting peer there (``Push(redial=False)``)
    waited: bool = field(default=False, repr=False)

    def __str__(self) -> str:
        return f"{self.address} ({self.node_id})" if self.node_id else str(self.address)


@dataclass(frozen=True)
class PushConfig:
    """What the coordinator pushes: its identity, the model, the cluster."""

    control: PeerId
    cluster: str
    mlxcel: str
    model_identity: str
    costs: StageCosts
    secret_file: Path | None
    dry_run: bool = False


class Push:
    """One bring-up attempt against ``peers`` (their assignment listeners).

    The first ``stages`` peers in address order become the stages (all of them by default); the others
    are spares: reached and queried like the stages, then sent STANDBY once the stages are activated.
    ``planner`` replaces the planning (a spare taking over one stage of a running cluster). With
    ``redial=False`` a peer is dialled once: one that does not answer as a waiting peer is ``absent``
    (``Push.absent``) instead of redialled (a stage's restarted peer looked for, docs/bringup.md §5.7)."""

    def __init__(self, config: PushConfig, secret: ClusterSecret, peers: list[PeerId], *,
                 write_plan: Callable[[ClusterPlan], None], window_s: float = PUSH_WINDOW_S,
                 stop: threading.Event | None = None, stages: int | None = None,
                 planner: Planner | None = None, redial: bool = True) -> None:
        self.config, self._secret = config, secret
        self.peers = [_Peer(p, CoordinatorSession(p)) for p in peers]
        self.stages = len(peers) if stages is None else stages
        self._planner = planner or self._default_plan
        self._write_plan = write_plan
        self.redial = redial
        self.window_s = window_s
        self._stop = stop or threading.Event()
        self._give_up = threading.Event()  # a peer failed: the others stop redialling
        self.plan: ClusterPlan | None = None

    # -- the whole push --

    def run(self) -> ClusterPlan:
        """Assign every stage (or plan only, under dry run); raises ``BringupFailed``."""
        start = time.monotonic()
        deadline = start + self.window_s
        offer_deadline = deadline - OFFER_MARGIN_S
        try:
            self._phase(self._reach, offer_deadline)
            plan = self.plan = self._plan()
            if self.config.dry_run:
                self._write(plan)
                self._abort_all("dry run: the coordinator planned the cluster and exits")
                return plan
            staged = self.stage_peers
            self._phase(lambda p, _: self._offer(p, plan, offer_deadline), offer_deadline, staged)
            self._phase(self._commit, deadline, staged)
            self._write(plan)  # the coordinator's own commit: a failed bring-up leaves no file
        except _Abandon as exc:
            self._abort_all(str(exc))
            raise BringupFailed(str(exc)) from None
        for peer in staged:
            self._activate(peer)
        released = time.monotonic() + FRAME_TIMEOUT_S
        for peer in staged:
            self._await_release(peer, released)
        for peer in self.spare_peers:
            self._standby(peer, len(plan.stages))
        return plan

    def wire(self) -> WireCount:
        """What the coordinator's assignment connections of this push sent and received, summed over the
        peers (handshakes and frames; connections whose handshake failed are not counted)."""
        total = WireCount()
        for peer in self.peers:
            if peer.channel is not None:
                total.add(peer.channel.count)
        return total

    @property
    def absent(self) -> bool:
        """A single-dial push (``redial=False``) failed because some peer did not answer as a waiting peer."""
        return any(p.absent for p in self.peers)

    @property
    def stage_peers(self) -> list[_Peer]:
        return [p for p in self.peers if p.node_id]

    @property
    def spare_peers(self) -> list[_Peer]:
        return [p for p in self.peers if not p.node_id]

    def _phase(self, step: Callable[[_Peer, float], None], deadline: float, peers: list[_Peer] | None = None) -> None:
        """Run ``step`` for each of ``peers`` (every peer by default) in parallel; any failure abandons the bring-up."""
        errors: list[BaseException] = []

        def work(peer: _Peer) -> None:
            try:
                self._guarded(step, peer, deadline)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                errors.append(exc)

        # daemon threads: an interrupted coordinator exits without waiting for a dial or a read
        peers = self.peers if peers is None else peers
        threads = [threading.Thread(target=work, args=(p,), name="mlxcel-push", daemon=True) for p in peers]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:  # interrupted: stop redialling, end every pending read now
            self._interrupt()
            raise
        if errors:
            raise errors[0]
        failed = [p for p in self.peers if p.failure is not None]
        if failed:
            raise _Abandon(self._summary(failed))

    def _interrupt(self) -> None:
        self._stop.set()
        for peer in self.peers:
            if peer.channel is not None:
                peer.channel.close()  # a read blocked on another thread fails at once; the peer waits again

    def _guarded(self, step: Callable[[_Peer, float], None], peer: _Peer, deadline: float) -> None:
        try:
            step(peer, deadline)
        except _PeerFailed as exc:
            peer.failure = str(exc)
        except (BringupError, ClusterError, OSError) as exc:
            peer.failure = _describe(exc)
        if peer.failure is not None:
            self._give_up.set()

    def _summary(self, failed: list[_Peer]) -> str:
        others = [str(p) for p in self.peers if p.failure is None]
        text = "stage assignment failed and no stage was started: " + "; ".join(
            f"{p} did not commit: {p.failure}" for p in failed)
        return text + (f" (aborted: {', '.join(others)})" if others else "")

    # -- phase 1: reach each peer and learn its memory --

    def _reach(self, peer: _Peer, deadline: float) -> None:
        last = ""
        while True:
            if self._stop.is_set():
                raise _PeerFailed("the coordinator was stopped")
            if self._give_up.is_set():
                raise _PeerFailed(f"not reached before another peer failed ({last or 'no attempt'})")
            try:
                peer.channel = dial(peer.address, self.config.control, self._secret)
                break
            except HandshakeError as exc:
                if not self.redial and not_waiting(exc):
                    peer.absent = True
                    raise _PeerFailed(f"no waiting peer answers: {exc}") from None
                if not exc.retryable:  # a secret or identity mismatch: a retry cannot cure it
                    raise _PeerFailed(f"the handshake failed: {exc}") from None
                last = str(exc)
            except OSError as exc:
                last = exc.strerror or type(exc).__name__
                if not self.redial:
                    peer.absent = True
                    raise _PeerFailed(f"no waiting peer answers: {last}") from None
            if not peer.waited:
                log.info("waiting for peer %s (%s); retrying every %gs", peer.address, last, STATIC_RETRY_S)
                peer.waited = True
            if time.monotonic() + STATIC_RETRY_S >= deadline:
                raise _PeerFailed(f"unreachable within the push window: {last}")
            self._stop.wait(STATIC_RETRY_S)
        event = self._exchange(peer, peer.session.query(), deadline)
        if isinstance(event, PeerRefused):
            raise _PeerFailed(f"it refused: {event.refusal.reason}")
        assert isinstance(event, Informed)
        if event.mlxcel != self.config.mlxcel:
            raise _PeerFailed(version_mismatch(event.mlxcel, self.config.mlxcel))
        peer.memory = event.memory
        log.info("peer %s: mlxcel %s, %d bytes of memory", peer.address, event.mlxcel, event.memory)

    def _exchange(self, peer: _Peer, message: bytes, deadline: float) -> object:
        """Send one message and read the peer's answer within one frame window (and ``deadline``)."""
        assert peer.channel is not None
        wait = max(min(FRAME_TIMEOUT_S, deadline - time.monotonic()), 0.001)
        peer.channel.send(message, timeout=wait)
        return peer.session.receive(peer.channel.recv(wait))

    # -- planning --

    def _default_plan(self, memory: dict[PeerId, int]) -> ClusterPlan:
        """The first ``stages`` peers in address order are the stages; the rest are spares."""
        chosen = order_peers(list(memory))[: self.stages]
        return plan_cluster(self.config.costs, name=self.config.cluster, coordinator=self.config.control,
                            memory={p: memory[p] for p in chosen}, secret_file=self.config.secret_file)

    def _plan(self) -> ClusterPlan:
        memory = {p.address: p.memory for p in self.peers}
        try:
            plan = self._planner(memory)  # type: ignore[arg-type]
        except PartitionError as exc:
            raise _Abandon(f"stage assignment failed and no stage was started: cannot plan {self.stages} "
                           f"stages: {exc}") from None
        by_address = {s.address: s for s in plan.stages}
        for peer in self.peers:
            peer.node_id = by_address[peer.address].node_id if peer.address in by_address else ""
        return plan

    def _write(self, plan: ClusterPlan) -> None:
        try:
            self._write_plan(plan)
        except OSError as exc:
            raise _Abandon(f"stage assignment failed and no stage was started: cannot write the cluster TOML: "
                           f"{exc.strerror or type(exc).__name__} ({getattr(exc, 'filename', '')})") from None

    # -- phase 2: offer --

    def _offer(self, peer: _Peer, plan: ClusterPlan, deadline: float) -> None:
        stage = next(s for s in plan.stages if s.address == peer.address)
        message = peer.session.offer(**offer_fields(plan, stage.index, mlxcel=self.config.mlxcel,
                                                    model_identity=self.config.model_identity))
        event = self._exchange(peer, message, deadline)
        if isinstance(event, PeerRefused):
            kind = "refused the offer (that peer exits)" if event.refusal.fatal else "refused the offer"
            raise _PeerFailed(f"it {kind}: {event.refusal.reason}")
        assert isinstance(event, PeerAccepted)

    # -- phase 3: commit --

    def _commit(self, peer: _Peer, deadline: float) -> None:
        # the offer phase ended OFFER_MARGIN_S before the window: a full frame window is left
        event = self._exchange(peer, peer.session.commit(), float("inf"))  # exactly FRAME_TIMEOUT_S
        if isinstance(event, PeerCommitFailed):
            raise _PeerFailed(f"it could not prepare: {event.reason}")
        assert isinstance(event, PeerCommitted)

    # -- phase 4: activate; abort --

    def _activate(self, peer: _Peer) -> None:
        assert peer.channel is not None
        try:
            peer.channel.send(peer.session.activate())
        except (BringupError, OSError) as exc:
            log.warning("activating %s failed: %s (the coordinator's start-up will wait for that stage)", peer, exc)
            peer.channel.close()

    def _await_release(self, peer: _Peer, deadline: float) -> None:
        """Wait until an activated peer closes the connection: it closes its assignment listener
        first, so its stage address is free before the coordinator dials it (docs/bringup.md §5.3)."""
        assert peer.channel is not None
        if peer.channel.closed:
            return
        try:
            peer.channel.recv(max(deadline - time.monotonic(), 0.001))
            log.warning("%s sent a frame after activate; dialling its stage anyway", peer)
        except ChannelClosed:
            pass
        except (BringupError, ClusterError, OSError) as exc:
            log.warning("%s did not close its assignment connection after activate: %s", peer, exc)
        finally:
            peer.channel.close()

    def _standby(self, peer: _Peer, stages: int) -> None:
        """Tell a spare that the bring-up succeeded without it: it waits as a standby (docs/bringup.md §5.6)."""
        assert peer.channel is not None
        try:
            peer.channel.send(peer.session.standby(stages))
            log.info("peer %s waits as a spare", peer.address)
        except (BringupError, OSError) as exc:
            peer.failure = _describe(exc)
            log.warning("spare %s did not get its standby message: %s", peer.address, exc)
        finally:
            peer.channel.close()

    @property
    def spares(self) -> list[PeerId]:
        """The spares that were told to stand by (after ``run``)."""
        return [p.address for p in self.spare_peers if p.failure is None and p.session.state == "STANDBY"]

    def _abort_all(self, reason: str) -> None:
        for peer in self.peers:
            if peer.channel is None:
                continue
            try:
                if not peer.session.finished:
                    peer.channel.send(peer.session.abort(reason), timeout=2.0)
            except (BringupError, OSError) as exc:
                log.debug("abort to %s not delivered: %s", peer, exc)
            finally:
                peer.channel.close()


def version_mismatch(theirs: str, ours: str) -> str:
    """Why the coordinator refuses a peer whose ``info`` reports another mlxcel version."""
    return (f"mlxcel version mismatch: the peer runs mlxcel {theirs}, this coordinator runs {ours} "
            "(every node of a cluster runs the same mlxcel version)")


def not_waiting(exc: HandshakeError) -> bool:
    """A handshake failure that says nothing about the peer's secret or identity: a retryable one, a stage
    process serving the address (it listens for the transport channel) or one that does not answer in time."""
    return exc.retryable or isinstance(exc, (ChannelMismatch, TimeoutError))


class _Abandon(Exception):
    """The bring-up is abandoned; the text is the failure summary."""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, BringupError):  # AssignmentTimeout is a TimeoutError
        return f"connection failed: {exc.strerror or type(exc).__name__}"
    return str(exc)
