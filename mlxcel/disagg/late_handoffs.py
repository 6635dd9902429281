"""Late HANDED_OFF bookkeeping of the router (docs/disagg.md §7.1).

A prefill node's HANDED_OFF travels on another connection than the decode node's FINISH, so it may
arrive after its attempt ended. The router then still counts that handoff, once, and only when it
comes from that attempt's prefill node: ``LateHandoffs`` remembers the expected prefill node of the
last ``MAX_LATE_HANDOFFS`` ended attempts. A HANDED_OFF from any other node is ``FORGED``: it changes
nothing here, so the real one still counts when it comes.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict

from mlxcel.cluster.identity import PeerId

MAX_LATE_HANDOFFS = 1024  # ended attempts whose HANDED_OFF may still come (their handoff is counted then)


class Late(enum.Enum):
    """What a HANDED_OFF for an ended attempt is."""

    COUNT = "count"  # from that attempt's prefill node, the first: count the handoff
    FORGED = "forged"  # from a node that was not that attempt's prefill node: drop it, a protocol violation
    UNKNOWN = "unknown"  # no handoff expected (counted already, never dispatched, or forgotten): drop quietly


class LateHandoffs:
    """The prefill node of each recently ended attempt whose HANDED_OFF has not come yet (thread-safe)."""

    def __init__(self, limit: int = MAX_LATE_HANDOFFS):
        self.limit = limit
        self._expected: OrderedDict[str, PeerId] = OrderedDict()  # ended attempt's nonce -> its prefill node
        self._lock = threading.Lock()

    def expect(self, nonce: str, prefill: PeerId) -> None:
        """An attempt ended before its HANDED_OFF: count it later, once, from ``prefill`` only."""
        with self._lock:
            self._expected[nonce] = prefill
            while len(self._expected) > self.limit:
                self._expected.popitem(last=False)

    def claim(self, nonce: str, sender: PeerId) -> Late:
        """A HANDED_OFF for the ended attempt ``nonce`` came from ``sender``: whether it counts."""
        with self._lock:
            expected = self._expected.get(nonce)
            if expected is None:
                return Late.UNKNOWN
            if expected != sender:
                return Late.FORGED
            del self._expected[nonce]
            return Late.COUNT

    def __len__(self) -> int:
        return len(self._expected)
