"""New requests the router holds while no prefill or no decode node is up (docs/disagg.md §6.2).

The router's counterpart of the pipeline coordinator's held requests (docs/pipeline.md §5.6): a new
request that finds no node of a role up is not refused at once (with resuming on) but waits, in
arrival order, for both roles to be up again, each at most ``wait_s`` (``--resume-timeout``) from the
moment it was first held, and at most ``limit`` at once (``--max-queue``). Each held request's clock and
the 503 text of one past its budget are the coordinator's own (``mlxcel.engine.holding.Hold``), so the
two hold alike. ``HeldRequests`` is the bookkeeping only (no sockets, threads or clocks of its own; the
router calls it under its lock and drives ``place``/``expired`` from a ``RETRY_S`` timer and from a node
coming up).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

from mlxcel.engine.holding import HeldSequence, Hold

Item = TypeVar("Item", bound=HeldSequence)
Key = TypeVar("Key", bound=Hashable)


class HeldRequests(Generic[Key, Item]):
    """Held requests in arrival order, the bound, and the coordinator's counters; the clock is ``Hold``'s."""

    def __init__(self, wait_s: float, limit: int, *, enabled: bool = True):
        self.clock = Hold(wait_s)  # each held request's budget from the moment it was first held, and its 503
        self.limit, self.enabled = limit, enabled
        self._queue: OrderedDict[Key, Item] = OrderedDict()
        self.holds = 0  # requests ever held (mlxcel_requests_held_total)
        self.hold_failed = 0  # held requests that reached the deadline (mlxcel_hold_failed_requests_total)

    @property
    def wait_s(self) -> float:
        return self.clock.wait_s

    def __len__(self) -> int:
        return len(self._queue)

    def can_hold(self) -> bool:
        """Whether one more request may be held (holding is on and the bound leaves room)."""
        return self.enabled and len(self._queue) < self.limit

    def hold(self, key: Key, item: Item, now: float) -> None:
        """Hold ``item`` from ``now`` (the caller checked ``can_hold``)."""
        Hold.hold(item, now)
        self._queue[key] = item
        self.holds += 1

    def drop(self, key: Key) -> Item | None:
        """Stop holding ``key`` (its client went away); the request, or None if it was not held."""
        return self._queue.pop(key, None)

    def place(self, start: Callable[[Item], bool]) -> int:
        """Start held requests in arrival order while ``start(item)`` can (it returns False when no node of a
        role is up, which ends the round); returns how many started."""
        started = 0
        for key, item in list(self._queue.items()):
            if not start(item):
                break
            del self._queue[key]
            started += 1
        return started

    def expired(self, now: float) -> list[Item]:
        """The held requests whose budget is spent, no longer held (each counts in ``hold_failed``)."""
        gone = [key for key, item in self._queue.items() if self.clock.expired(item, now)]
        self.hold_failed += len(gone)
        return [self._queue.pop(key) for key in gone]

    def message(self, item: Item, now: float, cause: str) -> str:
        """The 503 text of ``item`` past its budget: ``cause``, how long it waited and was held (``Hold``'s)."""
        return self.clock.message(item, now, cause)

    def take_all(self) -> list[Item]:
        """Every held request, no longer held (the router shuts down)."""
        items = list(self._queue.values())
        self._queue.clear()
        return items
