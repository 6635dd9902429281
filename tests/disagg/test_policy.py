"""The router's pick and retry policy on plain data: no sockets, threads or clocks (docs/disagg.md §6)."""

from __future__ import annotations

from typing import Callable

import pytest

from mlxcel.disagg.policy import (
    GiveUp,
    NoneUp,
    Route,
    RoundRobin,
    RoutePolicy,
    depends_on,
    final_code,
    may_retry,
)
from mlxcel.disagg.wire import MAX_DISPATCH_ATTEMPTS
from mlxcel.error_codes import ErrorClass, ErrorCode

PREFILL = ("p0", "p1", "p2")
DECODE = ("d0", "d1")


def up(*nodes: str) -> Callable[[str], bool]:
    return set(nodes).__contains__


def everyone(node: str) -> bool:
    return True


def policy(**kw) -> RoutePolicy[str]:
    return RoutePolicy(PREFILL, DECODE, **kw)


def picks(p: RoutePolicy[str], is_up: Callable[[str], bool], n: int) -> list[object]:
    return [p.pick(is_up) for _ in range(n)]


# -- round-robin -------------------------------------------------------------------------------------


def test_each_role_goes_round_robin_in_configuration_order():
    got = picks(policy(), everyone, 6)
    assert got == [Route("p0", "d0"), Route("p1", "d1"), Route("p2", "d0"),
                   Route("p0", "d1"), Route("p1", "d0"), Route("p2", "d1")]


def test_a_down_node_is_skipped_and_the_order_goes_on_after_the_one_picked():
    p = policy()
    assert picks(p, up("p0", "p2", "d0", "d1"), 4) == [
        Route("p0", "d0"), Route("p2", "d1"), Route("p0", "d0"), Route("p2", "d1")]


def test_a_node_that_comes_back_is_picked_in_its_turn():
    p = policy()
    assert p.pick(up("p0", "p2", "d0")) == Route("p0", "d0")
    assert p.pick(up("p0", "p2", "d0")) == Route("p2", "d0")
    assert p.pick(everyone) == Route("p0", "d1")  # the cursor wrapped past p2
    assert p.pick(everyone) == Route("p1", "d0")


def test_the_only_node_up_is_picked_every_time():
    assert picks(policy(), up("p1", "d1"), 3) == [Route("p1", "d1")] * 3


def test_a_failed_pick_leaves_the_cursor_of_a_role_with_no_node_up():
    ring = RoundRobin(["a", "b", "c"])
    assert ring.next(up("b")) == "b" and ring.cursor == 2
    assert ring.next(up()) is None and ring.cursor == 2
    assert ring.next(everyone) == "c"


def test_no_nodes_configured_is_none_up():
    assert RoundRobin([]).next(everyone) is None
    assert RoutePolicy([], ["d"]).pick(everyone) == NoneUp("prefill")


# -- no node up -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("alive, role", [(up("d0", "d1"), "prefill"), (up(*PREFILL), "decode"),
                                         (up(), "prefill")])
def test_no_node_of_a_role_up_is_unavailable_naming_it_prefill_first(alive, role):
    got = policy().pick(alive)
    assert got == NoneUp(role) and got.code is ErrorCode.UNAVAILABLE
    assert got.code.error_class is ErrorClass.UNAVAILABLE  # 503 + Retry-After, never 429 or 500


def test_a_pick_with_no_decode_node_still_moves_the_prefill_cursor():
    p = policy()  # the router's order as it has always been: both roles are asked before either is checked
    assert p.pick(up(*PREFILL)) == NoneUp("decode")
    assert p.pick(everyone) == Route("p1", "d0")


# -- retry bounds and codes -------------------------------------------------------------------------------


RETRYABLE = [c for c in ErrorCode if c.error_class not in (ErrorClass.BAD_INPUT, ErrorClass.CANCELLED)]
NOT_RETRYABLE = [c for c in ErrorCode if c not in RETRYABLE]


def test_the_retryable_codes_are_the_unavailable_and_internal_ones():
    assert {c.name for c in NOT_RETRYABLE} == {"BAD_REQUEST", "BAD_TENSOR", "UNSUPPORTED", "CANCELLED"}
    assert {ErrorCode.OVERLOADED, ErrorCode.TIMEOUT, ErrorCode.UNREACHABLE, ErrorCode.INTERNAL} <= set(RETRYABLE)


