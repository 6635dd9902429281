"""Peer health: periodic probes, up/down, restarts (a new boot id) and re-checks on return.

A ``PeerMonitor`` knows a fixed set of peers. Every ``interval_s`` it calls ``probe(peer,
answered)`` for each peer with no probe outstanding; the caller sends whatever its protocol uses
(the pipeline's GET_STATE, a router's health request) and later calls ``answered(state)`` with
the peer's state dict, or ``answered(None, why)`` when the probe failed or timed out.

A state is checked by ``check(peer, state)`` (raise ``ValueError`` to refuse it: a peer that
came back as another node or model stays down). The monitor then:

* marks the peer **up** (``on_up(peer, returned)``, ``returned`` True after it was down);
* notices a **restart** when the state's ``boot_id`` differs from the last one seen
  (``on_restart(peer)``, before ``on_up``): the peer lost whatever it held;
* marks a peer **down** on a failed or refused probe (``on_down(peer, why)``, once per outage).

No MLX, no sockets, no threads of its own: ``beat`` is driven by the caller's timer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .identity import PeerId

Answered = Callable[..., None]  # answered(state: dict | None, why: str = "")


@dataclass
class PeerStatus:
    """What the monitor knows of one peer."""

    peer: PeerId
    up: bool = False
    state: dict[str, Any] = field(default_factory=dict)
    last_seen: float = 0.0
    last_down: float = 0.0
    probing: bool = False


class PeerMonitor:
    """Up/down tracking of a fixed set of peers from probe answers."""

    def __init__(self, peers: Iterable[PeerId], *, interval_s: float,
                 probe: Callable[[PeerId, Answered], None],
                 check: Callable[[PeerId, dict[str, Any]], None] = lambda peer, state: None,
                 on_up: Callable[[PeerId, bool], None] = lambda peer, returned: None,
                 on_down: Callable[[PeerId, str], None] = lambda peer, why: None,
                 on_restart: Callable[[PeerId], None] = lambda peer: None):
        self.status = {p: PeerStatus(p) for p in peers}
        self.interval_s = interval_s
        self._probe, self._check = probe, check
        self._on_up, self._on_down, self._on_restart = on_up, on_down, on_restart
        self._next = 0.0
        self._lock = threading.Lock()

    def down(self) -> list[PeerId]:
        return [p for p, s in self.status.items() if not s.up]

    def is_up(self, peer: PeerId) -> bool:
        return self.status[peer].up

    def beat(self, now: float | None = None) -> None:
        """Probe every peer without an outstanding probe, at most once per ``interval_s``."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        self._next = now + self.interval_s
        for peer, status in list(self.status.items()):
            with self._lock:
                if status.probing:
                    continue
                status.probing = True
            self._probe(peer, self._answer_for(peer))

    def _answer_for(self, peer: PeerId) -> Answered:
        def answered(state: dict[str, Any] | None, why: str = "") -> None:
            status = self.status.get(peer)
            if status is None:  # replaced while the probe was out
                return
            status.probing = False
            if state is None:
                self.lost(peer, why or "no answer to a probe")
            else:
                self.observe(peer, state)
        return answered

    def observe(self, peer: PeerId, state: dict[str, Any]) -> bool:
        """A state the peer reported: checked, then up (or down if refused). True if accepted."""
        status = self.status.get(peer)
        if status is None:  # no longer watched (replaced)
            return False
        try:
            self._check(peer, state)
        except ValueError as exc:  # the caller's check logs why (rate-limited)
            self.lost(peer, f"it answers as a different node or model ({exc})")
            return False
        booted = status.state.get("boot_id")
        if booted is not None and state.get("boot_id") != booted:
            self._on_restart(peer)
        returned = not status.up and status.last_down > 0
        status.state, status.last_seen, status.up = state, time.monotonic(), True
        self._on_up(peer, returned)
        return True

    def replace(self, old: PeerId, new: PeerId) -> None:
        """Watch ``new`` instead of ``old``, in its place (a spare took that peer's role): down until it answers."""
        with self._lock:
            self.status = {(new if p == old else p): (PeerStatus(new) if p == old else s) for p, s in self.status.items()}

    def lost(self, peer: PeerId, why: str) -> None:
        """The peer failed a probe or a delivery: down (``on_down`` once per outage)."""
        status = self.status.get(peer)
        with self._lock:
            if status is None or not status.up:
                return
            status.up, status.last_down = False, time.monotonic()
        self._on_down(peer, why)
