"""The router's bookkeeping of held requests and late handoffs, on plain data (docs/disagg.md §6.2, §7.1)."""

from __future__ import annotations

from dataclasses import dataclass

from mlxcel.cluster.identity import PeerId
from mlxcel.disagg.holding import HeldRequests
from mlxcel.disagg.late_handoffs import Late, LateHandoffs
from mlxcel.disagg.policy import node_failure
from mlxcel.engine.holding import Hold
from mlxcel.error_codes import ErrorCode


@dataclass(eq=False)
class Req:
    """A held request as the hold sees it (``mlxcel.engine.holding.HeldSequence``)."""

    name: str
    arrived: float = 100.0
    held_since: float = 0.0


def test_held_requests_start_in_arrival_order_until_a_role_has_no_node():
    held: HeldRequests[str, Req] = HeldRequests(30.0, 4)
    for i, name in enumerate("abc"):
        held.hold(name, Req(name), 100.0 + i)
    started: list[str] = []
    assert held.place(lambda r: r.name != "b" and not started.append(r.name)) == 1  # "b" finds no node: round ends
    assert started == ["a"] and len(held) == 2
    assert held.place(lambda r: started.append(r.name) is None) == 2 and started == ["a", "b", "c"]
    assert held.holds == 3 and held.hold_failed == 0


def test_held_requests_expire_at_their_own_deadline_and_are_bounded():
    held: HeldRequests[str, Req] = HeldRequests(2.0, 2)
    a, b = Req("a"), Req("b")
    held.hold("a", a, 100.0)
    held.hold("b", b, 101.0)
    assert (a.held_since, b.held_since) == (100.0, 101.0)  # each from the moment it was held
    assert not held.can_hold()  # the bound
    assert held.expired(101.99) == [] and held.expired(102.0) == [a] and held.hold_failed == 1
    assert held.can_hold() and held.drop("b") is b and held.drop("b") is None and len(held) == 0
    assert not HeldRequests(2.0, 2, enabled=False).can_hold()  # resuming off: 503 at once


def test_the_routers_hold_is_the_coordinators_clock_and_text():
    """One hold budget and one 503 text for a held request, the coordinator's (``mlxcel.engine.holding``)."""
    held: HeldRequests[str, Req] = HeldRequests(30.0, 4)
    assert isinstance(held.clock, Hold) and held.wait_s == 30.0
    late = Req("late", arrived=95.0)
    held.hold("late", late, 100.0)
    assert held.expired(129.9) == [] and held.expired(130.0) == [late]
    cause = "no prefill node is up (prefill-0 down or draining); retry later"
    text = held.message(late, 130.0, cause)
    assert text == Hold(30.0).message(late, 130.0, cause)
    assert text == (f"{cause} (the request waited 35.0s for it, held 30.0s of them; --resume-timeout 30s)")


def test_a_late_handoff_counts_once_and_only_from_its_attempts_prefill_node():
    late, real, other = LateHandoffs(limit=2), PeerId.parse("127.0.0.1:1"), PeerId.parse("127.0.0.2:1")
    late.expect("n1", real)
    assert late.claim("n1", other) is Late.FORGED  # changes nothing
    assert late.claim("n1", real) is Late.COUNT and late.claim("n1", real) is Late.UNKNOWN
    for nonce in ("n2", "n3", "n4"):
        late.expect(nonce, real)
    assert len(late) == 2 and late.claim("n2", real) is Late.UNKNOWN  # the oldest forgotten


def test_a_nodes_cancelled_is_that_nodes_failure_and_other_codes_are_kept():
    failure = node_failure(ErrorCode.CANCELLED, "shutting down", "decode-0")
    assert failure.code is ErrorCode.INTERNAL and failure.peer_code is ErrorCode.CANCELLED
    assert str(failure) == "decode-0 cancelled the request on its own (shutting down)"
    assert node_failure(ErrorCode.OVERLOADED, "busy", "prefill-0").code is ErrorCode.OVERLOADED
