"""Holding new requests while a node is down: which start failures hold, and the clock of each hold.

docs/pipeline.md §5.6, "Holding new requests". With resuming on, a new request whose start
(``prepare``) fails with a node failure stays queued (WAITING, *held*) instead of failing: the head of
the queue is tried again every ``RETRY_S``; the first start that succeeds ends the hold. Only a failure
of the unavailable class (``unreachable``, ``timeout``, ``unavailable``, ``overloaded``) that the
executor calls ``resumable`` holds; any other (a stage's ``not_found`` to PREPARE, reported
``internal``) ends the request at once with its own code.

Each held request waits at most ``wait_s`` (``--resume-timeout``) from the moment it was first held:
after its failed start came back (a PREPARE nobody answered takes its whole command timeout), or, for
one arriving while requests are held, from its arrival. Its 503 states how long it waited and was held.

The disaggregated router holds new requests the same way (docs/disagg.md §6.2): its ``HeldRequests``
(``mlxcel.disagg.holding``) keeps each held request's clock and 503 text with ``Hold`` (``hold``,
``expired``, ``message``); its cadence is the same ``RETRY_S``, driven by a timer instead of this hold's
``next_try`` (the router has no scheduler loop to poll it).
"""

from __future__ import annotations

from typing import Callable, Protocol

from mlxcel.engine.resume_policy import RETRY_S
from mlxcel.error_codes import code_of


class HeldSequence(Protocol):
    """What the hold reads and writes of a queued request."""

    arrived: float  # when the scheduler queued it (monotonic)
    held_since: float  # when it was first held (monotonic); 0.0: not held


def start_may_wait(exc: BaseException, resumable: Callable[[BaseException], bool] | None) -> bool:
    """Whether a failed start (``prepare``) is a node failure worth waiting for: its code is of the
    unavailable class (503 + Retry-After) and the executor calls it a node failure. A stage that answers
    PREPARE ``not_found`` (reported ``internal``) fails the request at once."""
    return resumable is not None and code_of(exc).retryable and resumable(exc)


class Hold:
    """Whether new requests are held now, when to try a start again, and each held request's clock."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self.next_try = 0.0  # the next try to start the head of the queue (monotonic); 0.0: not holding
        self.error: BaseException | None = None  # the last failed start's error

    @property
    def active(self) -> bool:
        return self.next_try > 0.0

    def due(self, now: float) -> bool:
        """Whether a start may be tried now (always, when not holding)."""
        return self.next_try <= now

    def failed(self, exc: BaseException, now: float) -> bool:
        """A start failed with ``exc`` and came back at ``now``: try again ``RETRY_S`` later. True if this
        begins a hold (it was not holding)."""
        began = not self.active
        self.next_try, self.error = now + RETRY_S, exc
        return began

    def end(self) -> None:
        self.next_try, self.error = 0.0, None

    @staticmethod
    def hold(seq: HeldSequence, now: float) -> bool:
        """Hold ``seq`` from ``now`` unless it is held already; True if it was not."""
        if seq.held_since:
            return False
        seq.held_since = now
        return True

    def expired(self, seq: HeldSequence, now: float) -> bool:
        return bool(seq.held_since) and now >= seq.held_since + self.wait_s

    def message(self, seq: HeldSequence, now: float, cause: object = None) -> str:
        """The error of a held request that reached its bound: ``cause`` (by default the last failed start's
        error), and the truth about how long it waited (since its arrival) and was held (since first held)."""
        cause = self.error if cause is None else cause
        return (f"{cause} (the request waited {now - seq.arrived:.1f}s for it, held "
                f"{now - seq.held_since:.1f}s of them; --resume-timeout {self.wait_s:g}s)")
