"""The router's request record: its states, the transitions between them as data, and the resume and hold
pieces it shares with the scheduler (docs/disagg.md §5, "Router request"; docs/engine.md, "Request states")."""

from __future__ import annotations

import ast
import re
import itertools
from pathlib import Path

import pytest

from mlxcel.disagg.routed import ROUTE_TRANSITIONS, Routed, RouteState, finished_state
from mlxcel.engine.interface import EngineRequest, FinishEvent
from mlxcel.engine.requests import IllegalTransition, Stateful
from mlxcel.engine.sampling import SamplingParams

R = RouteState
ENDS = {R.FINISHED_STOPPED, R.FINISHED_LENGTH, R.FINISHED_ERROR, R.FINISHED_CANCELLED}
EXPECTED = {
    R.NEW: {R.PREFILLING, R.HELD},
    R.HELD: {R.PREFILLING, R.FINISHED_ERROR, R.FINISHED_CANCELLED},
    R.PREFILLING: {R.PREFILLING, R.DECODING, R.RESUMING} | ENDS,
    R.DECODING: {R.PREFILLING, R.RESUMING} | ENDS,
    R.RESUMING: {R.PREFILLING, R.FINISHED_ERROR, R.FINISHED_CANCELLED},
    **{end: set() for end in ENDS},
}
DISAGG = Path(__file__).resolve().parents[2] / "mlxcel" / "disagg"
ROUTER_MODULES = ("router_engine.py", "routed.py", "waiting.py", "holding.py", "late_handoffs.py", "policy.py")


def routed(rid: str = "r1") -> Routed:
    return Routed(EngineRequest((1, 2, 3), SamplingParams(max_tokens=4), request_id=rid), stream=None)


def test_the_router_record_uses_the_engines_state_machinery():
    assert issubclass(Routed, Stateful) and Routed.transitions is ROUTE_TRANSITIONS
    assert {s: set(row) for s, row in ROUTE_TRANSITIONS.items()} == EXPECTED
    assert routed().state is R.NEW and {s for s in R if s.finished} == ENDS


def test_every_path_of_a_routed_request_moves_through_the_table():
    paths = [
        [R.PREFILLING, R.DECODING, R.FINISHED_STOPPED],  # dispatched, handed off, finished
        [R.PREFILLING, R.FINISHED_LENGTH],  # the FINISH came before the HANDED_OFF (other connection)
        [R.HELD, R.PREFILLING, R.PREFILLING, R.DECODING, R.RESUMING, R.PREFILLING, R.FINISHED_ERROR],
        [R.HELD, R.FINISHED_CANCELLED],
        [R.PREFILLING, R.DECODING, R.PREFILLING, R.RESUMING, R.FINISHED_ERROR],
    ]
    for path in paths:
        r = routed()
        for to in path:
            was = r.state
            assert r.move(to) is was and r.state is to


@pytest.mark.parametrize("start, to", [(s, t) for s, t in itertools.product(R, R) if t not in EXPECTED[s]])
def test_an_illegal_move_raises_and_changes_nothing(start, to):
    r = routed("x")
    r.state = start
    with pytest.raises(IllegalTransition, match=f"request x: {start.name} -> {to.name} is not a transition"):
        r.move(to)
    assert r.state is start


def test_the_finished_state_follows_the_finish_event():
    assert finished_state(FinishEvent("stop")) is R.FINISHED_STOPPED
    assert finished_state(FinishEvent("length")) is R.FINISHED_LENGTH
    assert finished_state(FinishEvent("error", error="boom")) is R.FINISHED_ERROR
    assert finished_state(FinishEvent("stop", error="a node's stop with an error")) is R.FINISHED_ERROR


def _source(name: str) -> ast.Module:
    return ast.parse((DISAGG / name).read_text(encoding="utf-8"))


def test_the_router_computes_no_resume_or_hold_budget_of_its_own():
    """The hold's budget from the moment first held, the resume deadline and the retry cadence are the
    engine's (``mlxcel.engine.holding.Hold``, ``mlxcel.engine.resume_policy``): no sum or comparison with a
    budget or a deadline in the router's modules, and no retry period of their own."""
    budgets = ("wait_s", "resume_timeout_s", "resume_deadline", "held_since")
    found = []
    for name in ROUTER_MODULES:
        for node in ast.walk(_source(name)):
            if isinstance(node, (ast.BinOp, ast.Compare)) and any(b in ast.unparse(node) for b in budgets):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Constant) and node.value == 0.5:
                found.append(f"{name}:{node.lineno}: a 0.5 s period of its own")
    assert found == []


def test_the_router_imports_the_engines_resume_and_hold_pieces():
    imported = {(n.module, a.name) for name in ROUTER_MODULES
                for n in ast.walk(_source(name)) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {("mlxcel.engine.holding", "Hold"), ("mlxcel.engine.resume_policy", "ResumePolicy"),
            ("mlxcel.engine.resume_policy", "RETRY_S"), ("mlxcel.engine.resume", "replayable"),
            ("mlxcel.engine.requests", "Stateful")} <= imported


def test_the_docs_table_lists_every_transition():
    """docs/disagg.md §5's router request table is ``ROUTE_TRANSITIONS`` (``FINISHED_*``: every finished state)."""
    text = (DISAGG.parents[1] / "docs" / "disagg.md").read_text(encoding="utf-8")
    section = text.split("**Router request**", 1)[1].split("\n## ", 1)[0]

    def states(cell: str) -> set[RouteState]:
        names = re.findall(r"`(\w+\*?)`", cell)
        return {s for n in names for s in (ENDS if n == "FINISHED_*" else {R[n]})}

    rows = re.findall(r"^\| (`[^|]*) \| ([^|]*) \|", section, re.M)
    documented = {s: states(targets) for cell, targets in rows for s in states(cell)}
    assert documented == EXPECTED
