"""Spare peers of a --pp-auto coordinator: standbys that take over a stage which stays down (docs/bringup.md §5.6),
and a stage's own peer re-assigned when it comes back waiting (§5.7).

``SparePool.replace(node_id)`` runs one push against one standby (query, info, offer, commit, the
coordinator's file rewritten, activate): the plan is the running cluster's with that stage's address
set to the spare's, and the same layers. A spare that fails any step (unreachable, another secret or
identity, a refusal, a protocol error, a frame that does not open) is dropped from the pool with its
reason, and the next one is tried; None when no standby is left.

``start()`` checks every spare every 10 s (``SPARE_CHECK_S``) with a short session (query, info,
standby): one that does not answer is ``unreachable`` (with the reason) until it answers again, and is
tried after the ones that answered. After a takeover the stage's old address is ``replaced``: it is checked
the same way, quietly, and a peer waiting there (the old stage host started again) joins as a spare. Checks and
takeovers never overlap (one session per spare at a
time, or the spare would refuse the second as busy).

``SparePool.reassign(node_id)`` runs the same push against the stage's own address, dialled once: a
peer restarted there (same address, a new process waiting for an assignment) gets the same node id
and layers back. Nothing answering as a waiting peer is not an error; a peer that fails the push
(another secret, checkpoint or version, a refusal) is logged and dialled again only after
``REASSIGN_BACKOFF_S`` (30 s). No MLX here.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from mlxcel.cluster.identity import PeerId
from mlxcel.cluster.secret import ClusterSecret
from mlxcel.topology.partition import PartitionError, StageCosts, format_range, human_bytes, plan_stages

from mlxcel.cluster.errors import ClusterError

from .channel import dial
from .errors import BringupError
from .machine import CoordinatorSession, Informed, PeerRefused
from .plan import ClusterPlan
from .push import Push, PushConfig, version_mismatch
from .wire import (DEFAULT_SPARE_AFTER_S, FRAME_TIMEOUT_S, REASSIGN_BACKOFF_S, REASSIGN_CHECK_S, SPARE_CHECK_S,
                   SPARE_PUSH_WINDOW_S)

log = logging.getLogger("mlxcel.entrypoints.pp_auto")


def replacement_plan(plan: ClusterPlan, node_id: str, spare: PeerId, memory: int, costs: StageCosts) -> ClusterPlan:
    """``plan`` with stage ``node_id`` at ``spare`` (which reported ``memory``) and every layer range unchanged;
    ``PartitionError`` when that memory would split the model otherwise (the stages running keep their slices)."""
    index = next(i for i, s in enumerate(plan.stages) if s.node_id == node_id)
    old = plan.stages[index]
    memories = plan.memory
    memories[index] = memory
    planned = plan_stages(costs, len(plan.stages), memories)  # PartitionError: the spare cannot hold the stage
    if any((p.start, p.end) != (s.start, s.end) for p, s in zip(planned, plan.stages)):
        raise PartitionError(f"the spare {spare} reports {human_bytes(memory)} of memory, which would split the model "
                             f"differently from the running stages ({node_id} holds layers "
                             f"{format_range(old.start, old.end)}, {human_bytes(old.bytes)})")
    stages = list(plan.stages)
    stages[index] = replace(old, address=spare, memory=memory)
    return replace(plan, stages=tuple(stages))


class SparePool:
    """The standbys of one coordinator and the plan it runs; ``replace`` is called from one thread at a time."""

    def __init__(self, config: PushConfig, secret: ClusterSecret, plan: ClusterPlan, spares: list[PeerId], *,
                 write_plan: Callable[[ClusterPlan], None], after_s: float = DEFAULT_SPARE_AFTER_S,
                 window_s: float = SPARE_PUSH_WINDOW_S, reassign_backoff_s: float = REASSIGN_BACKOFF_S) -> None:
        self.config, self._secret = config, secret
        self.reassign_backoff_s = reassign_backoff_s
        self.plan = plan
        self.after_s = after_s
        self.reassign_check_s = REASSIGN_CHECK_S
        self._write_plan = write_plan
        self._window_s = window_s
        self._lock = threading.Lock()
        self._sessions = threading.Lock()  # one session (a check or a takeover) at a time
        self._stop = threading.Event()
        self._state: dict[PeerId, str] = {p: "standby" for p in spares}
        self._why: dict[PeerId, str] = {}
        self._replaced: dict[PeerId, str] = {}  # an address a spare took a stage from -> that stage's node id
        self.reassigned: dict[str, int] = {}  # node id -> how often its restarted peer was re-assigned
        self._refused_at: dict[str, float] = {}  # node id -> when its last re-assignment failed (monotonic)

    # -- liveness --

    def start(self, interval_s: float = SPARE_CHECK_S) -> "SparePool":
        """Check the spares every ``interval_s`` on a daemon thread until ``close``."""
        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.check_all()

        threading.Thread(target=loop, name="mlxcel-spares", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()

    def check_all(self) -> None:
        """One check of every spare still waiting (``standby`` or ``unreachable``) and of every ``replaced`` address:
        a peer waiting there (the stage's old host, started again) joins as a spare."""
        for spare in self._checked():
            with self._sessions:
                state = self._state.get(spare)
                if state not in ("standby", "unreachable", "replaced"):
                    continue
                try:
                    self._check(spare)
                except (BringupError, ClusterError, OSError) as exc:
                    if state == "replaced":
                        continue  # nothing waits there (yet): not an error
                    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
                    if state == "standby":
                        log.warning("spare %s does not answer: %s", spare, why)
                    self._set(spare, "unreachable", why)
                else:
                    if state == "unreachable":
                        log.warning("spare %s answers again", spare)
                    elif state == "replaced":
                        log.warning("the peer at %s joins as a spare (%s)", spare, self._adopted(spare))
                    self._set(spare, "standby")

    def _checked(self) -> list[PeerId]:
        with self._lock:
            return [p for p, s in self._state.items() if s in ("standby", "unreachable", "replaced")]

    def _adopted(self, address: PeerId) -> str:
        """Where the stage that ``address`` served before a takeover runs now, for the log."""
        node_id = self._replaced.pop(address, None)
        where = next((s.address for s in self.plan.stages if s.node_id == node_id), None)
        return f"{node_id} is served by {where}" if where is not None else "it served no stage"

    def _check(self, spare: PeerId) -> None:
        """query, info, standby on one short session; raises on any failure."""
        session = CoordinatorSession(spare)
        chan = dial(spare, self.config.control, self._secret)
        try:
            chan.send(session.query())
            event = session.receive(chan.recv(FRAME_TIMEOUT_S))
            if isinstance(event, PeerRefused):
                raise BringupError(f"it refused: {event.refusal.reason}")
            assert isinstance(event, Informed)
            if event.mlxcel != self.config.mlxcel:
                raise BringupError(version_mismatch(event.mlxcel, self.config.mlxcel))
            chan.send(session.standby(len(self.plan.stages)))
        finally:
            chan.close()

    def status(self) -> list[dict[str, Any]]:
        """Each spare and its state: ``standby``, ``unreachable`` (its last check failed; with ``reason``),
        ``assigning stage-i``, ``stage-i`` (took it over), ``failed`` (with ``reason``) or ``replaced`` (a stage's
        old address after a takeover, checked until a peer waits there; with ``reason``)."""
        with self._lock:
            return [{"address": str(p), "state": s,
                     **({"reason": self._why[p]} if s in ("unreachable", "failed", "replaced") and p in self._why
                        else {})}
                    for p, s in self._state.items()]

    def standbys(self) -> list[PeerId]:
        """The spares a takeover may try, in order: those that answered their last check, then the others."""
        with self._lock:
            return ([p for p, s in self._state.items() if s == "standby"]
                    + [p for p, s in self._state.items() if s == "unreachable"])

    @property
    def has_spares(self) -> bool:
        with self._lock:
            return bool(self._state)

    def reassign(self, node_id: str) -> bool:
        """Dial stage ``node_id``'s address once; a peer waiting there gets the stage back. True if it did."""
        now = time.monotonic()
        if node_id in self._refused_at and now < self._refused_at[node_id] + self.reassign_backoff_s:
            return False
        address = next(s.address for s in self.plan.stages if s.node_id == node_id)
        attempt = self._attempt(address, node_id, redial=False)
        try:
            self.plan = attempt.run()
        except BringupError as exc:
            if not attempt.absent:
                self._refused_at[node_id] = now
                log.warning("the peer at %s did not get %s back: %s (dialled again in %gs)", address, node_id, exc,
                            self.reassign_backoff_s)
            return False
        self.reassigned[node_id] = self.reassigned.get(node_id, 0) + 1
        log.warning("re-assigned %s (layers %s) to its restarted peer at %s", node_id,
                    format_range(*next((s.start, s.end) for s in self.plan.stages if s.node_id == node_id)), address)
        return True

    def replace(self, node_id: str) -> PeerId | None:
        """Assign stage ``node_id``'s layers to the first standby that completes the push; its address, or None."""
        for spare in self.standbys():
            self._set(spare, f"assigning {node_id}")
            try:
                with self._sessions:
                    plan = self._push(spare, node_id)
            except BringupError as exc:
                self._set(spare, "failed", str(exc))
                log.warning("spare %s did not take over %s: %s", spare, node_id, exc)
                continue
            old = next(s.address for s in self.plan.stages if s.node_id == node_id)
            self.plan = plan
            self._set(spare, node_id)
            self._replaced[old] = node_id
            self._set(old, "replaced", f"{node_id} was taken over by {spare}; a peer started again here joins as a "
                                       "spare")
            log.warning("spare %s took over %s (layers %s)", spare, node_id,
                        format_range(*next((s.start, s.end) for s in plan.stages if s.node_id == node_id)))
            return spare
        log.error("no spare left to take over %s: it stays down until it answers again (new requests wait for it at "
                  "most the resume timeout, then fail with 503)", node_id)
        return None

    def _push(self, spare: PeerId, node_id: str) -> ClusterPlan:
        return self._attempt(spare, node_id).run()

    def _attempt(self, peer: PeerId, node_id: str, *, redial: bool = True) -> Push:
        """One push of stage ``node_id`` (its layers unchanged) to ``peer``: a spare, or the stage's own address."""
        def planner(memory: dict[PeerId, int]) -> ClusterPlan:
            return replacement_plan(self.plan, node_id, peer, memory[peer], self.config.costs)

        return Push(self.config, self._secret, [peer], write_plan=self._write_plan, window_s=self._window_s,
                    stages=len(self.plan.stages), planner=planner, redial=redial)

    def _set(self, spare: PeerId, state: str, why: str | None = None) -> None:
        with self._lock:
            self._state[spare] = state
            if why is not None:
                self._why[spare] = why