@pytest.mark.parametrize("code", RETRYABLE)
def test_a_retryable_code_before_the_first_token_fails_over(code):
    assert policy().after_failure(code, attempts=1, emitted=0, closing=False, is_up=everyone) == Route("p0", "d0")


@pytest.mark.parametrize("code", NOT_RETRYABLE)
def test_bad_input_and_cancelled_never_fail_over(code):
    assert policy().after_failure(code, attempts=1, emitted=0, closing=False, is_up=everyone) == GiveUp(code)


def test_attempts_are_bounded_by_max_dispatch_attempts():
    assert MAX_DISPATCH_ATTEMPTS == 3
    p = policy()
    decide = lambda n: p.after_failure(ErrorCode.TIMEOUT, attempts=n, emitted=0, closing=False, is_up=everyone)
    assert isinstance(decide(1), Route) and isinstance(decide(2), Route)
    assert decide(3) == GiveUp(ErrorCode.TIMEOUT) and decide(4) == GiveUp(ErrorCode.TIMEOUT)
    assert may_retry(ErrorCode.TIMEOUT, attempts=4, emitted=0, closing=False, max_attempts=5)
    assert not may_retry(ErrorCode.TIMEOUT, attempts=1, emitted=0, closing=False, max_attempts=1)


def test_a_request_that_emitted_a_token_never_fails_over():
    got = policy().after_failure(ErrorCode.UNREACHABLE, attempts=1, emitted=1, closing=False, is_up=everyone)
    assert got == GiveUp(ErrorCode.UNREACHABLE)


def test_nothing_fails_over_while_the_router_shuts_down():
    got = policy().after_failure(ErrorCode.UNAVAILABLE, attempts=1, emitted=0, closing=True, is_up=everyone)
    assert got == GiveUp(ErrorCode.UNAVAILABLE)


def test_a_failover_with_no_node_up_is_unavailable():
    got = policy().after_failure(ErrorCode.TIMEOUT, attempts=1, emitted=0, closing=False, is_up=up("p0"))
    assert got == NoneUp("decode")


def test_a_failover_skips_the_node_that_went_down():
    p = policy()
    assert p.pick(everyone) == Route("p0", "d0")
    got = p.after_failure(ErrorCode.UNREACHABLE, attempts=1, emitted=0, closing=False, is_up=up("p0", "p2", "d1"))
    assert got == Route("p2", "d1")


def test_giving_up_does_not_move_the_cursors():
    p = policy()
    p.after_failure(ErrorCode.BAD_REQUEST, attempts=1, emitted=0, closing=False, is_up=everyone)
    assert p.pick(everyone) == Route("p0", "d0")


# -- the code a request fails with ---------------------------------------------------------------------


@pytest.mark.parametrize("code, final", [
    (ErrorCode.BAD_REQUEST, ErrorCode.BAD_REQUEST), (ErrorCode.BAD_TENSOR, ErrorCode.BAD_TENSOR),
    (ErrorCode.UNSUPPORTED, ErrorCode.UNSUPPORTED), (ErrorCode.TIMEOUT, ErrorCode.TIMEOUT),
    (ErrorCode.OVERLOADED, ErrorCode.OVERLOADED), (ErrorCode.UNREACHABLE, ErrorCode.UNREACHABLE),
    (ErrorCode.CANCELLED, ErrorCode.CANCELLED), (ErrorCode.MISMATCH, ErrorCode.INTERNAL),
    (ErrorCode.CONFLICT, ErrorCode.INTERNAL), (ErrorCode.UNKNOWN, ErrorCode.INTERNAL),
])
def test_bad_input_keeps_its_code_and_other_codes_become_this_routers(code, final):
    assert final_code(code) is final
    got = policy().after_failure(code, attempts=MAX_DISPATCH_ATTEMPTS, emitted=0, closing=False, is_up=everyone)
    assert got == GiveUp(final)


# -- which attempts a lost node takes down -------------------------------------------------------------


@pytest.mark.parametrize("peer, handed_off, lost", [
    ("d0", False, True), ("d0", True, True),  # the decode node holds the sequence throughout
    ("p0", False, True), ("p0", True, False),  # the prefill node only until the handoff
    ("p1", False, False), ("d1", True, False),  # another node
])
def test_an_attempt_depends_on_its_decode_node_and_on_its_prefill_node_until_handed_off(peer, handed_off, lost):
    assert depends_on(peer, prefill="p0", decode="d0", handed_off=handed_off) is lost


def test_an_attempt_with_no_nodes_yet_depends_on_none():
    assert not depends_on("p0", prefill=None, decode=None, handed_off=False)
