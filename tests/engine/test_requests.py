"""The request table (``mlxcel.engine.requests``) alone: no scheduler, no executor, no thread."""

from __future__ import annotations

import pytest

from mlxcel.engine.interface import EngineRequest
from mlxcel.engine.requests import IllegalTransition, RequestState, RequestTable, Seq
from mlxcel.engine.sampling import SamplingParams

S = RequestState


def seq(rid: str) -> Seq:
    return Seq(EngineRequest((1, 2), SamplingParams(max_tokens=2), request_id=rid), None, None)  # type: ignore[arg-type]


def test_each_queued_state_keeps_its_queue_in_arrival_order():
    table = RequestTable()
    a, b, c = seq("a"), seq("b"), seq("c")
    for s in (a, b, c):
        table.add(s)
    assert list(table.waiting) == [a, b, c] and table.admitted() == 0
    assert table.move(b, S.PREFILLING) is S.WAITING
    table.move(a, S.PREFILLING)
    assert list(table.waiting) == [c] and list(table.prefilling) == [b, a] and table.admitted() == 2
    table.move(b, S.JOINING)
    table.move(b, S.RUNNING)  # RUNNING has no queue: the decode group names it
    assert list(table.joining) == [] and list(table.prefilling) == [a] and table.get("b") is b
    table.move(a, S.RESUMING)
    assert list(table.resuming) == [a]


def test_a_finished_request_leaves_the_table_and_moves_no_more():
    table = RequestTable()
    a = seq("a")
    table.add(a)
    table.move(a, S.FINISHED_CANCELLED)
    assert table.get("a") is None and len(table) == 0 and not table.waiting
    with pytest.raises(IllegalTransition, match="FINISHED_CANCELLED -> PREFILLING"):
        table.move(a, S.PREFILLING)


def test_an_illegal_move_changes_nothing():
    table = RequestTable()
    a = seq("a")
    table.add(a)
    with pytest.raises(IllegalTransition, match="WAITING -> RUNNING"):
        table.move(a, S.RUNNING)
    assert a.state is S.WAITING and list(table.waiting) == [a] and table.get("a") is a


def test_a_request_is_added_once_and_only_waiting():
    table = RequestTable()
    a = seq("a")
    table.add(a)
    with pytest.raises(IllegalTransition, match="added twice"):
        table.add(a)
    b = seq("b")
    b.state = S.RUNNING
    with pytest.raises(IllegalTransition):
        table.add(b)
    assert list(table.waiting) == [a] and len(table) == 1


def test_gauges_count_waiting_held_and_admitted():
    table = RequestTable()
    a, b, c = seq("a"), seq("b"), seq("c")
    for s in (a, b, c):
        table.add(s)
    table.move(a, S.PREFILLING)
    c.held_since = 1.0
    table.gauges(steps_inflight=2)
    got = table.counters
    assert (got.waiting, got.held, got.running, got.inflight_steps) == (2, 1, 1, 2)
