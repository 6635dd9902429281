"""Holding a new request whose start failed (docs/pipeline.md §5.6, "Holding new requests"), on the
scheduler with a fake executor whose ``prepare`` takes as long as a real unanswered PREPARE.

The budget of ``--resume-timeout`` starts when the request is first held, after the failed start came
back, not at its arrival: a start that waited long for its answer still gets its retries, a node back
within the budget serves it, and the 503 names the time it really waited. Only a start failure of the
unavailable class (unreachable, timeout, unavailable, overloaded) holds; any other (a stage's
``not_found`` to PREPARE, reported ``internal``) ends the request at once with its own status.
"""

from __future__ import annotations

import re
import time
from typing import Any, Sequence

import pytest

from mlxcel.engine.executor import ExecutorError
from mlxcel.engine.resume import ResumePolicy
from mlxcel.engine.sampling import SamplingParams
from mlxcel.error_codes import ErrorCode
from tests.engine.fakes import collect, run_async
from tests.engine.test_resume import LOST, ResumingExecutor, fail_decode_after, request, scheduler
from tests.engine.test_scheduler import http_of

pytestmark = pytest.mark.timeout(60)
SLOW_S = 1.2  # how long the first start waits for its answer (a PREPARE nobody answers)
BUDGET_S = 1.0  # --resume-timeout
SILENT = ExecutorError("stage stage-0 did not answer within 10s", ErrorCode.TIMEOUT)
NOT_FOUND = ExecutorError("stage 127.0.0.3:1 (not_found): request r was not prepared", ErrorCode.INTERNAL,
                          peer_code=ErrorCode.NOT_FOUND)


class SlowStart(ResumingExecutor):
    """The first start waits ``SLOW_S`` and fails ``SILENT``; later ones fail with ``then`` (None: succeed).
    ``resumable`` is the pipeline's: a retryable code, or a stage that does not know the sequence."""

    def __init__(self, then: Exception | None, *, first: Exception | None = SILENT, **kw: Any):
        super().__init__(policy=ResumePolicy(3, BUDGET_S), **kw)
        self.first, self.then = first, then
        self.starts: list[float] = []  # when each start was made (monotonic)

    def resumable(self, exc: BaseException) -> bool:
        return isinstance(exc, ExecutorError) and (exc.code.retryable or exc.peer_code is ErrorCode.NOT_FOUND)

    def prepare(self, rid: str, params: SamplingParams, top_logprobs: int, prompt: Sequence[int], *,
                draws: int = 0, attempt: int = 0) -> int:
        self.starts.append(time.monotonic())
        if len(self.starts) == 1 and self.first is not None:
            if self.first is SILENT:
                time.sleep(SLOW_S)
            raise self.first
        if self.then is not None:
            raise self.then
        return super().prepare(rid, params, top_logprobs, prompt, draws=draws, attempt=attempt)


def held_seconds(message: str) -> tuple[float, float]:
    """(waited, held) as the 503's message states them."""
    m = re.search(r"waited (\d+\.\d)s for it, held (\d+\.\d)s of them; --resume-timeout (\S+)s", message)
    assert m, message
    assert float(m.group(3)) == BUDGET_S
    return float(m.group(1)), float(m.group(2))


@run_async
async def test_the_budget_starts_when_the_request_is_first_held_and_retries_go_on_within_it():
    ex = SlowStart(then=LOST)
    with scheduler(ex) as sched:
        start = time.monotonic()
        tokens, finish = await collect(sched.submit(request("a")))
        end = time.monotonic()
        assert tokens == [] and finish.code is ErrorCode.UNREACHABLE, finish  # the last start's failure
        first_held = ex.starts[0] + SLOW_S  # the slow start came back: the request is held from here
        assert end >= first_held + BUDGET_S, (end - start, ex.starts)
        assert len(ex.starts) >= 2, "no retry within the budget"  # tried again every 0.5 s while held
        assert all(t >= first_held for t in ex.starts[1:])
        waited, held = held_seconds(finish.error)
        assert held >= BUDGET_S and waited >= SLOW_S + BUDGET_S and waited <= end - start + 0.05, finish.error
        reply = http_of(finish)
        assert (reply.status, reply.headers["Retry-After"]) == (503, "1")
        assert (sched.counters.holds, sched.counters.hold_failed) == (1, 1)


@run_async
async def test_a_node_back_within_the_budget_after_a_slow_failed_start_serves_the_request():
    ex = SlowStart(then=None)  # the retry succeeds
    with scheduler(ex) as sched:
        stream = sched.submit(request("a", max_tokens=2))
        await ex.drive(lambda: sched._inflight_requests == 0)  # noqa: SLF001 - served
        tokens, finish = await collect(stream)
        assert len(tokens) == 2 and finish.error is None, finish
        assert len(ex.starts) == 2 and (sched.counters.holds, sched.counters.hold_failed) == (1, 0)


@run_async
async def test_a_start_refused_not_found_ends_at_once_with_500_and_is_not_retried():
    ex = SlowStart(then=NOT_FOUND, first=NOT_FOUND)
    with scheduler(ex) as sched:
        start = time.monotonic()
        tokens, finish = await collect(sched.submit(request("a")))
        assert time.monotonic() - start < 0.5 and tokens == []
        assert finish.code is ErrorCode.INTERNAL and http_of(finish).status == 500, finish
        assert len(ex.starts) == 1 and sched.counters.holds == 0


@run_async
async def test_a_resume_whose_prepare_is_refused_not_found_ends_at_once():
    ex = SlowStart(then=None, first=None)  # starts fine; the resume's PREPARE is refused not_found
    with scheduler(ex) as sched:
        stream = sched.submit(request("a", max_tokens=6))
        await fail_decode_after(ex, 2)
        ex.then = NOT_FOUND
        start = time.monotonic()
        _, finish = await collect(stream)
        assert time.monotonic() - start < 1.0 and finish.code is ErrorCode.INTERNAL, finish
        assert len(ex.starts) == 2 and (sched.counters.resumed, sched.counters.resume_failed) == (0, 1)
