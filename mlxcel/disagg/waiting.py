"""Requests of the router that wait for nodes (docs/disagg.md §6.1, §6.2): new requests held while no
prefill or no decode node is up, and failed requests resumed once a node of each role is up.

``NodeWaits`` is a part of ``RouterEngine`` (a mixin: it uses the router's lock, policy, monitor, counters
and ``_dispatch``/``_fail``); the held requests' bookkeeping is ``mlxcel.disagg.holding.HeldRequests``.
Both wait the same way: tried again every ``RETRY_S`` (0.5 s) and, for held requests, at once when a node
comes up; each gives up after ``--resume-timeout`` with 503 + Retry-After.

The decisions are the engine's, shared with the scheduler's ``Resumer`` (``mlxcel.engine.resume``): the
router's ``ResumePolicy`` (``resume_policy``) bounds a resume (``allows``), sets its deadline (``begin``)
and says whether to try again (``again``); each held request's clock and 503 text are ``Hold``'s
(``mlxcel.engine.holding``, through ``HeldRequests``). What is the router's own: the error classes that
are never resumed (``mlxcel.disagg.policy.may_resume``), the timers that drive the tries, and the text
of a resume that ran out of time (it names the nodes that are down).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mlxcel.disagg.policy import NoneUp, Route, may_resume
from mlxcel.disagg.routed import Routed, RouteState
from mlxcel.engine.resume_policy import RETRY_S, ResumePolicy
from mlxcel.engine.textstream import SequenceText
from mlxcel.error_codes import ErrorCode

log = logging.getLogger("mlxcel.disagg.router")


class NodeWaits:
    """Holding new requests and resuming failed ones, until a node of each role is up (part of ``RouterEngine``)."""

    # the router's, which these methods share
    _lock: Any
    _hold_timer: threading.Timer | None
    cfg: Any
    nodes: Any
    _peers: Any
    held: Any
    policy: Any
    resume_policy: ResumePolicy
    monitor: Any
    exchanges: Any
    counters: dict[str, float]
    _by_rid: dict[str, Any]
    _tokenizer: Any
    _context_length: int
    _pick: Any  # PrefixRoutes'
    _key_of: Any

    def _none_up(self, none: NoneUp) -> str:
        ids = ", ".join(self.nodes[p].id for p in self._peers[none.role])
        return f"no {none.role} node is up ({ids} down or draining); retry later"

    # -- holding new requests while no node of a role is up (docs/disagg.md §6.2) -------------------------

    def _hold(self, routed: Routed, route: NoneUp | None) -> None:
        """Hold a new request (under the lock) until a node of each role is up, at most --resume-timeout."""
        if not len(self.held) and route is not None:
            log.warning("router: holding new requests until a prefill and a decode node are up (%s); each waits at "
                        "most %gs (--resume-timeout)", self._none_up(route), self.held.wait_s)
        self._by_rid[routed.request.request_id] = routed
        routed.move(RouteState.HELD)
        self.held.hold(routed.request.request_id, routed, time.monotonic())
        self._place_held()

    def _place_held(self) -> None:
        """Start the held requests a node of each role can take now, in arrival order; fail those past their
        deadline (503 + Retry-After); tick again in 0.5 s while any is held."""
        with self._lock:
            why: list[NoneUp] = []

            def start(routed: Routed) -> bool:
                route = self._pick(routed, self._usable)
                if isinstance(route, NoneUp):
                    why.append(route)
                    return False
                self._dispatch(routed, route.prefill, route.decode)
                return True

            if self.held.place(start):
                log.warning("router: nodes are up: held requests go on (%d still held)", len(self.held))
            now = time.monotonic()
            for routed in self.held.expired(now):
                cause = self._none_up(why[0]) if why else "no node could take it"
                log.warning("router: request %s held %gs and not started: %s", routed.request.request_id,
                            self.held.wait_s, cause)
                self._fail(routed, ErrorCode.UNAVAILABLE, self.held.message(routed, now, cause))
            if len(self.held) and self._hold_timer is None and not self.exchanges.closing:
                self._hold_timer = threading.Timer(RETRY_S, self._hold_tick)
                self._hold_timer.daemon = True
                self._hold_timer.start()

    def _hold_tick(self) -> None:
        with self._lock:
            self._hold_timer = None
        self._place_held()

    # -- resuming (docs/disagg.md §6.1) ----------------------------------------------------------------

    def _may_resume(self, routed: Routed, code: ErrorCode) -> bool:
        req = routed.request
        return may_resume(code, self.resume_policy, resumes=routed.resumes, closing=self.exchanges.closing,
                          tokens=len(routed.tokens), prompt=len(req.prompt), max_tokens=req.params.max_tokens,
                          context_length=self._context_length)

    def _resume(self, routed: Routed, code: ErrorCode, message: str) -> None:
        """Start resuming a failed request (under the lock): its text is assembled here from now on."""
        routed.move(RouteState.RESUMING)
        self.resume_policy.begin(routed, time.monotonic())
        routed.resume_error = (code, message)
        routed.key = self._key_of(routed.request.prompt + tuple(routed.tokens))  # the resumed attempt's prompt
        if routed.text is None and routed.tokens:
            routed.text = SequenceText(self._tokenizer, routed.request.params.stop)
            for token in routed.tokens:  # the state the node's text had: the client has all it released
                routed.text.feed(token)
        log.warning("router: %s: %s after %d tokens; resuming it (%d of at most %d)", routed.request.request_id,
                    message, len(routed.tokens), routed.resumes, self.cfg.max_resumes)
        self._try_resume(routed)

    def _try_resume(self, routed: Routed) -> None:
        """Dispatch the resumed attempt if a node of each role is up; else try again shortly, until the deadline."""
        with self._lock:
            if routed.state is not RouteState.RESUMING:  # cancelled (or shut down) meanwhile
                return
            route = self._pick(routed, self.monitor.is_up)
            if isinstance(route, Route):
                self.counters["resumed"] += 1
                self._dispatch(routed, route.prefill, route.decode)
                return
            if not self.exchanges.closing and self.resume_policy.again(routed, time.monotonic()):
                timer = threading.Timer(RETRY_S, self._try_resume, (routed,))
                timer.daemon = True
                timer.start()
                return
            self.counters["resume_failed"] += 1
            code, message = routed.resume_error
            self._fail(routed, code if code.retryable else ErrorCode.UNAVAILABLE,
                       f"{message}; could not be resumed within {self.resume_policy.wait_s:g}s "
                       f"(--resume-timeout): {self._unavailable(route)}")
